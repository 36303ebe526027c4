"""Detached steps and detached prefill (issue 13): what a step without the proposer costs, and what a load costs
when the controller runs it without the proposer from the first prefill.

a. All-padding decoding steps of one bucket, interleaved ``--reps`` times: the plain LLM's step, the
   speculative LLM's detached step (its proposer skipped by the branch on attached rows) and its attached
   K = 0 step (the proposer kept in step). Medians.
b. One load (``--batch`` prompts of 64 tokens, 64 new tokens, temperature ``--temperature``, seeded) generated
   ``--rounds`` times by plain decoding and by the adaptive controller in turn: each run's step times (the
   prefill steps first), their total, and the controller's detached prefills / steps.

    python benchmarks/bench_detached.py --out benchmarks/results/detached.json
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

logger = logging.getLogger("bench_detached")
MODELS = {"draft_model": "builtin:draft", "eagle3": "builtin:eagle3"}


def build(batch: int, method: str | None) -> specjax.LLM:
    spec = None if method is None else {"method": method, "model": MODELS[method], "num_speculative_tokens": 4}
    return specjax.LLM("builtin:target", speculative_config=spec, max_model_len=136, max_num_seqs=batch,
                       batch_buckets=[batch], query_buckets=(1, 64), max_prefill_chunk=64, seed=0)


def step_times(llm: specjax.LLM, prompts, params) -> list[float]:
    engine, times = llm.engine, []
    real = engine.step

    def timed():
        start = time.perf_counter()
        out = real()
        times.append(time.perf_counter() - start)
        return out

    engine.step = timed
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        engine.step = real
    return times


def case(method: str, batch: int, temperature: float, reps: int, rounds: int) -> dict:
    plain, spec = build(batch, None), build(batch, method)
    bucket = (batch, 1, 0)
    padding = {"plain": [], "detached": [], "attached K=0": []}
    for _ in range(reps):
        padding["plain"].append(plain.engine.runner.time_step(bucket, False, repeats=1))
        padding["detached"].append(spec.engine.runner.time_step(bucket, True, repeats=1))
        padding["attached K=0"].append(spec.engine.runner.time_step(bucket, False, repeats=1))
    prompts = [{"prompt_token_ids": p} for p in token_prompts(plain.tokenizer, batch, 64)]
    params = [specjax.SamplingParams(temperature=temperature, max_tokens=64, ignore_eos=True, seed=i)
              for i in range(batch)]
    runs = []
    for _ in range(rounds):
        row = {}
        for name, llm in (("plain", plain), ("adaptive", spec)):
            before = llm.get_metrics()
            times = step_times(llm, prompts, params)
            after = llm.get_metrics()
            row[name] = {"step_ms": [round(t * 1e3, 1) for t in times], "total_s": sum(times)}
            if name == "adaptive":
                for key in ("num_detached_prefills", "num_detached_steps", "num_spec_steps", "num_steps"):
                    row[name][key] = after[key] - before[key]
        row["ratio"] = row["plain"]["total_s"] / row["adaptive"]["total_s"]
        runs.append(row)
        logger.info("%s batch %d T %.1f: plain %.2fs adaptive %.2fs (%.2fx), detached prefills %d",
                    method, batch, temperature, row["plain"]["total_s"], row["adaptive"]["total_s"], row["ratio"],
                    row["adaptive"]["num_detached_prefills"])
    return {"method": method, "batch": batch, "temperature": temperature,
            "padding_step_ms": {k: round(statistics.median(v) * 1e3, 2) for k, v in padding.items()},
            "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/detached.json"))
    ap.add_argument("--cases", nargs="+", default=["eagle3:1:0.0", "draft_model:8:0.0", "eagle3:32:0.8"],
                    help="method:batch:temperature")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    results = []
    for c in args.cases:
        method, batch, temperature = c.split(":")
        results.append(case(method, int(batch), float(temperature), args.reps, args.rounds))
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_info(), "results": results,
           "command": "python benchmarks/bench_detached.py " + " ".join(
               f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
               for k, v in vars(args).items())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    for r in results:
        print(f"{r['method']} batch {r['batch']} T {r['temperature']}: padding step ms {r['padding_step_ms']}; "
              "plain/adaptive per round " + ", ".join(f"{x['ratio']:.2f}" for x in r["runs"]))


if __name__ == "__main__":
    main()
