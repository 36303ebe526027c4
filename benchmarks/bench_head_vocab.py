"""Per-step cost of a draft head's draft step, with the target's vocabulary vs a reduced draft vocabulary.

One draft step is what a chained head runs K-1 times per engine step: one entry through the head's layer
(paged KV, as in the engine) plus the LM head and the greedy pick (``head_greedy_tokens``: argmax over the
draft vocabulary, then d2t). Both configurations share the same layer weights; only the LM head differs
(the target's [D, V] vs the head's own [D, Vd]); ``vdN_scatter`` picks through target-vocabulary logits
(``head_target_logits`` then argmax, -inf outside the draft vocabulary) instead. Timed interleaved (A, B, A, B, ...) after warmup; the
median of ``--reps`` calls of ``--inner`` steps each.

    python benchmarks/bench_head_vocab.py --target builtin:target --draft-vocab 1024 2048
    python benchmarks/bench_head_vocab.py --target /path/to/smollm2_hf --draft-vocab 8192 16384
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from models.heads import FusionHead, HeadConfig, head_embed, head_greedy_tokens, head_target_logits, init_head_params
from models.loading import load_hf_model
from specjax.builtin import resolve_model
from specjax.kv_cache import AttentionMetadata, KVCache


def make_step(hc: HeadConfig, t_config, block: int, scatter: bool = False):
    """``scatter``: pick through target-vocabulary logits (head_target_logits + argmax), the path of an engine
    that does not call head_greedy_tokens."""
    from specjax.sample.transforms import argmax_last

    head = FusionHead(hc)

    @functools.partial(jax.jit, static_argnames=("inner",), donate_argnums=(2, 3))
    def run(hp, tp, k, v, tok, g, pos, tables, *, inner: int):
        def body(i, carry):
            tok, g, k, v = carry
            p = pos + i
            slot = tables[:, :1] * block + p  # [B, 1]: positions stay inside the first block
            x, k, v = head.apply({"params": hp}, head_embed(hp, tp, tok, config=hc), g, p, k, v,
                                 AttentionMetadata(slot_mapping=slot, block_tables=tables), block)
            if scatter:
                tok = argmax_last(head_target_logits(hp, tp, x, config=hc, target_config=t_config))
            else:
                tok = head_greedy_tokens(hp, tp, x, config=hc, target_config=t_config)
            return tok, x, k, v

        tok, g, k, v = jax.lax.fori_loop(0, inner, body, (tok, g, k, v))
        return tok, k, v

    return run


def bench(target_path: str, draft_vocabs: list[int], batches: list[int], reps: int, inner: int, method: str,
          layout: str):
    t_config, t_params = load_hf_model(resolve_model(target_path), "float32")
    rows = []
    for b in batches:
        block = 256
        configs = [("full", None)] + [(f"vd{n}", n) for n in draft_vocabs] + [
            (f"vd{n}_scatter", n) for n in draft_vocabs[:1]]
        runs = {}
        base = None
        for name, vd in configs:
            hc = HeadConfig.for_target(method, t_config, draft_vocab_size=vd, layout=layout)
            hp = init_head_params(hc, jax.random.key(0))
            if base is None:
                base = hp
            hp = {**base, **{k: v for k, v in hp.items() if k in ("lm_head", "d2t")}}  # same layer weights
            if vd is not None:
                hp["d2t"] = jnp.arange(0, t_config.vocab_size, t_config.vocab_size // vd)[:vd].astype(jnp.int32)
            cache = KVCache.allocate(num_layers=1, num_blocks=b, block_size=block,
                                     num_kv_heads=hc.num_key_value_heads, head_dim=hc.head_dim, dtype=jnp.float32)
            tables = jnp.arange(b, dtype=jnp.int32)[:, None]
            args = (jnp.ones((b, 1), jnp.int32), jnp.zeros((b, 1, hc.hidden_size), jnp.float32),
                    jnp.full((b, 1), 100, jnp.int32), tables)
            runs[name] = [make_step(hc, t_config, block, scatter=name.endswith("_scatter")), hp, cache.k[0],
                          cache.v[0], args]
        for name, r in runs.items():  # warmup (compile)
            tok, r[2], r[3] = r[0](r[1], t_params, r[2], r[3], *r[4], inner=inner)
            jax.block_until_ready(tok)
        times = {name: [] for name in runs}
        for _ in range(reps):
            for name, r in runs.items():
                t0 = time.perf_counter()
                tok, r[2], r[3] = r[0](r[1], t_params, r[2], r[3], *r[4], inner=inner)
                jax.block_until_ready(tok)
                times[name].append((time.perf_counter() - t0) / inner)
        full = float(np.median(times["full"]))
        for name, _ in configs:
            med = float(np.median(times[name]))
            rows.append({"batch": b, "config": name, "step_ms": round(1e3 * med, 4),
                         "vs_full": round(med / full, 3)})
            print(f"batch {b:3d} {name:>8s}: {1e3 * med:8.3f} ms/step  ({med / full:.2f}x full vocab)")
    return {"target": target_path, "vocab_size": t_config.vocab_size, "hidden_size": t_config.hidden_size,
            "method": method, "layout": layout, "reps": reps, "inner": inner, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="builtin:target")
    p.add_argument("--method", default="eagle3", choices=["eagle", "eagle3", "mtp"])
    p.add_argument("--layout", default="eagle3", choices=["specjax", "eagle1", "eagle3"])
    p.add_argument("--draft-vocab", type=int, nargs="+", default=[1024])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--inner", type=int, default=20)
    p.add_argument("--out", default=None, help="append the result to this JSON file (a list)")
    args = p.parse_args()
    res = bench(args.target, args.draft_vocab, args.batch, args.reps, args.inner, args.method, args.layout)
    res["date"] = datetime.date.today().isoformat()
    res["command"] = "python benchmarks/bench_head_vocab.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items() if v is not None and k != "out")
    if args.out:
        out = Path(args.out)
        prev = json.loads(out.read_text()) if out.is_file() else []
        out.write_text(json.dumps(prev + [res], indent=2) + "\n")


if __name__ == "__main__":
    main()
