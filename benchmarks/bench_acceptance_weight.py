"""How much a request's own drafts should weigh against the method's average (the controller's prior strength).

Each system (a method at fixed K, one temperature) generates ``--prompts`` held-out stdlib prompts one at a time
(batch 1, ``--new-tokens`` each, seeded per prompt), and every verification is recorded per request: drafts
verified and accepted. Offline, each step's outcome per draft position (accepted, or the first rejected) is
predicted from the request's earlier steps by the controller's estimate, ``(a + m p) / (t + m)`` with ``a`` / ``t``
the request's accepted / tried drafts at that position so far, discounted by ``lambda`` a step (1 = not at all:
the controller's rule), and ``p`` the method's rate over the other requests (leave one out). Reported: the
log-loss per observation for each ``m`` and ``lambda``, against ``m`` = infinity (the method's rate alone), and
the strength the controller's spread rule (``prior_strength``) gives these requests. No timing: nothing here
depends on the machine's speed.

    python benchmarks/bench_acceptance_weight.py --out benchmarks/results/acceptance_weight.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path

import specjax
from bench_builtin import machine_info, token_prompts
from specjax.spec_decode.acceptance import prior_strength

logger = logging.getLogger("bench_acceptance_weight")

MODELS = {"draft_model": "builtin:draft", "eagle3": "builtin:eagle3"}
WEIGHTS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 256.0, math.inf)
DISCOUNTS = (1.0, 0.9, 0.8)


def traces(method: str, k: int, temperature: float, prompts: list[list[int]], new_tokens: int) -> list[list]:
    """Per request, its verifications in order: (drafts verified, drafts accepted)."""
    spec = {"method": method, "model": MODELS[method], "num_speculative_tokens": k, "adaptive": False}
    llm = specjax.LLM("builtin:target", speculative_config=spec, max_model_len=len(prompts[0]) + new_tokens + 8,
                      max_num_seqs=1, batch_buckets=[1], query_buckets=(1, len(prompts[0])),
                      max_prefill_chunk=len(prompts[0]), seed=0)
    stats, seen = llm.engine.spec_stats, []
    observe = stats.observe

    def record(drafted: int, accepted: int) -> None:
        seen.append((drafted, accepted))
        observe(drafted, accepted)

    stats.observe = record
    out = []
    for i, ids in enumerate(prompts):
        seen.clear()
        params = specjax.SamplingParams(temperature=temperature, max_tokens=new_tokens, ignore_eos=True, seed=i)
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        out.append(list(seen))
    return out


def _outcomes(steps):
    """Per step, per position it reached: (position, accepted)."""
    return [[(j, j < accepted) for j in range(min(drafted, accepted + 1))] for drafted, accepted in steps]


def log_loss(requests: list[list], k: int, m: float, discount: float) -> float:
    """Mean negative log-likelihood per (step, position reached) of the estimate with weight ``m``."""
    per = []
    for steps in requests:
        a, t = [0] * k, [0] * k
        for step in _outcomes(steps):
            for j, ok in step:
                t[j] += 1
                a[j] += ok
        per.append((a, t))
    total_a = [sum(a[j] for a, _ in per) for j in range(k)]
    total_t = [sum(t[j] for _, t in per) for j in range(k)]
    loss = count = 0
    for (own_a, own_t), steps in zip(per, requests):
        prior = [(total_a[j] - own_a[j] + 1) / (total_t[j] - own_t[j] + 2) for j in range(k)]  # leave one out
        a, t = [0.0] * k, [0.0] * k
        for step in _outcomes(steps):
            for j, ok in step:
                p = prior[j] if math.isinf(m) else (a[j] + m * prior[j]) / (t[j] + m)
                p = min(max(p, 1e-4), 1 - 1e-4)
                loss -= math.log(p if ok else 1 - p)
                count += 1
            a, t = [x * discount for x in a], [x * discount for x in t]
            for j, ok in step:
                t[j] += 1
                a[j] += ok
    return loss / count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/acceptance_weight.json"))
    ap.add_argument("--methods", nargs="+", default=["draft_model", "eagle3"])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    results = []
    prompts = None
    for method in args.methods:
        for temperature in args.temperatures:
            if prompts is None:
                from tokenizers import Tokenizer

                from specjax.builtin import target_path
                tokenizer = Tokenizer.from_file(str(Path(target_path()) / "tokenizer.json"))
                prompts = token_prompts(tokenizer, args.prompts, args.prompt_len)
            requests = traces(method, args.k, temperature, prompts, args.new_tokens)
            # (the finished requests' totals as the controller keeps them: accepted, positions reached)
            rule = prior_strength([(sum(a for _, a in r), sum(min(d, a + 1) for d, a in r)) for r in requests],
                                  4.0, 64.0)
            base = log_loss(requests, args.k, math.inf, 1.0)
            table = {f"lambda={d:g}": {f"m={m:g}": round(log_loss(requests, args.k, m, d) - base, 4)
                                       for m in WEIGHTS} for d in DISCOUNTS}
            results.append({"method": method, "temperature": temperature, "steps": sum(map(len, requests)),
                            "log_loss_method_rate": round(base, 4), "log_loss_minus_method_rate": table,
                            "spread_rule_strength": round(rule, 1)})
            logger.info("%s T=%g: spread rule %.1f; %s", method, temperature, rule, table["lambda=1"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_info(),
                                    "args": vars(args) | {"out": str(args.out)}, "results": results,
                                    "command": "python benchmarks/bench_acceptance_weight.py --out " + str(args.out)},
                                   indent=1))


if __name__ == "__main__":
    main()
