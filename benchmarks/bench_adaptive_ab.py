"""One load, adaptive speculation vs plain decoding (or a fixed K) of the shipped target, side by side.

A quick A/B for a controller change (``bench_adaptive.py`` runs every load and the fixed K): both LLMs are
built and compiled first, one untimed round each, then ``--reps`` alternating rounds (which goes first
alternates too); prints the median speed ratio and the adaptive engine's chosen-K histogram. A batch-1 load
generates 4 prompts, one call each. Also printed: the median over rounds of each round's ratio (the rounds are
paired) with its 95% confidence interval (``ratios.median_ci``). ``--baseline static`` compares with a fixed
K = ``--k-max`` instead of plain decoding; ``--phases`` adds each engine's host time per step in planning
(``Engine._plan``) and its device call (``StepRunner.run``, fetch included), from wrappers around both.

    python benchmarks/bench_adaptive_ab.py --method ngram --batch 1 --temperature 0.8 --reps 7
    python benchmarks/bench_adaptive_ab.py --method ngram --batch 1 --baseline static --phases --reps 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import specjax
from bench_adaptive import METHODS
from bench_builtin import token_prompts
from ratios import median_ci


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", choices=list(METHODS), default="eagle3")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--k-max", type=int, default=4)
    ap.add_argument("--baseline", choices=["plain", "static"], default="plain")
    ap.add_argument("--phases", action="store_true")
    args = ap.parse_args()
    kw = dict(max_model_len=64 + 64 + 8, max_num_seqs=args.batch, batch_buckets=[args.batch], query_buckets=(1, 64),
              max_prefill_chunk=64, seed=0)
    static = {"speculative_config": {**METHODS[args.method], "num_speculative_tokens": args.k_max,
                                     "adaptive": False}} if args.baseline == "static" else {}
    baseline = specjax.LLM("builtin:target", **kw, **static)
    adaptive = specjax.LLM("builtin:target", **kw, speculative_config={
        **METHODS[args.method], "num_speculative_tokens": args.k_max, "adaptive": True})
    n = max(args.batch, 4)
    prompts = [{"prompt_token_ids": p} for p in token_prompts(baseline.tokenizer, n, 64)]
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

    load(baseline)
    load(adaptive)
    phases = {}
    if args.phases:
        for name, llm in (("baseline", baseline), ("adaptive", adaptive)):
            for part, obj, attr in (("plan", llm.engine, "_plan"), ("run", llm.engine.runner, "run"),
                                    ("step", llm.engine, "step")):
                phases[name, part] = [0.0, 0]
                setattr(obj, attr, _timed(getattr(obj, attr), phases[name, part]))
    times = {"baseline": [], "adaptive": []}
    for rep in range(args.reps):
        for name in (("baseline", "adaptive") if rep % 2 == 0 else ("adaptive", "baseline")):
            times[name].append(load(baseline if name == "baseline" else adaptive))
    m = adaptive.get_metrics()
    paired = [b / a for b, a in zip(times["baseline"], times["adaptive"])]
    print(json.dumps({
        "method": args.method, "batch": args.batch, "temperature": args.temperature, "baseline": args.baseline,
        "adaptive_over_baseline": statistics.median(times["baseline"]) / statistics.median(times["adaptive"]),
        "paired_ratio": statistics.median(paired), "paired_ratio_ci95": median_ci(paired),
        "k_histogram": m["k_histogram"], "num_detached_steps": m["num_detached_steps"], "times": times,
        "us_per_call": {f"{n}.{p}": round(1e6 * t / max(c, 1), 1) for (n, p), (t, c) in phases.items()},
        "calls": {f"{n}.{p}": c for (n, p), (t, c) in phases.items()},
    }))


def _timed(fn, acc: list):
    """fn, adding its wall time and one call to ``acc`` = [seconds, calls] each time it runs."""
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[0] += time.perf_counter() - start
            acc[1] += 1
    return wrapper


if __name__ == "__main__":
    main()
