"""Decoding rows and prompt chunks in one step or taking turns (``mixed_step_padding``): batch-job throughput.

A batch of ``--batches`` requests in one ``generate`` call is admitted a token budget at a time (4 x
``--prompt-len`` tokens per step), so while later prompts are prefilled the earlier ones already decode. In one
step, every decoding row is padded to the prompt chunks' query length: with 28 decoding rows and 4 chunks of 64
tokens, a step of 32 rows x 64 slots. With ``mixed_step_padding`` (default 16) the two run as separate steps,
taking turns, where mixing pads more than that beyond them.

For each ``--batches`` size and ``--temperatures``, plain decoding of ``--model`` and speculative decoding
(``--method``, adaptive K <= 4) each run with ``mixed_step_padding=None`` (always mix: the engine before this
option) and with the default, interleaved rounds (every other round in reverse order), after one untimed round.
Reported: tokens/s (median), each policy's speed-up over plain-mixed and the turns / mixed ratio (medians over
rounds of each round's ratio), and steps per round. Greedy token ids must be identical across all four systems.

    python benchmarks/bench_mixed_steps.py --row-buckets 8 32 --out benchmarks/results/mixed_steps.json
    python benchmarks/bench_mixed_steps.py --model builtin:smollm2 --method smollm2_eagle3 --batches 32 \
        --row-buckets 8 32 --reps 3 --out benchmarks/results/mixed_steps_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import specjax
from bench_adaptive import METHODS
from bench_builtin import machine_info, token_prompts

logger = logging.getLogger("bench_mixed_steps")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:target")
    ap.add_argument("--method", default="draft_model", choices=sorted(METHODS))
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--row-buckets", type=int, nargs="+", default=None,
                    help="batch_buckets (default: the LLM's, powers of two up to the largest batch); with one row "
                         "bucket, mixing never pads more than turns")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    def build(spec, padding):
        return specjax.LLM(args.model, speculative_config=spec, max_model_len=args.prompt_len + args.new_tokens + 8,
                           max_num_seqs=max(args.batches), batch_buckets=args.row_buckets,
                           query_buckets=(1, args.prompt_len), max_prefill_chunk=args.prompt_len, seed=0,
                           mixed_step_padding=padding)

    spec = {**METHODS[args.method], "num_speculative_tokens": 4, "adaptive": True}
    t0 = time.perf_counter()
    llms = {f"{kind} {policy}": build(s, padding) for kind, s in (("plain", None), ("spec", spec))
            for policy, padding in (("mixed", None), ("turns", 16))}
    compile_s = time.perf_counter() - t0
    prompts = token_prompts(next(iter(llms.values())).tokenizer, max(args.batches), args.prompt_len)
    results = []
    for batch in args.batches:
        for temperature in args.temperatures:
            params = [specjax.SamplingParams(temperature=temperature, max_tokens=args.new_tokens, ignore_eos=True,
                                             seed=i) for i in range(batch)]
            times = {name: [] for name in llms}
            steps = {name: [] for name in llms}
            ids = {}
            for rep in range(args.reps + 1):
                names = list(llms) if rep % 2 else list(llms)[::-1]
                for name in names:
                    before = llms[name].get_metrics()["num_steps"]
                    start = time.perf_counter()
                    outs = llms[name].generate([{"prompt_token_ids": p} for p in prompts[:batch]], params,
                                               use_tqdm=False)
                    elapsed = time.perf_counter() - start
                    ids[name] = [o.outputs[0].token_ids for o in outs]
                    if rep:  # (the first round is untimed)
                        times[name].append(elapsed)
                        steps[name].append(llms[name].get_metrics()["num_steps"] - before)
            if temperature == 0.0 and len({json.dumps(v) for v in ids.values()}) != 1:
                raise SystemExit(f"greedy outputs differ at batch {batch}")
            tokens = batch * args.new_tokens
            base = times["plain mixed"]
            row = {"batch": batch, "temperature": temperature, "systems": {}}
            for name, ts in times.items():
                row["systems"][name] = {
                    "tok_s": tokens / statistics.median(ts),
                    "vs_plain_mixed": statistics.median(b / t for b, t in zip(base, ts)),
                    "steps_per_round": statistics.median(steps[name]),
                    "times": ts,
                }
            for kind in ("plain", "spec"):
                mixed, turns = times[f"{kind} mixed"], times[f"{kind} turns"]
                row[f"{kind}_turns_vs_mixed"] = statistics.median(m / t for m, t in zip(mixed, turns))
            results.append(row)
            logger.info("batch %d T=%.1f: turns / mixed plain %.2fx, spec %.2fx", batch, temperature,
                        row["plain_turns_vs_mixed"], row["spec_turns_vs_mixed"])

    print("| batch | T | system | tok/s | vs plain mixed | steps / round |")
    print("|---|---|---|---|---|---|")
    for row in results:
        for name, s in row["systems"].items():
            print(f"| {row['batch']} | {row['temperature']} | {name} | {s['tok_s']:.0f} | {s['vs_plain_mixed']:.2f}x "
                  f"| {s['steps_per_round']:.0f} |")
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_info(), "args": vars(args) | {"out": None},
           "compile_s": compile_s, "results": results, "command": "python " + " ".join(sys.argv)}
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
