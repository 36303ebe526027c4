"""Measure a draft model's or head's acceptance against its target and write it as the controller's prior.

Runs the target with the proposer at a fixed K over held-out prompts, once greedy and once sampling (seeded
requests at ``--temperature``), and counts per position the drafts verified (every draft before them accepted)
and accepted (``LLM.get_metrics()``'s ``verified_per_position`` / ``accepted_per_position``). ``--write``
stores them as ``acceptance.json`` in the proposer's directory
(:class:`specjax.spec_decode.acceptance.AcceptancePrior`): the adaptive controller then starts from them
instead of learning the method's acceptance from its first drafts. Prompts skip the ones the benchmarks
measure speed on (``--skip``), so a benchmark's load is not the prior's.

    python benchmarks/measure_acceptance.py --target builtin:target --method draft_model --model builtin:draft \\
        --prompts stdlib --skip 32 --num-prompts 16 --write
"""

from __future__ import annotations

import argparse
import datetime
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import specjax  # noqa: E402
from specjax.builtin import resolve_model  # noqa: E402
from specjax.spec_decode.acceptance import PRIOR_FILE, AcceptancePrior  # noqa: E402


def held_out_prompts(kind: str, llm, target: str, skip: int, n: int, max_len: int) -> list[list[int]]:
    """Prompts ``skip .. skip + n`` of the held-out set the benchmarks draw from (token ids)."""
    if kind == "stdlib":  # bench_adaptive / bench_builtin: 64-token windows of held-out stdlib files
        from bench_builtin import token_prompts

        return token_prompts(llm.tokenizer, skip + n, max_len)[skip:]
    from bench_adaptive import selfgen_prompts  # SmolLM2's loads: selfgen's held-out topics

    return selfgen_prompts(target, skip + n, max_len)[skip:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--method", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompts", choices=["stdlib", "selfgen"], required=True)
    ap.add_argument("--skip", type=int, default=32, help="held-out prompts to leave to the speed benchmarks")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8, help="of the sampling requests")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--write", action="store_true", help=f"write {PRIOR_FILE} into --model's directory")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    llm = specjax.LLM(args.target, max_num_seqs=args.max_num_seqs, warmup=False,
                      max_model_len=args.prompt_len + args.max_tokens + args.k + 8,
                      speculative_config={"method": args.method, "model": args.model,
                                          "num_speculative_tokens": args.k, "adaptive": False})
    prompts = held_out_prompts(args.prompts, llm, args.target, args.skip, args.num_prompts, args.prompt_len)
    counts = {}
    for name, temperature in (("greedy", 0.0), ("sampled", args.temperature)):
        before = llm.get_metrics()
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     [specjax.SamplingParams(temperature=temperature, max_tokens=args.max_tokens, ignore_eos=True,
                                             seed=i) for i in range(len(prompts))])
        after = llm.get_metrics()
        counts[name] = tuple(tuple(int(a) - int(b) for a, b in zip(after[key], before[key]))
                             for key in ("accepted_per_position", "verified_per_position"))
    prior = AcceptancePrior(target=args.target, greedy=counts["greedy"], sampled=counts["sampled"])
    command = "python benchmarks/measure_acceptance.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and not isinstance(v, bool))
    text = prior.to_json(
        method=args.method, k=args.k, prompts=f"{args.prompts} held-out {args.skip}..{args.skip + len(prompts)}",
        max_tokens=args.max_tokens, sampled_temperature=args.temperature,
        date=datetime.date.today().isoformat(), command=command + (" --write" if args.write else ""))
    print(text, end="")
    for name, (acc, tried) in counts.items():
        print(name, "conditional acceptance per position:",
              [round(a / t, 3) if t else None for a, t in zip(acc, tried)])
    if args.write:
        path = Path(resolve_model(args.model)) / PRIOR_FILE
        path.write_text(text)
        print("wrote", path)


if __name__ == "__main__":
    main()
