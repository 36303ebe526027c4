"""Speculative decoding vs plain decoding in one run: tokens/s, speedup, acceptance, overhead efficiency.

Methods: plain, ngram, draft_model and synthetic verification at per-position
acceptance 0.5 / 0.7 / 0.9, for K in --ks and batch sizes in --batches, all on
the same random ~30M-parameter Llama target (greedy, ignore_eos). Every LLM
compiles its buckets up front (reported as compile time) so timed runs compile
nothing; each figure is the median of --reps timed runs after one warmup run.

Overhead efficiency = measured speedup / ideal speedup, where
ideal = E[tokens per row per step] x T_plain_step / E[T_draft + T_verify per
step], from the engine's own component timers (a step where no row has drafts
runs the plain step, costs T_plain and yields 1 token per row).

Random weights: ngram and draft_model acceptance here says nothing about real
models (the random draft almost never agrees with the random target); the
synthetic rows measure what the system does with a given acceptance.

    python benchmarks/bench_spec.py --out benchmarks/results/spec.json
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import specjax
from bench_plain_vs_hf import make_checkpoint

logger = logging.getLogger("bench_spec")


def run_config(ckpt, spec, batches, args, prompts_by_batch):
    max_batch = max(batches)
    draft_model = spec is not None and spec.get("method") == "draft_model"
    llm = specjax.LLM(
        ckpt, speculative_config=spec, max_model_len=args.prompt_len + args.new_tokens + 16,
        max_num_seqs=max_batch, max_prefill_chunk=args.prompt_len,
        batch_buckets=sorted(set(batches)),
        # Host proposers catch up one token per step, a draft model one or two.
        query_buckets=(1, 2, args.prompt_len) if draft_model else (1, args.prompt_len),
        warmup=True,
    )
    compile_s = llm.get_metrics()["compile_seconds"]
    params = specjax.SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    rows = {}
    for batch in batches:
        prompts = prompts_by_batch[batch]
        llm.generate(prompts, params, use_tqdm=False)  # warmup run
        before = llm.get_metrics()
        times = []
        outputs = None
        for _ in range(args.reps):
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        after = llm.get_metrics()
        delta = {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float)) and k in before}
        row = {
            "tok_s": batch * args.new_tokens / statistics.median(times),
            "times": times,
            "steps_per_run": delta["num_steps"] / args.reps,
            "step_s": statistics.median(times) / (delta["num_steps"] / args.reps),
            "token_ids": [o.outputs[0].token_ids for o in outputs],
            "compiles_during_timing": delta["num_compiles"],
        }
        if spec is not None:
            drafts = delta["num_drafts"]
            row["mean_acceptance_length"] = 1 + delta["num_accepted_tokens"] / drafts if drafts else 1.0
            # Tokens per row per step, counting steps where a row had no drafts (ngram misses).
            row["tokens_per_row_step"] = delta["num_generated_tokens"] / max(delta["num_row_steps"], 1)
            row["acceptance_rate"] = delta["num_accepted_tokens"] / max(delta["num_draft_tokens"], 1)
            spec_steps = max(delta["num_spec_steps"], 1)
            row["steps"] = delta["num_steps"]
            row["plain_steps"] = delta["num_steps"] - delta["num_spec_steps"]
            row["draft_total_s"] = delta["draft_time_s"]
            row["verify_total_s"] = delta["verify_time_s"]
            row["draft_s"] = delta["draft_time_s"] / spec_steps
            row["verify_s"] = delta["verify_time_s"] / spec_steps
            row["sample_s"] = delta["sample_time_s"] / spec_steps
        rows[batch] = row
    return rows, compile_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--synthetic", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    ap.add_argument("--methods", nargs="+", default=["ngram", "draft_model", "synthetic"])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    tmp = Path(tempfile.mkdtemp(prefix="specjax_spec_"))
    target = make_checkpoint(tmp / "target", layers=8, hidden=512, vocab=8192, heads=8, kv_heads=8)
    draft = make_checkpoint(tmp / "draft", layers=2, hidden=128, vocab=8192, heads=4, kv_heads=4)
    rng = np.random.default_rng(0)
    prompts_by_batch = {
        b: [{"prompt_token_ids": rng.integers(0, 8192, size=args.prompt_len).tolist()} for _ in range(b)]
        for b in args.batches
    }
    configs = [("plain", 0, None)]
    for k in args.ks:
        if "ngram" in args.methods:
            configs.append(("ngram", k, {"method": "ngram", "num_speculative_tokens": k,
                                         "prompt_lookup_min": 2, "prompt_lookup_max": 5}))
        if "draft_model" in args.methods:
            configs.append(("draft_model", k, {"method": "draft_model", "model": str(draft),
                                               "num_speculative_tokens": k}))
        if "synthetic" in args.methods:
            for a in args.synthetic:
                configs.append((f"synthetic a={a}", k, {
                    "rejection_sample_method": "synthetic", "num_speculative_tokens": k,
                    "synthetic_acceptance_rates": [a**i for i in range(1, k + 1)]}))
    results = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} CPU, 2 cores",
               "config": {k: v for k, v in vars(args).items() if k != "out"}, "rows": []}
    plain = None
    for name, k, spec in configs:
        logger.info("running %s K=%s", name, k)
        rows, compile_s = run_config(target, spec, args.batches, args, prompts_by_batch)
        if plain is None:
            plain = rows
        for batch, row in rows.items():
            entry = {"method": name, "k": k, "batch": batch, "compile_s": compile_s,
                     **{key: v for key, v in row.items() if key != "token_ids"}}
            entry["speedup"] = row["tok_s"] / plain[batch]["tok_s"]
            if spec is not None:
                t_plain = plain[batch]["step_s"]
                # Mean component cost per step; steps that fell back to plain decoding cost T_plain.
                cost = (row["draft_total_s"] + row["verify_total_s"] + t_plain * row["plain_steps"]) / row["steps"]
                ideal = row["tokens_per_row_step"] * t_plain / cost
                entry["ideal_speedup"] = ideal
                entry["efficiency"] = entry["speedup"] / ideal
                if not name.startswith("synthetic"):
                    # Greedy speculation is lossless: the same tokens as plain decoding.
                    entry["identical_to_plain"] = row["token_ids"] == plain[batch]["token_ids"]
            results["rows"].append(entry)
            print(json.dumps({k2: (round(v, 4) if isinstance(v, float) else v) for k2, v in entry.items()
                              if k2 != "times"}), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
