"""Plain greedy decoding: specjax vs transformers (PyTorch) generate on the same random checkpoint.

Both run side by side in one process, interleaved, after warmup; each figure is
the median of ``--reps`` repetitions. Compile time is reported separately.

    python benchmarks/bench_plain_vs_hf.py --out benchmarks/results/plain_vs_hf.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

import specjax
from models.llama import num_params


def make_checkpoint(path: Path, *, layers: int, hidden: int, vocab: int, heads: int, kv_heads: int) -> Path:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64 or 64,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=1024, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="specjax_bench_"))
    ckpt = make_checkpoint(tmp / "llama", layers=args.layers, hidden=args.hidden, vocab=args.vocab,
                           heads=args.heads, kv_heads=args.kv_heads)
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    max_batch = max(args.batches)
    t0 = time.perf_counter()
    llm = specjax.LLM(ckpt, max_model_len=args.prompt_len + args.new_tokens + 16, max_num_seqs=max_batch,
                      max_prefill_chunk=args.prompt_len, warmup=True)
    init_s = time.perf_counter() - t0
    metrics0 = llm.get_metrics()
    rng = np.random.default_rng(0)
    params = specjax.SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    results = {"machine": f"{platform.machine()} {torch.get_num_threads()} torch threads, CPU",
               "date": time.strftime("%Y-%m-%d"), "params": num_params(llm.runner.params),
               "config": vars(args) | {"out": str(args.out)}, "compile_seconds": metrics0["compile_seconds"],
               "num_compiled_buckets": metrics0["num_compiles"], "llm_init_seconds": init_s, "rows": []}
    for batch in args.batches:
        prompts = rng.integers(0, args.vocab, size=(batch, args.prompt_len))
        sj_prompts = [{"prompt_token_ids": p.tolist()} for p in prompts]
        hf_in = torch.tensor(prompts)

        def run_specjax():
            start = time.perf_counter()
            outs = llm.generate(sj_prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            assert all(len(o.outputs[0].token_ids) == args.new_tokens for o in outs)
            return elapsed, outs

        def run_hf():
            start = time.perf_counter()
            with torch.no_grad():
                gen = hf.generate(hf_in, attention_mask=torch.ones_like(hf_in), do_sample=False,
                                  max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=0)
            return time.perf_counter() - start, gen

        _, sj_out = run_specjax()  # warmup (no compiles expected: buckets compiled at init)
        _, hf_out = run_hf()
        same = sum(o.outputs[0].token_ids == g[args.prompt_len:].tolist() for o, g in zip(sj_out, hf_out))
        sj_times, hf_times = [], []
        for _ in range(args.reps):
            sj_times.append(run_specjax()[0])
            hf_times.append(run_hf()[0])
        tokens = batch * args.new_tokens
        row = {
            "batch": batch,
            "specjax_tok_s": tokens / statistics.median(sj_times),
            "hf_tok_s": tokens / statistics.median(hf_times),
            "specjax_times": sj_times,
            "hf_times": hf_times,
            "greedy_rows_identical_to_hf": f"{same}/{batch}",
        }
        row["speedup"] = row["specjax_tok_s"] / row["hf_tok_s"]
        results["rows"].append(row)
        print(f"batch {batch:3d}: specjax {row['specjax_tok_s']:8.1f} tok/s | transformers {row['hf_tok_s']:8.1f} "
              f"tok/s | x{row['speedup']:.2f} | identical greedy rows {same}/{batch}")
    results["compiles_during_timing"] = llm.get_metrics()["num_compiles"] - metrics0["num_compiles"]
    print(f"params {results['params'] / 1e6:.1f}M; warmup compiled {metrics0['num_compiles']} buckets in "
          f"{metrics0['compile_seconds']:.1f}s; compiles during timing: {results['compiles_during_timing']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
