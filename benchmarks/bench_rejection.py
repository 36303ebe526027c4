"""Rejection sampler latency on the jnp (XLA) path, jitted, after warmup.

    .venv/bin/python benchmarks/bench_rejection.py [--reps 7] [--out benchmarks/results/rejection.json]

Times one call of the jit-friendly core (noise generation + verification +
recovered/bonus sampling) for B in {1, 16, 64}, K in {1, 4, 8}, V = 32000,
greedy rows and random rows (temperature 1, one-hot drafts), and prints a
markdown table. ``time_sampler`` is importable for other measurements.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specjax.sample.rejection import rejection_sample_jit  # noqa: E402

BATCHES = (1, 16, 64)
DRAFTS = (1, 4, 8)
VOCAB = 32000


def _inputs(batch: int, num_drafts: int, vocab: int, mode: str, seed: int = 0):
    key = jax.random.key(seed)
    k_logits, k_draft, k_rows = jax.random.split(key, 3)
    logits = jax.random.normal(k_logits, (batch, num_drafts + 1, vocab), jnp.float32) * 3.0  # [B, K+1, V]
    # Half the drafts equal the target argmax so rows stop at varied positions.
    argmax = jnp.argmax(logits[:, :num_drafts], axis=-1).astype(jnp.int32)  # [B, K]
    noise = jax.random.randint(k_draft, (batch, num_drafts), 0, vocab, jnp.int32)
    draft = jnp.where(jnp.arange(num_drafts)[None, :] % 2 == 0, argmax, noise)
    num = jnp.full((batch,), num_drafts, jnp.int32)
    temperature = jnp.full((batch,), 0.0 if mode == "greedy" else 1.0, jnp.float32)
    keys = jax.random.split(k_rows, batch)
    return draft, num, logits, temperature, keys


def time_sampler(batch: int, num_drafts: int, vocab: int = VOCAB, mode: str = "random", *, reps: int = 7,
                 method: str = "standard", use_kernel: bool = False) -> float:
    """Median seconds of one jitted sampler call (after a warmup call) on this backend."""
    if mode not in ("greedy", "random"):
        raise ValueError(f"mode must be 'greedy' or 'random', got {mode!r}")
    draft, num, logits, temperature, keys = _inputs(batch, num_drafts, vocab, mode)

    def call():
        out, acc = rejection_sample_jit(draft, num, logits, None, temperature, None, None, keys,
                                        method=method, use_kernel=use_kernel)
        return jax.block_until_ready((out, acc))

    call()  # compile + warm
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "rejection.json"))
    args = parser.parse_args(argv)
    rows = []
    for mode in ("greedy", "random"):
        for b in BATCHES:
            for k in DRAFTS:
                sec = time_sampler(b, k, VOCAB, mode, reps=args.reps)
                rows.append(dict(mode=mode, batch=b, num_drafts=k, vocab=VOCAB, median_ms=round(sec * 1e3, 3)))
    meta = dict(
        date=datetime.date.today().isoformat(), backend=jax.default_backend(), jax=jax.__version__,
        machine=platform.machine(), cpu_count=os.cpu_count(), path="jnp reference (XLA), jitted, method=standard",
        reps=args.reps, statistic="median",
    )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, results=rows), f, indent=2)
    lines = ["| mode | B | K=1 (ms) | K=4 (ms) | K=8 (ms) |", "|---|---|---|---|---|"]
    for mode in ("greedy", "random"):
        for b in BATCHES:
            cells = [f"{r['median_ms']:.2f}" for r in rows if r["mode"] == mode and r["batch"] == b]
            lines.append(f"| {mode} | {b} | " + " | ".join(cells) + " |")
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
