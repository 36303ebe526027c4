"""What sampling costs inside the engine's one compiled speculative step.

Builds the engine's ``StepRunner`` (the fused propose -> verify -> sample -> update executable of each
bucket) around a random Llama (~35M params without the vocabulary; V = --vocab) with host-side drafts, fills
each row of a decode bucket [B, 1 + K drafts] as a real step would (a context of --context tokens, K
drafts to verify), and times the whole step, fetch included, per sampling mode:

* ``greedy``: every row temperature 0 (argmax verification);
* ``random``: temperature 1.0 (the rejection sampler);
* ``random+filters``: temperature 0.8, top-k 50, top-p 0.95, min-p 0.05 (one sort shared by the filters);
* ``random+processors``: the filters plus presence / frequency / repetition penalties, 8 logit-bias
  entries and a min_tokens floor (the logits processors of ``specjax.sample.processors``);
* ``greedy+logprobs``: greedy rows that return 20 top log-probabilities.

The sampler's cost is reported as the step-time increase over ``greedy`` (the same executable; the
modes switch run-time branches), and as a share of the mode's step. All modes of one bucket are
interleaved round by round, so machine load hits them alike; figures are medians over --reps rounds.

    python benchmarks/bench_sampler_share.py --out benchmarks/results/sampler_share.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from models.llama import LlamaConfig, init_params, num_params
from specjax.config import EngineConfig
from specjax.runner import StepRunner
from specjax.parallel.sharding import ShardingPlan, make_mesh
from specjax.spec_decode.proposer import Proposer

MODES = {
    "greedy": dict(temperature=0.0),
    "random": dict(temperature=1.0),
    "random+filters": dict(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05),
    "random+processors": dict(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05, presence_penalty=0.5,
                              frequency_penalty=0.3, repetition_penalty=1.2, bias=8, min_tokens=1000),
    "greedy+logprobs": dict(temperature=0.0, num_logprobs=20),
}


def fill(batch, rows: int, k: int, context: int, block: int, vocab: int, mode: dict, rng) -> None:
    """One decode step per row: the last committed token at position ``context`` plus k drafts."""
    blocks = batch.block_tables.shape[1]
    batch.block_tables[:] = np.arange(rows * blocks).reshape(rows, blocks)
    batch.tokens[:, 0] = rng.integers(0, vocab, rows)
    batch.positions[:, 0] = context
    batch.slot_mapping[:, 0] = batch.block_tables[:, context // block] * block + context % block
    batch.last_index[:] = 0
    batch.slots[:] = np.arange(rows)
    batch.num_drafts[:] = k
    batch.host_drafts[:] = rng.integers(0, vocab, (rows, k))
    batch.prev_token[:] = -1
    batch.seeds[:] = np.arange(rows)
    batch.sample_indices[:] = context
    batch.prompt_len[:] = context
    batch.temperature[:] = mode["temperature"]
    batch.top_k[:] = mode.get("top_k", 0)
    batch.top_p[:] = mode.get("top_p", 1.0)
    batch.min_p[:] = mode.get("min_p", 0.0)
    batch.presence_penalty[:] = mode.get("presence_penalty", 0.0)
    batch.frequency_penalty[:] = mode.get("frequency_penalty", 0.0)
    batch.repetition_penalty[:] = mode.get("repetition_penalty", 1.0)
    n_bias = mode.get("bias", 0)
    batch.bias_ids[:, :n_bias] = rng.integers(0, vocab, (rows, n_bias))
    batch.bias_values[:, :n_bias] = 2.0
    batch.min_tokens[:] = mode.get("min_tokens", 0)
    batch.stop_ids[:, 0] = 2 if mode.get("min_tokens") else -1
    batch.num_logprobs[:] = mode.get("num_logprobs", -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--ks", type=int, nargs="+", default=[4])
    ap.add_argument("--vocabs", type=int, nargs="+", default=[32000, 49152])
    ap.add_argument("--context", type=int, default=64, help="tokens already in each row's KV")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--inner", type=int, default=3, help="back-to-back steps per sample")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    block = 16
    max_len = args.context + max(args.ks) + 2 + block
    results = []
    for vocab in args.vocabs:
        config = LlamaConfig(vocab_size=vocab, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                             num_attention_heads=6, num_key_value_heads=6, head_dim=64, max_position_embeddings=1024)
        params = init_params(config, jax.random.key(0))
        print(f"V={vocab}: {num_params(params) / 1e6:.1f}M params", flush=True)
        engine_config = EngineConfig(max_model_len=max_len, max_num_seqs=max(args.batches), block_size=block,
                                     batch_buckets=tuple(sorted(set(args.batches))))
        runner = StepRunner(config, params, Proposer(), engine_config, spec=None, kv_dtype=jnp.float32,
                            plan=ShardingPlan(mesh=make_mesh(), tp=1))
        for b in args.batches:
            for k in args.ks:
                bucket = (b, 1, k)
                runner.executables.compile_all([bucket], workers=1)
                rng = np.random.default_rng(b * 100 + k)
                samples = {name: [] for name in MODES}
                for rep in range(args.reps + 1):  # round 0 warms every mode's branches
                    for name, mode in MODES.items():
                        batch = runner.host_batch(bucket)
                        fill(batch, b, k, args.context, block, vocab, mode, rng)
                        start = time.perf_counter()
                        for _ in range(args.inner):
                            runner.run(batch)
                        if rep:
                            samples[name].append((time.perf_counter() - start) / args.inner)
                base = statistics.median(samples["greedy"])
                for name in MODES:
                    t = statistics.median(samples[name])
                    row = {"vocab": vocab, "batch": b, "k": k, "mode": name, "step_ms": 1e3 * t,
                           "over_greedy_ms": 1e3 * (t - base), "sampler_share": max(t - base, 0.0) / t}
                    results.append(row)
                    print(f"V={vocab} B={b:2d} K={k} {name:18s} step {row['step_ms']:8.2f} ms  "
                          f"+{row['over_greedy_ms']:6.2f} ms over greedy  share {100 * row['sampler_share']:5.1f}%",
                          flush=True)
        del runner
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} CPU, 2 cores",
            "command": "python benchmarks/bench_sampler_share.py " + " ".join(
                f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                for k, v in vars(args).items() if k != "out" and v is not None),
            "modes": MODES, "rows": results}, indent=2))


if __name__ == "__main__":
    main()
