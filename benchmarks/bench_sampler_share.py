"""The rejection sampler's share of one verify step (target forward over K+1 tokens + sampling).

Times the engine's own compiled pieces side by side: ``verify_forward`` of a
~35M-parameter random Llama with V = 32000 over [B, K+1] tokens, and
the sampler the engine runs on its logits: ``greedy_verify_reference`` when
every row is greedy, ``verify_sample`` (the jnp rejection sampler) otherwise. Median of --reps after warmup.

    python benchmarks/bench_sampler_share.py --out benchmarks/results/sampler_share.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from models.llama import LlamaConfig, init_params, num_params
from pallas_kernels.rejection import greedy_verify_reference
from specjax.engine import StepInputs, row_keys
from specjax.kv_cache import KVCache
from specjax.spec_decode.verify import verify_forward, verify_sample


def _median_time(fn, reps):
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--context", type=int, default=64, help="tokens already in each row's KV")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                         num_attention_heads=6, num_key_value_heads=6, head_dim=64, max_position_embeddings=1024)
    params = init_params(config, jax.random.key(0))
    block, blocks_per_row = 16, (args.context + max(args.ks) + 1 + 15) // 16
    rows = []
    print(f"target: {num_params(params) / 1e6:.1f}M params, V={args.vocab}")
    for b in args.batches:
        cache = KVCache.allocate(num_layers=6, num_blocks=b * blocks_per_row, block_size=block, num_kv_heads=6,
                                 head_dim=64, dtype=jnp.float32)
        for k in args.ks:
            inputs = StepInputs.zeros(b, 1, blocks_per_row)
            inputs.block_tables[:] = np.arange(b * blocks_per_row).reshape(b, blocks_per_row)
            inputs.positions[:, 0] = args.context
            inputs.slot_mapping[:, 0] = inputs.block_tables[:, args.context // block] * block + args.context % block
            rng = np.random.default_rng(k)
            drafts = jnp.asarray(rng.integers(0, args.vocab, (b, k)), jnp.int32)
            num = jnp.full((b,), k, jnp.int32)
            fwd = jax.jit(functools.partial(verify_forward, config=config), donate_argnums=(1,))
            state = {"cache": cache}

            def run_forward():
                logits, _, state["cache"] = fwd(params, state["cache"], inputs.tokens, inputs.positions,
                                             inputs.slot_mapping, inputs.block_tables, inputs.last_index, drafts, num)
                return logits

            t_fwd = _median_time(run_forward, args.reps)
            logits = run_forward()
            cache = state["cache"]
            keys = row_keys(jnp.zeros(b, jnp.uint32), jnp.arange(b, dtype=jnp.uint32), jnp.zeros(b, jnp.int32))
            sample = jax.jit(functools.partial(verify_sample, method="standard"))
            greedy = jax.jit(greedy_verify_reference)  # what the engine runs when every row is greedy
            for mode, temp in (("greedy", 0.0), ("random", 1.0)):
                temperature = jnp.full((b,), temp, jnp.float32)
                if mode == "greedy":
                    t_sample = _median_time(lambda: greedy(drafts, num, logits), args.reps)
                else:
                    t_sample = _median_time(lambda: sample(logits, drafts, num, None, temperature,
                                                           jnp.zeros(b, jnp.int32), jnp.ones(b), keys, None), args.reps)
                row = {"batch": b, "k": k, "mode": mode, "forward_ms": t_fwd * 1e3, "sample_ms": t_sample * 1e3,
                       "sampler_share": t_sample / (t_fwd + t_sample)}
                rows.append(row)
                print(f"B={b:3d} K={k} {mode:6s} forward {row['forward_ms']:8.2f} ms  sampler {row['sample_ms']:7.2f} ms"
                      f"  share {100 * row['sampler_share']:5.1f}%", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": "2-core x86_64 CPU",
                                        "params": num_params(params), "config": {k: v for k, v in vars(args).items()
                                                                                  if k != "out"}, "rows": rows},
                                       indent=2))


if __name__ == "__main__":
    main()
