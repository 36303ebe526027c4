"""Batch-job throughput (``specjax batch``): plain decoding vs speculative decoding on the shipped pair.

Builds an OpenAI-format JSONL of --num-prompts completion requests from the held-out side of the stdlib split
(source the shipped pair never trained on; see specjax/train/corpus.py), each a window of about --prompt-chars
characters of code starting at a line boundary, greedy, --max-tokens new tokens with ignore_eos (so both runs
generate the same number of tokens). The same file goes through the batch-job path (``specjax.batch.run_batch``:
parsing, per-line validation, chunks through ``LLM.generate``, fsync'd records, summary) once with the shipped
target alone and once with the shipped pair (draft_model, adaptive K <= 4), for each --max-num-seqs. Model load +
warmup compiles are timed apart from the job. Greedy speculation is lossless, so the two runs' records must carry
identical token ids. For comparison, the same LLM then runs all prompts in one ``LLM.generate`` call (no chunks, no
per-line validation, no records): the difference is what the job machinery costs, mostly the batch draining at the
end of each chunk.

With ``--rounds N`` both systems are loaded first and each runs the job (and the one call) N times, alternating
which goes first; rows carry medians, and the speedup is the median of each round's ratio (this host's speed
drifts ~10% between configurations run one after another), with its 95% interval (``ratios.median_ci``).

``--control`` adds a second plain LLM, loaded and run like the others: its "speedup" over plain is the noise
between two identical systems in that run (four identical plain LLMs at 8 rows differed by up to ~8%).

``--mixed-step-padding none 16`` repeats every configuration with decoding rows and prompt chunks always in one
step (``none``, the engine before that option) and with the default (they take turns where mixing pads).

``--tp 1 2`` repeats every configuration with ``tensor_parallel_size`` 1 and 2
and checks that tp 2 gives the same tokens as tp 1. On CPU the extra devices
are host-platform fakes sharing the same cores, so the tp rows test
correctness, not speed.

    python benchmarks/bench_batch.py --out benchmarks/results/batch.json
    python benchmarks/bench_batch.py --mixed-step-padding none 16 --out benchmarks/results/batch_mixed_steps.json
    python benchmarks/bench_batch.py --rounds 5 --max-num-seqs 32 --out benchmarks/results/batch_rounds_32.json
    python benchmarks/bench_batch.py --rounds 5 --max-num-seqs 8 --out benchmarks/results/batch_rounds_8_cut.json
    python benchmarks/bench_batch.py --rounds 5 --max-num-seqs 8 --out benchmarks/results/batch_rounds_8_turns.json
    python benchmarks/bench_batch.py --rounds 5 --max-num-seqs 32 --out benchmarks/results/batch_rounds_32_turns.json
    python benchmarks/bench_batch.py --rounds 7 --control --max-num-seqs 8 --out benchmarks/results/batch_rounds_8_control.json
    XLA_FLAGS=--xla_force_host_platform_device_count=2 \
        python benchmarks/bench_batch.py --tp 1 2 --max-num-seqs 8 --out benchmarks/results/batch_tp.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import platform
import statistics
import tempfile
import time
from pathlib import Path

import specjax
from ratios import median_ci
from specjax.batch import BatchOptions, run_batch
from specjax.builtin import STDLIB_SPEC
from specjax.train import corpus

logger = logging.getLogger("bench_batch")


def heldout_prompts(n: int, chars: int) -> list[str]:
    """``n`` windows of about ``chars`` characters of held-out stdlib code, round-robin over the files."""
    _, heldout = corpus.split_files()
    # Codec tables (encodings/) are trivially repetitive; they would flatter speculation.
    files = [f for f in heldout if not f.startswith("encodings/")] or heldout
    windows: list[list[str]] = []
    for f in files:
        lines = corpus.read_text(f).splitlines(keepends=True)
        out, i = [], 0
        while i < len(lines):
            text, j = "", i
            while j < len(lines) and len(text) < chars:
                text += lines[j]
                j += 1
            if text.strip():
                out.append(text[: chars * 2])
            i = j
        windows.append(out)
    prompts: list[str] = []
    depth = 0
    while len(prompts) < n:
        added = False
        for w in windows:
            if depth < len(w) and len(prompts) < n:
                prompts.append(w[depth])
                added = True
        if not added:
            raise SystemExit(f"only {len(prompts)} prompt windows in the held-out files; lower --num-prompts")
        depth += 1
    return prompts


def load(llm_kwargs: dict) -> tuple[specjax.LLM, float]:
    """The LLM and the seconds its load and warmup compiles took."""
    start = time.perf_counter()
    llm = specjax.LLM(**llm_kwargs)
    return llm, time.perf_counter() - start


def run_round(name: str, llm: specjax.LLM, input_path: Path, out_dir: Path, chunk_size: int | None,
              prompts: list[str], max_tokens: int) -> dict:
    """The job once through ``llm``, then the same requests in one ``LLM.generate`` call."""
    output = out_dir / f"{name}.jsonl"
    summary = run_batch(BatchOptions(input=str(input_path), output=str(output), chunk_size=chunk_size,
                                     progress=False), llm=llm)
    run = summary["runs"][0]
    records = [json.loads(line) for line in output.read_text().splitlines()]
    # The same requests in one LLM.generate call: what the job's chunking, validation and fsync'd records cost.
    params = specjax.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    direct = llm.generate(prompts, params, use_tqdm=False)
    direct_s = time.perf_counter() - start
    direct_tokens = sum(len(o.outputs[0].token_ids) for o in direct)
    assert [o.outputs[0].token_ids for o in direct] == [r["token_ids"] for r in records]
    return {
        "num_compiles": llm.num_compiles,
        "requests": summary["num_requests"],
        "errors": summary["num_errors"],
        "generated_tokens": summary["num_generated_tokens"],
        "job_s": run["generate_seconds"],
        "tokens_per_s": summary["throughput_tokens_per_s"],
        "requests_per_s": summary["num_requests"] / run["generate_seconds"],
        "acceptance_rate": summary["acceptance_rate"],
        "mean_acceptance_length": summary["mean_acceptance_length"],
        "latency_s": summary["latency_s"],
        "direct_generate_tokens_per_s": direct_tokens / direct_s,
        "token_ids": [r.get("token_ids") for r in records],
    }


def median_row(rounds: list[dict]) -> dict:
    """One configuration's rounds as one row: the median of each timing, the last round's counts and tokens."""
    row = dict(rounds[-1])
    for key in ("job_s", "tokens_per_s", "requests_per_s", "direct_generate_tokens_per_s"):
        row[key] = statistics.median(r[key] for r in rounds)
    row["latency_s"] = {q: statistics.median(r["latency_s"][q] for r in rounds) for q in rounds[-1]["latency_s"]}
    if len(rounds) > 1:
        row["rounds_tokens_per_s"] = [r["tokens_per_s"] for r in rounds]
        row["rounds_direct_generate_tokens_per_s"] = [r["direct_generate_tokens_per_s"] for r in rounds]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--prompt-chars", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--chunk-size", type=int, default=None, help="default: the job's (8 x max_num_seqs)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1], help="tensor_parallel_size values to run")
    ap.add_argument("--mixed-step-padding", nargs="+", default=["16"],
                    help="LLM mixed_step_padding values to run (ints, or 'none': decoding rows and prompt chunks "
                         "always share a step)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="each configuration's systems loaded side by side, then run this many rounds alternating "
                         "which goes first; medians (speedups: of each round's pair)")
    ap.add_argument("--control", action="store_true",
                    help="also a second plain LLM run like the others: its speedup vs plain is the run's noise")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import jax

    if max(args.tp) > len(jax.local_devices()):
        raise SystemExit(
            f"--tp {max(args.tp)} needs that many devices, {len(jax.local_devices())} found; on CPU run with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={max(args.tp)}"
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    tmp = Path(tempfile.mkdtemp(prefix="specjax_batch_"))
    prompts = heldout_prompts(args.num_prompts, args.prompt_chars)
    input_path = tmp / "requests.jsonl"
    with open(input_path, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"prompt": p, "max_tokens": args.max_tokens, "temperature": 0,
                                         "ignore_eos": True}}) + "\n")
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} CPU, 2 cores (shared with other jobs)",
        "model": "shipped pair: builtin:target (7.5M) + builtin:draft (1M)",
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "rows": [],
    }
    tp1_tokens: dict[tuple[str, int], list] = {}
    for tp in args.tp:
        for seqs, padding in ((s, p) for s in args.max_num_seqs for p in args.mixed_step_padding):
            base = dict(model="builtin:target", max_model_len=args.max_model_len, max_num_seqs=seqs, seed=0,
                        tensor_parallel_size=tp, mixed_step_padding=None if padding == "none" else int(padding))
            suffix = f" (mixed_step_padding {padding})" if len(args.mixed_step_padding) > 1 else ""
            configs = [("plain" + suffix, base),
                       (f"spec draft_model adaptive K<={STDLIB_SPEC['num_speculative_tokens']}" + suffix,
                        {**base, "speculative_config": dict(STDLIB_SPEC)})]
            if args.control:
                configs.append(("plain control" + suffix, base))
            loaded = []
            for name, kwargs in configs:
                logger.info("loading %s, max_num_seqs=%d, tp=%d", name, seqs, tp)
                loaded.append((name, *load(kwargs)))
            rounds: dict[str, list[dict]] = {name: [] for name, _, _ in loaded}
            for r in range(args.rounds):
                # Alternate which system runs first: the machine's speed drifts within a run.
                for name, llm, _ in (loaded if r % 2 == 0 else loaded[::-1]):
                    logger.info("round %d: %s, max_num_seqs=%d, tp=%d", r + 1, name, seqs, tp)
                    tag = f"{'_'.join(name.split()[:2])}_{seqs}_tp{tp}_{padding}_r{r}"
                    rounds[name].append(run_round(tag, llm, input_path, tmp, args.chunk_size, prompts,
                                                  args.max_tokens))
            plain = None
            for name, _, load_s in loaded:
                row = median_row(rounds[name])
                row.update(config=name, max_num_seqs=seqs, tensor_parallel_size=tp, load_and_compile_s=load_s)
                if plain is None:
                    plain = row
                else:
                    pairs = list(zip(rounds[name], rounds[plain["config"]]))  # (this system's, plain's) per round
                    ratios = [mine["tokens_per_s"] / base["tokens_per_s"] for mine, base in pairs]
                    row["speedup_vs_plain"] = statistics.median(ratios)  # paired: the median of each round's ratio
                    row["identical_to_plain"] = all(mine["token_ids"] == base["token_ids"] for mine, base in pairs)
                    if args.rounds > 1:
                        row["rounds_speedup_vs_plain"] = ratios
                        row["speedup_vs_plain_ci95"] = median_ci(ratios)
                        row["direct_generate_speedup_vs_plain"] = statistics.median(
                            mine["direct_generate_tokens_per_s"] / base["direct_generate_tokens_per_s"]
                            for mine, base in pairs)
                key = (name, seqs)
                if tp == args.tp[0]:
                    tp1_tokens[key] = row["token_ids"]
                else:
                    row[f"identical_to_tp{args.tp[0]}"] = row["token_ids"] == tp1_tokens.get(key)
                results["rows"].append({k: v for k, v in row.items() if k != "token_ids"})
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                                  if k not in ("token_ids", "latency_s")}), flush=True)
            # Free this configuration's executables before the next one compiles its own: each holds hundreds
            # of memory mappings, and a process reaching vm.max_map_count (65530 by default) crashes compiling
            # ("LLVM compilation error: Cannot allocate memory"; README, "Several LLMs in one process").
            del loaded, rounds
            gc.collect()
            if args.out:  # (after each configuration: a later one that fails keeps the earlier ones)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))


def speedup_cell(row: dict) -> str:
    """A row's speed-up over plain and, with several rounds, the 95% interval of that median
    (``ratios.median_ci``): on this host two identical LLMs differ by up to ~8% over 5-8 rounds."""
    ci = row.get("speedup_vs_plain_ci95")
    return f"{row.get('speedup_vs_plain', 1.0):.2f}x" + (f" [{ci[0]:.2f}-{ci[1]:.2f}]" if ci else "")


def table(results: dict) -> str:
    """The markdown table for benchmarks/README.md."""
    c = results["config"]
    lines = [
        f"{c['num_prompts']} held-out stdlib prompts (~{c['prompt_chars']} chars), {c['max_tokens']} new tokens each, "
        f"greedy, ignore_eos; {results['model']}; {results['date']}, {results['machine']}"
        + (f"; medians of {c['rounds']} rounds side by side." if c.get("rounds", 1) > 1 else "."),
        "",
        "| config | tp | max_num_seqs | job tokens/s | requests/s | speedup | acceptance rate | mean acceptance length | "
        "latency p50 / p90 s | one generate() call tokens/s | load + compile s | identical to plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        acc = f"{r['acceptance_rate']:.3f}" if r["acceptance_rate"] is not None else "-"
        mal = f"{r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] is not None else "-"
        same = {True: "yes", False: "NO"}.get(r.get("identical_to_plain"), "-")
        same_tp = {True: "yes", False: "NO"}.get(r.get("identical_to_tp1"))
        if same_tp is not None:
            same += f"; same as tp 1: {same_tp}"
        lat = r["latency_s"]
        lines.append(
            f"| {r['config']} | {r.get('tensor_parallel_size', 1)} | {r['max_num_seqs']} | {r['tokens_per_s']:.1f} | {r['requests_per_s']:.2f} | "
            f"{speedup_cell(r)} | {acc} | {mal} | {lat['p50']:.2f} / {lat['p90']:.2f} | "
            f"{r['direct_generate_tokens_per_s']:.1f} | {r['load_and_compile_s']:.1f} | {same} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
