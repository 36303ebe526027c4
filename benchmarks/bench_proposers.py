"""Host proposer cost: ``propose()`` for a batch of 32 rows at 1k / 4k-token contexts.

Two kinds of text: "random" (Zipf-distributed ids over a 32k vocabulary, little exact
repetition) and "repetitive" (spans copied from earlier in the sequence with small edits,
like code or document rewriting). Each step every row commits 1..K+1 new tokens (as
after verification) and ``propose`` runs once for the batch; the figure is the median
step time. For the suffix proposer the first call (building the 32 per-request trees)
and ``finish()`` (insert one 512-token output into a global tree at its capacity, with
eviction) are reported separately. ``ngram-kmp`` is vLLM's algorithm (prefix function over
the reversed sequence, a Python loop per token), kept here as the baseline the numpy
implementation replaces.

    python benchmarks/bench_proposers.py --out benchmarks/results/proposers.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from specjax.spec_decode.ngram import NgramProposer
from specjax.spec_decode.suffix import SuffixProposer

VOCAB = 32_000


def make_text(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "random":
        return (rng.zipf(1.3, size=n) % VOCAB).astype(np.int32)
    out = list((rng.zipf(1.3, size=64) % VOCAB).tolist())
    while len(out) < n:
        if rng.random() < 0.3:  # fresh material
            out.extend((rng.zipf(1.3, size=int(rng.integers(5, 40))) % VOCAB).tolist())
        else:  # copy an earlier span, with a few edits
            length = int(rng.integers(20, 120))
            start = int(rng.integers(0, max(1, len(out) - length)))
            span = out[start : start + length]
            for _ in range(int(rng.integers(0, 3))):
                span[int(rng.integers(0, len(span)))] = int(rng.integers(0, VOCAB))
            out.extend(span)
    return np.asarray(out[:n], dtype=np.int32)


def kmp_ngram_reference(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """vLLM V1's prefix-function search, as plain Python (the baseline)."""
    total = len(tokens)
    if total < min_n:
        return tokens[:0]
    rev = tokens[::-1].tolist()
    lps = [0] * max_n
    longest = position = prev = 0
    i = 1
    while i < total:
        if rev[prev] == rev[i]:
            prev += 1
            if prev >= longest:
                longest, position = prev, i
            if i < max_n:
                lps[i] = prev
            if prev == max_n:
                prev = lps[max_n - 1]
            i += 1
        elif prev != 0:
            prev = lps[prev - 1]
        else:
            i += 1
    if longest < min_n:
        return tokens[:0]
    start = total - 1 - position + longest
    return tokens[start : start + k]


class _KmpProposer:
    def __init__(self, lo: int, hi: int, k: int) -> None:
        self.lo, self.hi, self.k = lo, hi, k

    def propose(self, request_ids, token_ids, max_drafts):
        return [kmp_ngram_reference(t, self.lo, self.hi, min(self.k, m)) for t, m in zip(token_ids, max_drafts)]


def run_steps(prop, streams: list[np.ndarray], ctx: int, k: int, steps: int, rng) -> dict:
    """Time ``steps`` batched propose() calls as every row grows by 1..k+1 tokens a step."""
    lens = [ctx] * len(streams)
    ids = [f"r{i}" for i in range(len(streams))]
    t0 = time.perf_counter()
    drafts = prop.propose(ids, [s[:n] for s, n in zip(streams, lens)], [k] * len(streams))
    first = time.perf_counter() - t0
    times, n_drafted = [], []
    for _ in range(steps):
        lens = [n + int(rng.integers(1, k + 2)) for n in lens]
        batch = [s[:n] for s, n in zip(streams, lens)]
        t0 = time.perf_counter()
        drafts = prop.propose(ids, batch, [k] * len(streams))
        times.append(time.perf_counter() - t0)
        n_drafted.append(np.mean([len(d) for d in drafts]))
    med = statistics.median(times)
    return {
        "first_call_ms": first * 1e3,
        "step_ms": med * 1e3,
        "per_row_us": med / len(streams) * 1e6,
        "mean_drafts_per_row": float(np.mean(n_drafted)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--global-outputs", type=int, default=1000, help="finished outputs cached in the global tree")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    k = args.k
    rows = []
    for kind in ("random", "repetitive"):
        # One pool of outputs per text kind for the global tree (same style as the prompts).
        outputs = [make_text(kind, 512, rng).tolist() for _ in range(args.global_outputs)]
        t0 = time.perf_counter()
        warm_suffix = SuffixProposer(num_speculative_tokens=k, max_cached_requests=args.global_outputs)
        for i, o in enumerate(outputs):
            warm_suffix.finish(f"old{i}", [], o)
        fill_s = time.perf_counter() - t0
        extra = [make_text(kind, 512, rng).tolist() for _ in range(20)]
        t0 = time.perf_counter()
        for i, o in enumerate(extra):  # at capacity: each insert also evicts one
            warm_suffix.finish(f"extra{i}", [], o)
        finish_ms = (time.perf_counter() - t0) / len(extra) * 1e3
        print(f"[{kind}] global tree: {args.global_outputs} x 512-token outputs inserted in {fill_s:.1f} s; "
              f"finish() at capacity {finish_ms:.2f} ms")
        for ctx in args.contexts:
            streams = [make_text(kind, ctx + args.steps * (k + 1) + 1, rng) for _ in range(args.batch)]
            proposers = {
                "ngram(2..5)": NgramProposer(prompt_lookup_min=2, prompt_lookup_max=5, num_speculative_tokens=k),
                "ngram-kmp(2..5)": _KmpProposer(2, 5, k),
                "suffix(no global)": SuffixProposer(num_speculative_tokens=k),
                f"suffix(+{args.global_outputs} outputs)": warm_suffix,
            }
            for name, prop in proposers.items():
                res = run_steps(prop, streams, ctx, k, args.steps, np.random.default_rng(1))
                if isinstance(prop, SuffixProposer):
                    for i in range(args.batch):
                        prop._requests.pop(f"r{i}", None)  # drop per-request state; keep the global tree
                row = {"text": kind, "context": ctx, "batch": args.batch, "k": k, "proposer": name, **res}
                if name.startswith("suffix(+"):
                    row["finish_ms"] = finish_ms
                rows.append(row)

    hdr = f"{'text':<11}{'ctx':>6}  {'proposer':<24}{'step ms':>9}{'us/row':>9}{'first call ms':>15}{'drafts/row':>12}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['text']:<11}{r['context']:>6}  {r['proposer']:<24}{r['step_ms']:>9.2f}{r['per_row_us']:>9.1f}"
              f"{r['first_call_ms']:>15.1f}{r['mean_drafts_per_row']:>12.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"python": platform.python_version(), "machine": platform.machine(),
                "processor": platform.processor(), "numpy": np.__version__, "steps": args.steps}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
