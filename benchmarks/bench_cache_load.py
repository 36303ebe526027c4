"""Getting one step executable with an empty vs a filled persistent compilation cache, and its speed after.

Run twice with the same cache directory (the first run fills it); each run is a fresh process:

    rm -rf /tmp/sj-cache-check
    python benchmarks/bench_cache_load.py --cache /tmp/sj-cache-check   # empty cache: trace, lower, compile
    python benchmarks/bench_cache_load.py --cache /tmp/sj-cache-check   # filled: trace, lower, cache lookup

Prints the time ``CompiledBuckets.get`` took for the plain 1-token batch-1 bucket (what ``num_compiles`` /
``compile_seconds`` count) and the median of 15 steps run with that executable.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import specjax
from specjax.step import pack


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--model", default="builtin:smollm2")
    args = ap.parse_args()
    llm = specjax.LLM(model=args.model, max_num_seqs=1, batch_buckets=(1,), query_buckets=(1,), warmup=False,
                      compilation_cache=args.cache, max_model_len=256)
    runner = llm.engine.runner
    bucket = (1, 1, 0)
    t0 = time.perf_counter()
    exe = runner.executables.get(bucket)
    get_s = time.perf_counter() - t0
    batch, state, times = pack(runner.host_batch(bucket)), runner.state, []
    for _ in range(15):
        t0 = time.perf_counter()
        packed, state = exe(runner.params, state, batch)
        np.asarray(packed)
        times.append(time.perf_counter() - t0)
    runner.state = state
    print(f"get {get_s:.2f}s, step median {statistics.median(times) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
