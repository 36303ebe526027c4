"""Draft heads vs the other proposers on the shipped target: acceptance length and speedup over plain decoding.

Methods: eagle, eagle3, mtp, medusa (the heads shipped in specjax/builtin/,
trained by ``specjax train-head``), draft_model (the shipped 1M draft) and
ngram, each at K in --ks, batch 1 and 8, greedy, ``ignore_eos``, on held-out
stdlib prompts (files the target and heads never trained on). Batch 1 runs the
prompts one by one; batch 8 runs them together. Each configuration's LLM
compiles its buckets first; then plain decoding (one LLM kept for the whole
run) and the configuration alternate rep by rep, so their ratio is measured
side by side; figures are medians of --reps after one warmup run. Greedy
speculation is lossless, so every configuration's tokens are checked equal to
plain decoding's.

    python benchmarks/bench_heads.py --out benchmarks/results/heads.json
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time
from pathlib import Path

import jax

import specjax
from bench_batch import heldout_prompts

logger = logging.getLogger("bench_heads")

METHODS = {
    "eagle": {"method": "eagle", "model": "builtin:eagle"},
    "eagle3": {"method": "eagle3", "model": "builtin:eagle3"},
    "mtp": {"method": "mtp", "model": "builtin:mtp"},
    "medusa": {"method": "medusa", "model": "builtin:medusa"},
    "draft_model": {"method": "draft_model", "model": "builtin:draft"},
    "ngram": {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4},
}


def _engine_kwargs(args) -> dict:
    return dict(max_model_len=args.max_model_len, max_num_seqs=8, batch_buckets=(1, 8),
                max_prefill_chunk=args.prefill_chunk, seed=0)


def _timed(llm, prompts, params, batch: int) -> tuple[float, list]:
    """Seconds to generate all ``prompts``, ``batch`` at a time; and their token ids."""
    start, ids = time.perf_counter(), []
    for i in range(0, len(prompts), batch):
        ids += [o.outputs[0].token_ids for o in llm.generate(prompts[i : i + batch], params, use_tqdm=False)]
    return time.perf_counter() - start, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-chars", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--max-model-len", type=int, default=320)
    ap.add_argument("--prefill-chunk", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    prompts = heldout_prompts(args.num_prompts, args.prompt_chars)
    params = specjax.SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    plain = specjax.LLM("builtin:target", **_engine_kwargs(args))
    expected = {}
    for batch in args.batches:
        _, expected[batch] = _timed(plain, prompts, params, batch)
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} CPU, {jax.local_device_count()} device, 2 cores (shared with other jobs)",
        "jax": jax.__version__,
        "target": "builtin:target (7.5M)",
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "rows": [],
    }
    for method in args.methods:
        for k in args.ks:
            spec = {**METHODS[method], "num_speculative_tokens": k}
            if method == "medusa":
                from models.heads import load_head
                from specjax.builtin import resolve_model

                heads = load_head(resolve_model("builtin:medusa"))[0].num_medusa_heads
                if k > heads:
                    logger.info("medusa has %d heads: K=%d skipped", heads, k)
                    continue
            llm = specjax.LLM("builtin:target", speculative_config=spec, **_engine_kwargs(args))
            compile_s = llm.get_metrics()["compile_seconds"]
            for batch in args.batches:
                _, ids = _timed(llm, prompts, params, batch)  # warmup run
                before = llm.get_metrics()
                t_plain, t_spec = [], []
                for _ in range(args.reps):
                    t_plain.append(_timed(plain, prompts, params, batch)[0])
                    t, ids = _timed(llm, prompts, params, batch)
                    t_spec.append(t)
                after = llm.get_metrics()
                d = {key: after[key] - before[key] for key in (
                    "num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_compiles", "num_generated_tokens",
                    "num_spec_steps", "draft_time_s", "verify_time_s", "sample_time_s")}
                steps = max(d["num_spec_steps"], 1)
                per_pos = [a - b for a, b in zip(after["accepted_per_position"], before["accepted_per_position"])]
                tokens = len(prompts) * args.new_tokens
                row = {
                    "method": method, "k": k, "batch": batch,
                    "mean_acceptance_length": 1 + d["num_accepted_tokens"] / max(d["num_drafts"], 1),
                    "acceptance_rate": d["num_accepted_tokens"] / max(d["num_draft_tokens"], 1),
                    "acceptance_by_position": [p / max(d["num_drafts"], 1) for p in per_pos],
                    "tok_s": tokens / statistics.median(t_spec),
                    "plain_tok_s": tokens / statistics.median(t_plain),
                    "speedup": statistics.median(t_plain) / statistics.median(t_spec),
                    "same_tokens_as_plain": ids == expected[batch],
                    "compiles_during_timing": d["num_compiles"],
                    # Per speculative step, from the engine's own timers (a head's pass counts as drafting).
                    "draft_ms_per_step": 1e3 * d["draft_time_s"] / steps,
                    "verify_ms_per_step": 1e3 * d["verify_time_s"] / steps,
                    "sample_ms_per_step": 1e3 * d["sample_time_s"] / steps,
                    "plain_ms_per_step": 1e3 * statistics.median(t_plain) / (tokens / batch),  # one token per row
                    "compile_s": compile_s,
                }
                results["rows"].append(row)
                logger.info("%s", json.dumps({key: (round(v, 3) if isinstance(v, float) else v)
                                              for key, v in row.items() if key != "acceptance_by_position"}))
            del llm
    print(table(results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")


def table(results: dict) -> str:
    """The markdown table for README.md / benchmarks/README.md."""
    c = results["config"]
    lines = [
        f"{c['num_prompts']} held-out stdlib prompts, {c['new_tokens']} new tokens each, greedy; target "
        f"{results['target']}; {results['date']}, {results['machine']}, jax {results['jax']}; median of "
        f"{c['reps']} reps, plain and speculative alternating.",
        "",
        "| method | K | batch | mean acceptance length | acceptance rate | tokens/s | plain tokens/s | speedup | "
        "draft / verify / sample ms per step | plain ms per step | same tokens as plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['method']} | {r['k']} | {r['batch']} | {r['mean_acceptance_length']:.2f} | "
            f"{r['acceptance_rate']:.3f} | {r['tok_s']:.0f} | {r['plain_tok_s']:.0f} | {r['speedup']:.2f}x | "
            f"{r['draft_ms_per_step']:.2f} / {r['verify_ms_per_step']:.2f} / {r['sample_ms_per_step']:.2f} | "
            f"{r['plain_ms_per_step']:.2f} | {'yes' if r['same_tokens_as_plain'] else 'NO'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
