"""``LLM(int8_activations=True)`` vs the exact default on SmolLM2-135M-Instruct (Q4_1 / Q8_0 GGUF): speed and outputs.

Two ways to run the file's blocks on the CPU kernels (``models/cpu_kernels/panel_matmul.cc``): ``exact`` (the
default: each weight dequantized to the float32 value the gguf package gives, float32 products) and ``int8``
(activations quantized to int8 per block of 32 and multiplied in integer dot products, as llama.cpp does). For
plain greedy decoding and for the default speculative config (the EAGLE-3 head trained for SmolLM2), at batch 1
(one prompt per call) and batch 8 (all prompts in one call), this reports tokens per second of each variant and
how often int8's greedy tokens equal exact's (the approximation's effect on outputs), and checks that int8 with
speculation gives int8's plain tokens (speculation stays exact for the model it runs). Last, the prompts' prefill
logits of both (one forward each, in this process): KL(exact || int8) per position and top-token agreement.

Each (variant, config) runs in its own process, --reps rounds in turn (exact and int8 alternated), because LLM
instances sharing a process also share the caches: weights of one instance evict another's, and the step of
whichever ran last reads faster (benchmarks/README.md, "Verify cost on CPU"). A process builds its LLM, runs
every load once untimed, then times each load once; figures are medians over rounds. Prompts are the first
--num-prompts held-out selfgen prompts (chat through the model's template, prose, code) of at most
--prompt-len tokens.

    python benchmarks/bench_int8_activations.py --out benchmarks/results/int8_activations.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

VARIANTS = ("exact", "int8")
CONFIGS = ("plain", "eagle3")


def worker(variant: str, config: str, args) -> dict:
    """One process: build, warm up, time every load once; token ids and tokens per second per load."""
    import specjax
    from bench_adaptive import selfgen_prompts
    from specjax.builtin import DEFAULT_SPEC

    prompts = [{"prompt_token_ids": p} for p in selfgen_prompts(args.model, args.num_prompts, args.prompt_len)]
    llm = specjax.LLM(args.model, max_num_seqs=8, max_model_len=args.prompt_len + args.new_tokens + 16,
                      speculative_config=dict(DEFAULT_SPEC) if config == "eagle3" else None,
                      int8_activations=variant == "int8")
    params = specjax.SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)

    def load(batch: int) -> tuple[float, list[list[int]]]:
        start, ids = time.perf_counter(), []
        for i in range(0, len(prompts), batch):
            ids += [o.outputs[0].token_ids for o in llm.generate(prompts[i:i + batch], params, use_tqdm=False)]
        return time.perf_counter() - start, ids

    out = {}
    for batch in args.batches:
        load(batch)  # untimed: first calls of each bucket
        seconds, ids = load(batch)
        out[str(batch)] = {"tok_s": len(prompts) * args.new_tokens / seconds, "ids": ids}
    return out


def logit_quality(model: str, prompts: list[list[int]]) -> dict:
    """Prefill logits of each prompt, exact vs int8: KL(exact || int8) per position (nats), top-token agreement."""
    import jax
    import numpy as np

    from models.cpu_layout import to_cpu_layout
    from models.llama import prompt_logits
    from models.loading import load_blocks, load_model
    from specjax.builtin import resolve_model

    path = resolve_model(model)
    config, params = load_model(path)
    layouts = {v: to_cpu_layout(params, config, quantized=load_blocks(path), int8_activations=v == "int8")
               for v in VARIANTS}
    kl, agree = [], []
    for ids in prompts:
        logp = {v: np.asarray(jax.nn.log_softmax(prompt_logits(p, ids, config=config), axis=-1), np.float64)
                for v, p in layouts.items()}  # [T, V] each
        kl += list((np.exp(logp["exact"]) * (logp["exact"] - logp["int8"])).sum(-1))
        agree += list(logp["exact"].argmax(-1) == logp["int8"].argmax(-1))
    return {"positions": len(kl), "kl_mean": round(float(np.mean(kl)), 4), "kl_median": round(float(np.median(kl)), 4),
            "kl_max": round(float(np.max(kl)), 4), "top1_agreement": round(float(np.mean(agree)), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--worker", nargs=2, metavar=("VARIANT", "CONFIG"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args)))
        return

    passthrough = ["--model", args.model, "--num-prompts", str(args.num_prompts), "--prompt-len",
                   str(args.prompt_len), "--new-tokens", str(args.new_tokens), "--batches", *map(str, args.batches)]
    runs: dict[str, list[dict]] = {}
    for rnd in range(args.reps):
        for config in CONFIGS:
            for variant in VARIANTS:
                proc = subprocess.run([sys.executable, __file__, *passthrough, "--worker", variant, config],
                                      capture_output=True, text=True, cwd=ROOT)
                if proc.returncode != 0:
                    raise RuntimeError(proc.stderr[-3000:])
                runs.setdefault(f"{variant}/{config}", []).append(json.loads(proc.stdout.strip().splitlines()[-1]))
                print(f"round {rnd}: {variant}/{config} " + " ".join(
                    f"b{b} {r['tok_s']:.1f} tok/s" for b, r in runs[f"{variant}/{config}"][-1].items()), flush=True)

    result = {"command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count()}, "loads": {}}
    for config in CONFIGS:
        for b in map(str, args.batches):
            med = {v: statistics.median(r[b]["tok_s"] for r in runs[f"{v}/{config}"]) for v in VARIANTS}
            exact_ids, int8_ids = runs[f"exact/{config}"][0][b]["ids"], runs[f"int8/{config}"][0][b]["ids"]
            same = sum(a == c for x, y in zip(exact_ids, int8_ids) for a, c in zip(x, y))
            first_diff = [next((i for i, (a, c) in enumerate(zip(x, y)) if a != c), None)
                          for x, y in zip(exact_ids, int8_ids)]
            row = {"tok_s": {v: round(med[v], 1) for v in VARIANTS},
                   "tok_s_rounds": {v: [round(r[b]["tok_s"], 1) for r in runs[f"{v}/{config}"]] for v in VARIANTS},
                   "int8_over_exact": round(med["int8"] / med["exact"], 3),
                   "tokens_equal_to_exact": round(same / sum(map(len, exact_ids)), 3),
                   "prompts_equal_to_exact": sum(d is None for d in first_diff),
                   "first_difference_at": first_diff}
            if config != "plain":  # speculation is exact for the model it runs: same tokens as its plain decoding
                row["same_tokens_as_plain"] = {v: runs[f"{v}/{config}"][0][b]["ids"] == runs[f"{v}/plain"][0][b]["ids"]
                                               for v in VARIANTS}
            result["loads"][f"{config}/batch{b}"] = row
            print(f"{config} batch {b}: exact {med['exact']:.1f} int8 {med['int8']:.1f} tok/s "
                  f"({row['int8_over_exact']:.3f}x); int8 tokens equal to exact {row['tokens_equal_to_exact']:.3f}, "
                  f"prompts {row['prompts_equal_to_exact']}/{len(first_diff)}"
                  + (f"; same tokens as plain {row['same_tokens_as_plain']}" if config != "plain" else ""), flush=True)
    from bench_adaptive import selfgen_prompts

    result["logits"] = logit_quality(args.model, selfgen_prompts(args.model, args.num_prompts, args.prompt_len))
    print("prefill logits, int8 vs exact: " + ", ".join(f"{k} {v}" for k, v in result["logits"].items()), flush=True)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
