"""Command line: ``specjax generate --model DIR --prompt "..."``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

logger = logging.getLogger("specjax")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="Hugging Face model directory or builtin:<name>; default: the shipped pair with speculation")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speculative-config", type=json.loads, default=None, help="JSON object")
    p.add_argument("--no-warmup", action="store_true", help="compile buckets lazily instead of up front")


def _generate(args: argparse.Namespace) -> int:
    import specjax

    prompts: list = list(args.prompt or [])
    for ids in args.prompt_token_ids or []:
        prompts.append({"prompt_token_ids": [int(t) for t in ids.split(",")]})
    if not prompts:
        raise ValueError("give at least one --prompt or --prompt-token-ids")
    params = specjax.SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, max_tokens=args.max_tokens,
        seed=args.request_seed, ignore_eos=args.ignore_eos,
    )
    # The prompts are all known up front: compiling row buckets wider than their count would be wasted warmup.
    llm = specjax.LLM(
        args.model, dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=min(args.max_num_seqs, len(prompts)),
        seed=args.seed, speculative_config=args.speculative_config, warmup=not args.no_warmup,
    )
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
    if "acceptance_rate" in metrics:
        print(
            f"[specjax] speculative {llm.speculative_config.method or 'synthetic'}: acceptance rate "
            f"{metrics['acceptance_rate']:.3f}, mean acceptance length {metrics['mean_acceptance_length']:.2f}, "
            f"accepted per position {metrics['accepted_per_position']}",
            file=sys.stderr,
        )
    print(
        f"[specjax] {len(outputs)} prompts, {n_tokens} tokens in {elapsed:.2f}s "
        f"({n_tokens / elapsed:.1f} tokens/s); compiles: {metrics['num_compiles']} "
        f"({metrics['compile_seconds']:.1f}s)",
        file=sys.stderr,
    )
    if plain_elapsed is not None:
        print(
            f"[specjax] plain decoding of the same prompts took {plain_elapsed:.2f}s: speculative speedup "
            f"{plain_elapsed / elapsed:.2f}x",
            file=sys.stderr,
        )
    return 0


def _time_plain(args: argparse.Namespace, spec_llm, prompts: list, params, spec_outputs) -> float:
    """Run the same prompts without speculation (same weights, same buckets); returns its wall time."""
    import specjax

    plain = specjax.LLM(
        spec_llm.model_path, dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=spec_llm.engine_config.max_num_seqs, seed=args.seed, warmup=not args.no_warmup,
    )
    start = time.perf_counter()
    outputs = plain.generate(prompts, params)
    elapsed = time.perf_counter() - start
    if params.temperature == 0 and any(
        a.outputs[0].token_ids != b.outputs[0].token_ids for a, b in zip(outputs, spec_outputs)
    ):
        logger.warning("greedy speculative output differs from plain decoding")
    return elapsed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specjax", description="Speculative decoding on JAX/XLA")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for prompts")
    _add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="text prompt (repeatable)")
    gen.add_argument("--prompt-token-ids", action="append", help="comma-separated token ids (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--request-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--compare-plain", action=argparse.BooleanOptionalAction, default=None,
                     help="also time plain decoding and print the speedup (default: on for the shipped pair)")
    gen.set_defaults(func=_generate)
    return parser


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
