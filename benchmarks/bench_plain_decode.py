"""Plain greedy decoding tokens/s of one model in this process, as one JSON line (for A/B runs of two checkouts).

    PYTHONPATH=<checkout>:<checkout>/benchmarks python benchmarks/bench_plain_decode.py --batch 1

Run it alternately from two checkouts (separate processes: each registers its own CPU kernels) to see whether
a change made plain decoding slower; benchmarks/README.md ("Verify cost on CPU") records such a run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import specjax
from bench_builtin import token_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    llm = specjax.LLM(args.model, max_model_len=args.prompt_len + args.new_tokens + 8, max_num_seqs=args.batch,
                      batch_buckets=[args.batch], query_buckets=(1, args.prompt_len),
                      max_prefill_chunk=args.prompt_len, seed=0)
    prompts = [{"prompt_token_ids": p} for p in token_prompts(llm.tokenizer, args.batch, args.prompt_len)]
    params = [specjax.SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)] * args.batch

    def once() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    once()  # untimed: first real steps
    times = [once() for _ in range(args.reps)]
    med = statistics.median(times)
    print(json.dumps({"model": args.model, "batch": args.batch, "specjax": specjax.__file__, "median_s": med,
                      "tok_s": args.batch * args.new_tokens / med, "times": times}))


if __name__ == "__main__":
    main()
