"""Adaptive speculation length vs plain decoding vs the best static K, across loads (issue 13).

For each method on the shipped pair (draft_model with builtin:draft, eagle3 with builtin:eagle3, ngram) and
each load (batch 1 / 8 / 32 requests in one ``generate`` call, greedy / temperature 0.8 seeded per prompt and
round: with the same seeds every round, a static K's speed at temperature 0.8 is one draw of its accepted drafts
for all rounds, ~5% apart between draws at batch 1, and the best of three such draws flatters the best static K),
every system generates the same held-out stdlib prompts (``--prompt-len`` tokens, ``--new-tokens`` new tokens,
ignore_eos) in interleaved rounds, every other round in reverse order: plain decoding of the target, the adaptive
controller (``"adaptive": true``, K <= 4), static K in ``--static-ks`` (``"adaptive": false``) and, unless
``--no-control``, a second plain LLM (``control``): its ratio to plain is the run's noise floor, what a system
exactly as fast as plain decoding reads in this run (on this 2-core machine a second plain LLM read
0.99-1.03x plain in one-load runs of 6-11 rounds). A method's LLMs are built and compiled before its loads
(``warmup=True``, which also times each step kind for the controller), plain first and the control last, and
freed after them; one untimed run
per system and load, then ``--reps`` rounds (``--batch1-reps`` at batch 1). Reported: tokens/s (median),
speed-up over plain (the median over rounds of each round's ratio), and for adaptive its chosen-K histogram and
shares of drafting and of detached steps; with the control, also the adaptive system against both plain LLMs
(the median over rounds of the round's mean of their two times over its own). Each median over rounds comes with
a 95% confidence interval (``ratios.median_ci``: distribution-free, from the rounds' order statistics), and a load
counts as slower than 0.97x plain only where the whole interval lies below it. Greedy outputs are checked
equal to plain decoding's.

    python benchmarks/bench_adaptive.py --out benchmarks/results/adaptive.json

The real-model rows (issue 15): SmolLM2-135M-Instruct with ngram, suffix and its EAGLE-3 head, on the
held-out prompts of ``specjax.train.selfgen`` (chat, prose, code; topics the head never trained on):

    python benchmarks/bench_adaptive.py --model builtin:smollm2 --prompts selfgen \
        --methods ngram suffix smollm2_eagle3 --batches 1 8 --static-ks 1 2 --prompt-len 96 --batch1-prompts 2 \
        --reps 3 --batch1-reps 3 --out benchmarks/results/smollm2_spec.json

``--draft-quantization`` sets ``speculative_config.quantization`` for the methods with a draft model or head:
``auto`` (the default, as ``LLM``: the built-in drafts in Q8_0 blocks on the CPU kernels' layout), ``q8_0``, or
``none`` (the weights as stored; benchmarks/README.md, "Draft quantization").

``--head NAME=METHOD:MODEL`` adds a method with another draft model or head, e.g. the full-vocabulary EAGLE-3
head shipped before 2026-12-05 (``git show 9d8efb2:specjax/builtin/eagle3/model.safetensors``, and its
config.json, into a directory) against the shipped one:

    python benchmarks/bench_adaptive.py --head eagle3_full=eagle3:/tmp/eagle3_full --methods eagle3 eagle3_full \
        --batches 1 8 --static-ks 2 4 --out benchmarks/results/eagle3_vocab.json

A batch-1 load generates ``--batch1-prompts`` prompts one ``generate`` call each (one call lasts only
``--new-tokens`` steps, too short to time alone on a noisy machine).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import specjax
from bench_builtin import machine_info, reset_suffix_cache, token_prompts
from ratios import median_ci

logger = logging.getLogger("bench_adaptive")

METHODS = {
    "draft_model": {"method": "draft_model", "model": "builtin:draft"},
    "eagle3": {"method": "eagle3", "model": "builtin:eagle3"},
    "ngram": {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "suffix": {"method": "suffix"},
    "smollm2_eagle3": {"method": "eagle3", "model": "builtin:smollm2_eagle3"},
}


def selfgen_prompts(model: str, n: int, max_len: int) -> list[list[int]]:
    """The first ``n`` held-out selfgen prompts (chat through the model's template, prose, code) that fit
    ``max_len`` tokens, interleaving kinds so every batch size sees a mix."""
    from specjax.builtin import resolve_model
    from specjax.train import selfgen

    _, held = selfgen.build_prompts()
    by_kind: dict[str, list] = {}
    for p in held:
        by_kind.setdefault(p.kind, []).append(p)
    mixed = [p for group in zip(*by_kind.values()) for p in group]
    mixed += [p for p in held if p not in mixed]
    ids = [x for x in selfgen.encode_prompts(resolve_model(model), mixed, max_len) if x and len(x) <= max_len]
    if len(ids) < n:
        raise SystemExit(f"only {len(ids)} held-out prompts fit {max_len} tokens")
    return ids[:n]


def build(args, spec: dict | None) -> specjax.LLM:
    # Buckets for exactly these loads (as a user serving them would configure): row counts = the batch sizes,
    # query lengths = decoding and one prompt. Every power-of-two row count and query length would compile
    # 5x the executables for steps this benchmark never takes.
    return specjax.LLM(args.model, speculative_config=spec, max_model_len=args.prompt_len + args.new_tokens + 8,
                       max_num_seqs=max(args.batches), batch_buckets=sorted(set(args.batches)),
                       query_buckets=(1, args.prompt_len), max_prefill_chunk=args.prompt_len, seed=0,
                       int8_activations=args.int8_activations)


def run_load(llm, prompts, batch: int, temperature: float, new_tokens: int, calls: int = 1, seed: int = 0):
    """``calls`` generate calls of ``batch`` prompts each (consecutive prompts, seeded ``seed``, ``seed`` + 1,
    ...); total wall time.

    A suffix proposer starts each run with an empty global tree: every round repeats the same prompts, and a
    tree holding the previous rounds' outputs would draft them back (greedy outputs repeat exactly).
    """
    if getattr(llm.speculative_config, "method", None) == "suffix":
        reset_suffix_cache(llm)
    params = [specjax.SamplingParams(temperature=temperature, max_tokens=new_tokens, ignore_eos=True,
                                     seed=seed + i) for i in range(batch * calls)]
    before = llm.get_metrics()
    ids, elapsed = [], 0.0
    for c in range(calls):
        part = slice(c * batch, (c + 1) * batch)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[part]], params[part], use_tqdm=False)
        elapsed += time.perf_counter() - start
        ids += [o.outputs[0].token_ids for o in outs]
    return elapsed, ids, before, llm.get_metrics()


def controller_state(llm, batch: int, sampled: bool) -> dict:
    """After a load: the adaptive controller's cost estimates (ms) for this batch's bucket and the method's
    per-position conditional acceptance, the numbers its choices came from."""
    c = llm.engine.controller
    rows = min(b for b in llm.engine.config.row_buckets if b >= batch)
    costs = {f"K={k}": round(c.costs.estimate(rows, k, False, sampled) * 1e3, 3) for k in range(c.k_max + 1)}
    if c.can_detach:
        costs["detached"] = round(c.costs.estimate(rows, 0, True, sampled) * 1e3, 3)
    s = c.estimates.method_stats[sampled]
    return {"cost_ms": costs, "method_acceptance": [round(a / t, 3) if t else None for a, t in zip(s.accepted, s.tried)],
            "method_tried": [int(t) for t in s.tried]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/adaptive.json"))
    ap.add_argument("--model", default="builtin:target")
    ap.add_argument("--head", action="append", default=[], metavar="NAME=METHOD:MODEL",
                    help="also a method NAME (for --methods): METHOD with the draft model or head MODEL (a path)")
    ap.add_argument("--methods", nargs="+", default=["draft_model", "eagle3", "ngram"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    ap.add_argument("--static-ks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--k-max", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompts", choices=["stdlib", "selfgen"], default="stdlib",
                    help="held-out stdlib windows of exactly --prompt-len tokens, or selfgen's held-out prompts")
    ap.add_argument("--batch1-prompts", type=int, default=4, help="prompts of a batch-1 load (one call each)")
    ap.add_argument("--batch1-reps", type=int, default=7,
                    help="rounds of a batch-1 load (a round takes seconds; its ratios spread the most)")
    ap.add_argument("--int8-activations", action="store_true",
                    help="every LLM with int8_activations=True (a GGUF model's blocks; README, 'What runs where')")
    ap.add_argument("--draft-quantization", choices=["auto", "q8_0", "none"], default="auto",
                    help="speculative_config.quantization for every method with a draft model or head, 'none' for "
                         "None: the weights as stored (README, 'Speculative config')")
    ap.add_argument("--control", action=argparse.BooleanOptionalAction, default=True,
                    help="also time a second plain LLM, reported as 'control' (the noise floor of the ratios)")
    args = ap.parse_args()
    for item in args.head:
        name, _, rest = item.partition("=")
        method, _, model = rest.partition(":")
        if not (name and method and model):
            ap.error(f"--head wants NAME=METHOD:MODEL, got {item!r}")
        METHODS[name] = {"method": method, "model": model}
    if unknown := set(args.methods) - set(METHODS):
        ap.error(f"unknown --methods {sorted(unknown)}; known: {sorted(METHODS)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    prompts, compile_s, results = None, 0.0, []
    for method in args.methods:
        # One method's systems alive at a time: each LLM keeps dozens of executables loaded, and XLA:CPU's
        # code memory ran out with all of them at once (LLVM "Cannot allocate memory", 2026-12-03). The plain
        # LLMs are built with each method's systems, plain first and the control last: an LLM's speed here
        # depends on when it was built (four plain LLMs built in a row stepped 3.21 / 3.21 / 3.17 / 3.16 ms;
        # eagle3 built after draft_model's systems were freed ran its detached batch-32 load 0.95-0.98x a plain
        # LLM built at the start, 0.99-1.01x in a process of its own), so plain and control bracket the others.
        t0 = time.perf_counter()
        base = dict(METHODS[method])
        if "model" in base:
            base["quantization"] = None if args.draft_quantization == "none" else args.draft_quantization
        plain = build(args, None)
        systems = {"adaptive": build(args, {**base, "num_speculative_tokens": args.k_max, "adaptive": True})}
        for k in args.static_ks:
            systems[f"K={k}"] = build(args, {**base, "num_speculative_tokens": k, "adaptive": False})
        control = {"control": build(args, None)} if args.control else {}
        llms = {"plain": plain, **control, **systems}
        compile_s += time.perf_counter() - t0
        if prompts is None:
            n_prompts = max(max(args.batches), args.batch1_prompts)
            prompts = (token_prompts(plain.tokenizer, n_prompts, args.prompt_len) if args.prompts == "stdlib"
                       else selfgen_prompts(args.model, n_prompts, args.prompt_len))
        logger.info("%s: built and compiled %d systems in %.0fs", method, len(llms), time.perf_counter() - t0)
        names = list(llms)
        for batch in args.batches:
            for temperature in args.temperatures:
                times = {name: [] for name in names}
                metrics = {}
                calls = args.batch1_prompts if batch == 1 else 1
                for name in names:  # untimed: first real steps
                    run_load(llms[name], prompts, batch, temperature, args.new_tokens)
                for rep in range(args.batch1_reps if batch == 1 else args.reps):
                    # Every other round in reverse order: the machine's speed drifts within a round too.
                    outputs = {}
                    for name in names if rep % 2 == 0 else names[::-1]:
                        elapsed, outputs[name], before, after = run_load(llms[name], prompts, batch, temperature,
                                                                         args.new_tokens, calls,
                                                                         seed=rep * batch * calls)
                        times[name].append(elapsed)
                        metrics[name] = (before, after)
                    if temperature == 0.0:
                        for name, ids in outputs.items():
                            if ids != outputs["plain"]:
                                raise SystemExit(f"{method} {name} batch {batch}: greedy output differs from plain")
                tokens = batch * calls * args.new_tokens
                row = {"method": method, "batch": batch, "temperature": temperature, "systems": {}}
                for name in names:
                    med = statistics.median(times[name])
                    entry = {"median_s": med, "tok_s": tokens / med, "times": times[name]}
                    if name not in ("plain", "control"):
                        before, after = metrics[name]
                        entry["acceptance_rate"] = (
                            (after["num_accepted_tokens"] - before["num_accepted_tokens"])
                            / max(1, after["num_draft_tokens"] - before["num_draft_tokens"]))
                        steps = max(1, after["num_steps"] - before["num_steps"])
                        entry["spec_step_share"] = (after["num_spec_steps"] - before["num_spec_steps"]) / steps
                        if name == "adaptive":  # over the last timed round
                            entry["detached_step_share"] = (after["num_detached_steps"]
                                                            - before["num_detached_steps"]) / steps
                            entry["detached_prefills"] = (after["num_detached_prefills"]
                                                          - before["num_detached_prefills"])
                        entry["num_drafts"] = after["num_drafts"] - before["num_drafts"]
                        entry["accepted_per_position"] = [  # over the last timed round
                            a - b for a, b in zip(after.get("accepted_per_position") or [],
                                                  before.get("accepted_per_position") or [])]
                    row["systems"][name] = entry
                for entry in row["systems"].values():
                    # Each round's ratio to plain decoding in the same round, median over rounds: rounds are
                    # seconds apart, and the machine's speed moves more between rounds than within one.
                    ratios = [p / t for p, t in zip(row["systems"]["plain"]["times"], entry["times"])]
                    entry["speedup"] = statistics.median(ratios)
                    entry["speedup_ci"] = median_ci(ratios)
                for name, entry in row["systems"].items():
                    if name not in ("plain", "control") and "control" in row["systems"]:
                        entry["speedup_vs_both"] = speedup_vs_both(row["systems"], name)
                static = {n: e["speedup"] for n, e in row["systems"].items() if n.startswith("K=")}
                best = max(static, key=static.get)
                row["best_static"] = best
                row["adaptive_vs_best_static"] = row["systems"]["adaptive"]["speedup"] / static[best]
                # The same paired by round (the best static K's time over adaptive's in each round).
                row["adaptive_vs_best_static_ci"] = median_ci(
                    [b / a for b, a in zip(row["systems"][best]["times"], row["systems"]["adaptive"]["times"])])
                row["adaptive_k_histogram_total"] = llms["adaptive"].get_metrics().get("k_histogram")
                row["adaptive_controller"] = controller_state(llms["adaptive"], batch, temperature > 0)
                logger.info("%s batch %d T=%.1f: adaptive %.2fx, best static %s %.2fx", method, batch, temperature,
                            row["systems"]["adaptive"]["speedup"], best, static[best])
                results.append(row)
        del llms, plain, systems, control
        gc.collect()
    out = {"date": time.strftime("%Y-%m-%d"), "machine": machine_info(), "args": {k: str(v) if isinstance(v, Path)
           else v for k, v in vars(args).items()}, "compile_s": compile_s, "results": results,
           "command": " ".join(["python"] + sys.argv)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(tables(out))


def ratios_vs_both(systems: dict, name: str) -> list[float]:
    """System ``name``'s speed-up over both plain LLMs in each round: the mean of plain's and the control's times
    over its own (half the reference's noise)."""
    both = [(p + c) / 2 for p, c in zip(systems["plain"]["times"], systems["control"]["times"])]
    return [b / t for b, t in zip(both, systems[name]["times"])]


def speedup_vs_both(systems: dict, name: str) -> float:
    """The median over rounds of :func:`ratios_vs_both`."""
    return statistics.median(ratios_vs_both(systems, name))


def with_ci(median: float, ci: tuple[float, float]) -> str:
    """A speed-up and, in brackets, the 95% interval of its median: how far a load's median may be from the
    machine's true ratio with this many rounds."""
    return f"{median:.2f}x [{ci[0]:.2f}-{ci[1]:.2f}]"


def below(ci: tuple[float, float], floor: float = 0.97) -> bool:
    """Slower than ``floor`` x plain with confidence: the whole interval lies below it."""
    return ci[1] < floor


def tables(d: dict) -> str:
    lines = ["| method | batch | T | plain tok/s | control [95% CI] | adaptive [95% CI] | "
             "adaptive vs plain & control [95% CI] | best static K | adaptive / best static [95% CI] | "
             "adaptive spec-step share | adaptive detached-step share |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    slower = []
    for r in d["results"]:
        s = r["systems"]
        ci = lambda name: tuple(s[name].get("speedup_ci") or median_ci(  # (JSON written before the intervals)
            [p / t for p, t in zip(s["plain"]["times"], s[name]["times"])]))
        control = with_ci(s["control"]["speedup"], ci("control")) if "control" in s else "-"
        both = ratios_vs_both(s, "adaptive") if "control" in s else None
        both = with_ci(statistics.median(both), median_ci(both)) if both else "-"
        best = r["best_static"]
        vs_best = with_ci(r["adaptive_vs_best_static"], r.get("adaptive_vs_best_static_ci") or median_ci(
            [b / a for b, a in zip(s[best]["times"], s["adaptive"]["times"])])).replace("x [", " [")
        if below(ci("adaptive")):
            slower.append(f"{r['method']} batch {r['batch']} T {r['temperature']}")
        lines.append(f"| {r['method']} | {r['batch']} | {r['temperature']} | {s['plain']['tok_s']:.0f} | {control} | "
                     f"{with_ci(s['adaptive']['speedup'], ci('adaptive'))} | {both} | "
                     f"{best} {s[best]['speedup']:.2f}x | {vs_best} | {s['adaptive']['spec_step_share']:.2f} | "
                     f"{s['adaptive'].get('detached_step_share', float('nan')):.2f} |")
    lines.append("")
    lines.append(f"Loads slower than 0.97x plain with 95% confidence: {', '.join(slower) if slower else 'none'}.")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
