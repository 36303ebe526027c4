"""One load, adaptive speculation vs plain decoding of the shipped target, side by side in one process.

A quick A/B for a controller change (``bench_adaptive.py`` runs every load and the fixed K): both LLMs are
built and compiled first, one untimed round each, then ``--reps`` alternating rounds; prints the median speed
ratio and the adaptive engine's chosen-K histogram. A batch-1 load generates 4 prompts, one call each.

    python benchmarks/bench_adaptive_ab.py --method ngram --batch 1 --temperature 0.8 --reps 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import specjax
from bench_adaptive import METHODS
from bench_builtin import token_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", choices=list(METHODS), default="eagle3")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--k-max", type=int, default=4)
    args = ap.parse_args()
    kw = dict(max_model_len=64 + 64 + 8, max_num_seqs=args.batch, batch_buckets=[args.batch], query_buckets=(1, 64),
              max_prefill_chunk=64, seed=0)
    plain = specjax.LLM("builtin:target", **kw)
    adaptive = specjax.LLM("builtin:target", **kw, speculative_config={
        **METHODS[args.method], "num_speculative_tokens": args.k_max, "adaptive": True})
    n = max(args.batch, 4)
    prompts = [{"prompt_token_ids": p} for p in token_prompts(plain.tokenizer, n, 64)]
    params = [specjax.SamplingParams(temperature=args.temperature, max_tokens=64, ignore_eos=True, seed=i)
              for i in range(n)]

    def load(llm) -> float:
        start = time.perf_counter()
        if args.batch == 1:
            for i in range(n):
                llm.generate(prompts[i:i + 1], params[i:i + 1], use_tqdm=False)
        else:
            llm.generate(prompts[:args.batch], params[:args.batch], use_tqdm=False)
        return time.perf_counter() - start

    load(plain)
    load(adaptive)
    times = {"plain": [], "adaptive": []}
    for _ in range(args.reps):
        times["plain"].append(load(plain))
        times["adaptive"].append(load(adaptive))
    m = adaptive.get_metrics()
    print(json.dumps({
        "method": args.method, "batch": args.batch, "temperature": args.temperature,
        "adaptive_over_plain": statistics.median(times["plain"]) / statistics.median(times["adaptive"]),
        "k_histogram": m["k_histogram"], "num_detached_steps": m["num_detached_steps"], "times": times,
    }))


if __name__ == "__main__":
    main()
