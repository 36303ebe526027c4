"""Prompt chunks cut to the query bucket that pads least (the scheduler's ``_chunk_cap``) vs never cut, side by side.

Two LLMs of the same configuration in one process, one with the scheduler as it is and one whose scheduler never
cuts a chunk below ``max_prefill_chunk`` (the engine before the cut; decoding rows and prompt chunks still take
turns in both), running the same work in alternating order for --rounds rounds. ``--compare turns`` (with
``--spec``) instead sets the scheduler as it is against one that mixes drafting decoding rows into prompt-chunk
steps wherever it mixes plain ones (the engine before drafting rows took turns; both cut chunks):

- ``--load batch``: the batch benchmark's 256 held-out stdlib prompts (20-122 tokens; bench_batch.py), greedy,
  64 new tokens each with ignore_eos, in one ``generate`` call, for each --max-num-seqs;
- ``--load single``: one prompt at a time (the first N tokens of a source file, for each --lengths N), one new
  token: the time to the first token at batch 1.

Greedy outputs must be identical (asserted). Ratios are cut / uncut (turns / mixed) time per round, then their
median.

    python benchmarks/bench_prefill_cut.py --load batch --max-num-seqs 8 32 --out benchmarks/results/prefill_cut_batch.json
    python benchmarks/bench_prefill_cut.py --load batch --spec --max-num-seqs 8 --out benchmarks/results/prefill_cut_batch_spec.json
    python benchmarks/bench_prefill_cut.py --load single --out benchmarks/results/prefill_cut_single.json
    python benchmarks/bench_prefill_cut.py --compare turns --load batch --spec --max-num-seqs 8 \
        --out benchmarks/results/drafting_turns_batch_8.json
    python benchmarks/bench_prefill_cut.py --compare turns --load batch --spec --fixed-k 2 --max-num-seqs 8 \
        --out benchmarks/results/drafting_turns_batch_8_k2.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import platform
import statistics
import time
from pathlib import Path

import specjax
from specjax.builtin import STDLIB_SPEC
from specjax.scheduler import Scheduler

from bench_batch import heldout_prompts

logger = logging.getLogger("bench_prefill_cut")


class UncutScheduler(Scheduler):
    """The scheduler with every chunk cap at ``max_prefill_chunk``: the engine before chunks were cut."""

    def _chunk_cap(self, budget: int) -> int:
        return self.config.prefill_chunk


class MixingScheduler(Scheduler):
    """The scheduler mixing decoding rows that draft into prompt-chunk steps as it mixes plain ones: the engine
    before drafting rows took turns."""

    def schedule(self, *, drafting: bool = False):
        return super().schedule(drafting=False)


COMPARISONS = {"cut": ("cut", "uncut", UncutScheduler), "turns": ("turns", "mixed", MixingScheduler)}
"""--compare: (the scheduler as it is, the baseline, the baseline's scheduler class)."""


def pair(kwargs: dict, compare: str) -> dict[str, specjax.LLM]:
    """The LLMs of one configuration: the scheduler as it is, then the baseline."""
    new, old, cls = COMPARISONS[compare]
    llms = {new: specjax.LLM(**kwargs), old: specjax.LLM(**kwargs)}
    llms[old].engine.scheduler.__class__ = cls
    return llms


def alternate(llms: dict, work, rounds: int) -> tuple[dict[str, list[float]], dict[str, list]]:
    """``work(llm)`` for each LLM, ``rounds`` times, alternating which goes first: seconds and outputs."""
    times: dict[str, list[float]] = {name: [] for name in llms}
    outputs: dict[str, list] = {}
    for r in range(rounds):
        for name in (list(llms) if r % 2 == 0 else list(llms)[::-1]):
            start = time.perf_counter()
            outputs[name] = work(llms[name])
            times[name].append(time.perf_counter() - start)
    first, second = outputs.values()
    assert first == second, f"greedy outputs differ between {' and '.join(llms)}"
    return times, outputs


def ratios(times: dict[str, list[float]]) -> list[float]:
    new, old = times.values()
    return [a / b for a, b in zip(new, old)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", choices=tuple(COMPARISONS), default="cut")
    ap.add_argument("--load", choices=("batch", "single"), default="batch")
    ap.add_argument("--spec", action="store_true", help="the shipped pair (draft_model, adaptive) instead of plain")
    ap.add_argument("--fixed-k", type=int, default=None, help="with --spec: a fixed K instead of the controller")
    ap.add_argument("--max-num-seqs", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--lengths", type=int, nargs="+", default=[10, 20, 40, 70, 100, 200])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not args.spec and (args.compare == "turns" or args.fixed_k is not None):
        ap.error("--compare turns and --fixed-k need --spec (without drafts the two schedulers run the same steps)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()} CPU, 2 cores",
        "model": "shipped target (7.5M)" + ((f" + draft_model (fixed K = {args.fixed_k})" if args.fixed_k else
                                            " + draft_model (adaptive K <= 4)") if args.spec else ", plain"),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "rows": [],
    }
    new, old, _ = COMPARISONS[args.compare]
    key = f"{new}_over_{old}"
    base = dict(model="builtin:target", seed=0,
                speculative_config=(dict(STDLIB_SPEC, num_speculative_tokens=args.fixed_k, adaptive=False)
                                    if args.fixed_k else dict(STDLIB_SPEC)) if args.spec else None)
    if args.load == "batch":
        prompts = heldout_prompts(256, 200)
        params = specjax.SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        for seqs in args.max_num_seqs:
            llms = pair(dict(base, max_model_len=256, max_num_seqs=seqs), args.compare)
            times, _ = alternate(llms, lambda llm: [o.outputs[0].token_ids for o in
                                                    llm.generate(prompts, params, use_tqdm=False)], args.rounds)
            steps = {name: llm.get_metrics()["num_steps"] for name, llm in llms.items()}
            row = {"max_num_seqs": seqs, "seconds": times, key: ratios(times),
                   f"median_{key}": statistics.median(ratios(times)), "num_steps_total": steps}
            results["rows"].append(row)
            logger.info("max_num_seqs %d: %s / %s time %s, median %.3f, steps %s", seqs, new, old,
                        [round(x, 3) for x in row[key]], row[f"median_{key}"], steps)
            write(results, args.out)
            del llms
            gc.collect()
    else:
        llms = pair(dict(base, max_model_len=512, max_num_seqs=8), args.compare)
        ids = llms[new].get_tokenizer().encode(Path(specjax.__file__).with_name("scheduler.py").read_text()).ids
        params = specjax.SamplingParams(temperature=0.0, max_tokens=1)
        for n in args.lengths:
            prompt = {"prompt_token_ids": ids[:n]}
            times, _ = alternate(llms, lambda llm: llm.generate([prompt], params, use_tqdm=False)[0]
                                 .outputs[0].token_ids, args.rounds)
            row = {"prompt_tokens": n, "median_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
                   key: ratios(times), f"median_{key}": statistics.median(ratios(times))}
            results["rows"].append(row)
            logger.info("%d prompt tokens: %s %.2f ms, %s %.2f ms, %s / %s %.3f", n, old, row["median_ms"][old],
                        new, row["median_ms"][new], new, old, row[f"median_{key}"])
            write(results, args.out)


def write(results: dict, out: Path | None) -> None:
    """The results so far (after each configuration: a later one may crash, see README's several LLMs)."""
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
