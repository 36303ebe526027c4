"""Device-call cost of a step without drafts: detached and attached (a proposer with state) vs plain decoding.

Each step is an all-padding step of the same bucket (``StepRunner.time_step``: host buffers, the compiled
call and its fetch; padding rows write nothing), interleaved over ``--rounds`` rounds of 5 steps each;
medians in ms. Shipped target, batch ``--batch``.

    python benchmarks/bench_step_kinds.py --method eagle3 --batch 8
"""

from __future__ import annotations

import argparse
import json
import statistics

import specjax
from bench_adaptive import METHODS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", choices=["eagle3", "draft_model"], default="eagle3")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    kw = dict(max_model_len=200, max_num_seqs=args.batch, batch_buckets=[args.batch], query_buckets=(1, 64),
              max_prefill_chunk=64, seed=0)
    spec = specjax.LLM("builtin:target", speculative_config={**METHODS[args.method], "num_speculative_tokens": 4},
                       **kw).engine.runner
    plain = specjax.LLM("builtin:target", **kw).engine.runner
    bucket = (args.batch, 1, 0)
    times = {"detached": [], "attached_one_ahead": [], "plain": []}
    for _ in range(args.rounds):
        times["detached"].append(spec.time_step(bucket, True, repeats=5))
        times["attached_one_ahead"].append(spec.time_step(bucket, False, repeats=5, draft_ahead=1))
        times["plain"].append(plain.time_step(bucket, False, repeats=5))
    print(json.dumps({"method": args.method, "batch": args.batch,
                      **{k: round(statistics.median(v) * 1e3, 3) for k, v in times.items()}}))


if __name__ == "__main__":
    main()
