"""What the sampler's random numbers cost per step: ``specjax.sample.prng`` (Threefry unrolled) vs ``jax.random``.

Builds each system twice in one process, with ``specjax.sample.prng.UNROLLED`` off (every key fold and noise
draw through ``jax.random``: on XLA:CPU a rolled while loop per hash) and on (the default), and times sampled
decoding steps of each bucket (``StepRunner.time_step``: all-padding rows at temperature 1, so every row
draws noise) in interleaved rounds; medians of ``--reps`` rounds. Before that, on the fresh systems, both
generate the same seeded sampled requests (4 in one call) and the run records whether their tokens agree. Systems:
plain decoding and the shipped pair's EAGLE-3 head (fixed K, so each step verifies K drafts).

    python benchmarks/bench_noise.py --out benchmarks/results/noise.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import specjax
from bench_builtin import machine_info, token_prompts
from specjax.sample import prng

logger = logging.getLogger("bench_noise")
SYSTEMS = {"plain": None, "eagle3": {"method": "eagle3", "model": "builtin:eagle3"}}


def build(spec: dict | None, unrolled: bool, args) -> specjax.LLM:
    prng.UNROLLED = unrolled  # read when the steps are traced (at warmup)
    try:
        spec = None if spec is None else {**spec, "num_speculative_tokens": max(args.ks), "adaptive": False}
        return specjax.LLM("builtin:target", speculative_config=spec, max_model_len=136,
                           max_num_seqs=max(args.batches), batch_buckets=sorted(args.batches), query_buckets=(1, 64),
                           max_prefill_chunk=64, seed=0)
    finally:
        prng.UNROLLED = True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/noise.json"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    rows, agree = [], {}
    for name, spec in SYSTEMS.items():
        llms = {"jax.random": build(spec, False, args), "unrolled": build(spec, True, args)}
        # First (time_step's padding rows leave proposer state behind that a later request's drafts may read):
        # the two draw the same bits, so seeded sampled requests must get the same tokens.
        prompts = token_prompts(llms["unrolled"].tokenizer, 4, 64)
        params = [specjax.SamplingParams(temperature=0.8, max_tokens=32, seed=i) for i in range(4)]
        outs = {v: [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                                 use_tqdm=False)] for v, llm in llms.items()}
        same = [a == b for a, b in zip(outs["unrolled"], outs["jax.random"])]
        logger.info("%s: seeded sampled outputs equal in %d of %d requests", name, sum(same), len(same))
        agree[name] = same
        ks = [0] + (args.ks if spec else [])
        for batch in args.batches:
            for k in ks:
                bucket = (batch, 1, k)
                times = {v: [] for v in llms}
                for rep in range(args.reps + 1):
                    for v in (list(llms) if rep % 2 == 0 else list(llms)[::-1]):
                        t = llms[v].engine.runner.time_step(bucket, False, True, repeats=10, draft_ahead=max(k, 1))
                        if rep:  # the first round warms up
                            times[v].append(t)
                med = {v: statistics.median(t) * 1e3 for v, t in times.items()}
                row = {"system": name, "batch": batch, "k": k, "ms": med,
                       "unrolled_over_jax_random": med["unrolled"] / med["jax.random"]}
                logger.info("%s batch %d K=%d: jax.random %.3f ms, unrolled %.3f ms (%.3fx)", name, batch, k,
                            med["jax.random"], med["unrolled"], row["unrolled_over_jax_random"])
                rows.append(row)
        del llms
    out = {"date": time.strftime("%Y-%m-%d"), "machine": machine_info(), "args": {k: str(v) if isinstance(v, Path)
                                                                                  else v for k, v in vars(args).items()},
           "results": rows, "sampled_outputs_equal": agree}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print("| system | batch | K | jax.random ms | unrolled ms | ratio |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['system']} | {r['batch']} | {r['k']} | {r['ms']['jax.random']:.3f} | {r['ms']['unrolled']:.3f} | "
              f"{r['unrolled_over_jax_random']:.3f} |")


if __name__ == "__main__":
    main()
