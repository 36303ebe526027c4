"""Batch-job throughput (``specjax batch``): plain decoding vs speculative decoding on the shipped pair.

Builds an OpenAI-format JSONL of --num-prompts completion requests from the
held-out side of the stdlib split (source the shipped pair never trained on;
see specjax/train/corpus.py), each a window of about --prompt-chars characters
of code starting at a line boundary, greedy, --max-tokens new tokens with
ignore_eos (so both runs generate the same number of tokens). The same file
goes through the batch-job path (``specjax.batch.run_batch``: parsing,
per-line validation, chunks through ``LLM.generate``, fsync'd records, summary)
once with the shipped target alone and once with the shipped pair
(draft_model, adaptive K <= 4), for each --max-num-seqs. Model load + warmup compiles are
timed apart from the job. Greedy speculation is lossless, so the two runs'
records must carry identical token ids. For comparison, the same LLM then runs
all prompts in one ``LLM.generate`` call (no chunks, no per-line validation, no
records): the difference is what the job machinery costs, mostly the batch
draining at the end of each chunk.

``--mixed-step-padding none 16`` repeats every configuration with decoding rows and prompt chunks always in one
step (``none``, the engine before that option) and with the default (they take turns where mixing pads).

``--tp 1 2`` repeats every configuration with ``tensor_parallel_size`` 1 and 2
and checks that tp 2 gives the same tokens as tp 1. On CPU the extra devices
are host-platform fakes sharing the same cores, so the tp rows test
correctness, not speed.

    python benchmarks/bench_batch.py --out benchmarks/results/batch.json
    python benchmarks/bench_batch.py --mixed-step-padding none 16 --out benchmarks/results/batch_mixed_steps.json
    XLA_FLAGS=--xla_force_host_platform_device_count=2 \
        python benchmarks/bench_batch.py --tp 1 2 --max-num-seqs 8 --out benchmarks/results/batch_tp.json
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import tempfile
import time
from pathlib import Path

import specjax
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


def run_one(name: str, llm_kwargs: dict, input_path: Path, out_dir: Path, chunk_size: int | None,
            prompts: list[str], max_tokens: int) -> dict:
    start = time.perf_counter()
    llm = specjax.LLM(**llm_kwargs)
    load_s = time.perf_counter() - start
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
        "config": name,
        "load_and_compile_s": load_s,
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
            plain = None
            for name, kwargs in configs:
                logger.info("running %s, max_num_seqs=%d, tp=%d", name, seqs, tp)
                row = run_one(f"{name.split()[0]}_{seqs}_tp{tp}_{padding}", kwargs, input_path, tmp, args.chunk_size,
                              prompts, args.max_tokens)
                row.update(config=name, max_num_seqs=seqs, tensor_parallel_size=tp)
                if plain is None:
                    plain = row
                else:
                    row["speedup_vs_plain"] = row["tokens_per_s"] / plain["tokens_per_s"]
                    row["identical_to_plain"] = row["token_ids"] == plain["token_ids"]
                key = (name, seqs)
                if tp == args.tp[0]:
                    tp1_tokens[key] = row["token_ids"]
                else:
                    row[f"identical_to_tp{args.tp[0]}"] = row["token_ids"] == tp1_tokens.get(key)
                results["rows"].append({k: v for k, v in row.items() if k != "token_ids"})
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                                  if k not in ("token_ids", "latency_s")}), flush=True)
    print(table(results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")


def table(results: dict) -> str:
    """The markdown table for benchmarks/README.md."""
    c = results["config"]
    lines = [
        f"{c['num_prompts']} held-out stdlib prompts (~{c['prompt_chars']} chars), {c['max_tokens']} new tokens each, "
        f"greedy, ignore_eos; {results['model']}; {results['date']}, {results['machine']}.",
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
            f"{r.get('speedup_vs_plain', 1.0):.2f}x | {acc} | {mal} | {lat['p50']:.2f} / {lat['p90']:.2f} | "
            f"{r['direct_generate_tokens_per_s']:.1f} | {r['load_and_compile_s']:.1f} | {same} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
