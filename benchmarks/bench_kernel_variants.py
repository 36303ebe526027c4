"""Variants of the CPU kernels (panel matmul, paged attention) against the built ones, in one process (issue 14).

Separate processes differ by several percent in the same step (the 1-token SmolLM2 step ranged 29.2-35.1 ms
across eight processes of one kernel, 2026-12-05), which hid effects of that size. Here each variant (the kernels'
sources in ``models/cpu_kernels`` with text replaced, see ``VARIANTS``) is compiled as its own library and
registered under its own XLA targets, so the same process compiles the model's step (the CPU layout,
``bench_verify_cost.make_step``) once per variant and per query length T, and times them in interleaved
rounds (every other round reversed), 3 calls per round after one untimed. Reported per variant: the median
step time at T = 1 and T = K + 1, their ratio, and the median over rounds of each round's time relative to
the built kernels'.

    python benchmarks/bench_kernel_variants.py --variants plain_prefetch_2k --model smollm2 --rounds 15
    python benchmarks/bench_kernel_variants.py --variants tasks_of_16_panels --model smollm2 --layout blocks --batch 8

With ``--engine shipped`` or ``--engine smollm2`` it times whole engine steps instead: ``specjax.LLM`` systems
(the shipped target plain, with draft_model and with its EAGLE-3 head; or SmolLM2 with its EAGLE-3 head) built once
per variant, each compiled while the kernels' target names point at that variant, and each step kind
(``StepRunner.time_step``: an all-padding batch-1 step, fixed K = 4 systems) timed in interleaved rounds.

    python benchmarks/bench_kernel_variants.py --variants generic_bf16_widening --engine shipped --rounds 15

The built kernels are what ``models/cpu_kernels/build.py`` builds from the sources as they stand. The variant
``separate_layers`` is the same kernels with each decoder layer traced as separate operations (``SWITCHES``), against
the fused layer (``models/cpu_kernels/decoder_layer.cc``):

    python benchmarks/bench_kernel_variants.py --variants separate_layers --engine shipped --rounds 15
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_verify_cost as bv  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench_builtin import machine_info  # noqa: E402
from models import llama  # noqa: E402
from models.cpu_kernels import build  # noqa: E402
from specjax.kv_cache import KVCache  # noqa: E402

_PREFETCH = "__builtin_prefetch(rec + kAhead + b, 0, kLocality);"
_PLAIN, _NTA = "__builtin_prefetch(rec + kAhead + b);", "__builtin_prefetch(rec + kAhead + b, 0, 0);"
_SPLITS = "  const int64_t splits = (s.T + kQueryTokens - 1) / kQueryTokens;"
_RANGE = "    const int64_t t0 = split * kQueryTokens, t1 = std::min(s.T, t0 + kQueryTokens);"
# (The ninth session's x_transposed / x_grouped variants, not adopted, edited the kernel as it stood at db5803e;
# they went when its tile became generic over weight formats. benchmarks/README.md keeps their results.)
VARIANTS = {  # name -> [(source file, its text, replacement)]
    # The panel kernel before 2026-12-05 (a plain prefetch 2 KiB ahead).
    "plain_prefetch_2k": [("panels.h", _PREFETCH, _PLAIN),
                          ("panels.h", "kPrefetchBytes = 4096;", "kPrefetchBytes = 2048;")],
    "plain_prefetch_4k": [("panels.h", _PREFETCH, _PLAIN)],
    # The non-temporal prefetch the kernel takes on AMD Zen (kPrefetchLocality), at 2, 4 and 8 KiB.
    "nta_prefetch_2k": [("panels.h", _PREFETCH, _NTA),
                        ("panels.h", "kPrefetchBytes = 4096;", "kPrefetchBytes = 2048;")],
    "nta_prefetch_4k": [("panels.h", _PREFETCH, _NTA)],
    "nta_prefetch_8k": [("panels.h", _PREFETCH, _NTA),
                        ("panels.h", "kPrefetchBytes = 4096;", "kPrefetchBytes = 8192;")],
    # Every call's prefetch into the L2 only (prefetcht1), 4, 8 or 16 KiB ahead; a plain one 8 KiB ahead; none.
    "l2_prefetch_4k": [("panels.h", _PREFETCH, "__builtin_prefetch(rec + 4096 + b, 0, 2);")],
    "l2_prefetch_8k": [("panels.h", _PREFETCH, "__builtin_prefetch(rec + 8192 + b, 0, 2);")],
    "l2_prefetch_16k": [("panels.h", _PREFETCH, "__builtin_prefetch(rec + 16384 + b, 0, 2);")],
    "plain_prefetch_8k": [("panels.h", _PREFETCH, "__builtin_prefetch(rec + 8192 + b);")],
    "no_prefetch": [("panels.h", _PREFETCH, "(void)b;")],
    # The kernel before 2026-12-07: a model's weights beyond the last-level cache prefetched as any other's.
    "stream_as_cached": [("panels.h", "    if (stream && M > 1)\n", "    if (false)\n")],
    "tasks_of_16_panels": [("panels.h", "constexpr int64_t kChunk = 64 / kPanel > 0 ? 64 / kPanel : 1;",
                            "constexpr int64_t kChunk = 16;")],
    # Attention: with fewer (row, kv head) tasks than twice the threads (batch 1: 3 kv heads on 2 threads),
    # split the query tokens evenly over one task each, so a verify's tokens spread over the threads.
    "attention_token_tasks": [
        ("attention.h", _SPLITS,
         "  const int64_t splits = s.B * s.G < 2 * pool.num_threads() ? s.T : (s.T + kQueryTokens - 1) / kQueryTokens;"),
        ("attention.h", _RANGE,
         "    const int64_t t0 = split * s.T / splits, t1 = std::min(s.T, (split + 1) * s.T / splits);")],
    # The same with as few splits as make twice as many tasks as threads (batch 1, 3 kv heads: 2 splits).
    "attention_two_tasks_per_thread": [
        ("attention.h", _SPLITS,
         "  const int64_t want = (2 * pool.num_threads() + s.B * s.G - 1) / (s.B * s.G);\n"
         "  const int64_t splits = want > 1 ? std::min<int64_t>(s.T, want) : (s.T + kQueryTokens - 1) / kQueryTokens;"),
        ("attention.h", _RANGE,
         "    const int64_t t0 = split * s.T / splits, t1 = std::min(s.T, (split + 1) * s.T / splits);")],
    # bfloat16 weights widened by GCC's generic vector conversion, as before 2026-12-06 (with AVX-512 it made two
    # half-width widenings and three shuffles per vector; common.h now uses vpmovzxwd).
    "generic_bf16_widening": [
        ("common.h", "#if defined(__AVX512F__)\n  return (fvec)_mm512_slli", "#if 0\n  return (fvec)_mm512_slli"),
        ("common.h", "#elif defined(__AVX2__)\n  return (fvec)_mm256_slli", "#elif 0\n  return (fvec)_mm256_slli")],
    # Byte dot products (int8 activations) on AVX2 without VNNI in generic vector code, as before 2026-12-07 (four
    # shifts, masks, 32-bit multiplies and adds per row and weight word; common.h now uses vpmaddubsw / vpmaddwd).
    "generic_byte_dots": [("common.h", "#define SPECJAX_AVX2_BYTE_DOTS 1\n", "#define SPECJAX_AVX2_BYTE_DOTS 0\n")],
    # The same kernels with every layer as separate operations (models.llama.FUSE_CPU_LAYERS off, below).
    "separate_layers": [],
}


_TARGET_NAMES = ("TARGET", "ATTENTION_TARGET", "ROWS_TARGET", "LAYER_TARGET")
"""``build``'s attributes naming the kernels' XLA targets, in ``build._SYMBOLS`` order."""


def _built_targets() -> tuple[str, ...]:
    return tuple(getattr(build, name) for name in _TARGET_NAMES)


SWITCHES = {"separate_layers": {"FUSE_CPU_LAYERS": False}}
"""Variant -> ``models.llama`` attributes set while its steps are traced."""


@contextlib.contextmanager
def _tracing_for(variant: str, targets: tuple[str, ...]):
    """While traced inside, the kernels' calls name ``targets`` (in ``_TARGET_NAMES`` order) and the variant's
    ``SWITCHES`` hold."""
    saved = _built_targets(), {name: getattr(llama, name) for name in SWITCHES.get(variant, {})}
    try:
        for name, target in zip(_TARGET_NAMES, targets, strict=True):
            setattr(build, name, target)
        for name, value in SWITCHES.get(variant, {}).items():
            setattr(llama, name, value)
        yield
    finally:
        for name, target in zip(_TARGET_NAMES, saved[0]):
            setattr(build, name, target)
        for name, value in saved[1].items():
            setattr(llama, name, value)


def build_variant(name: str, workdir: Path) -> tuple[str, ...]:
    """Compile the kernels' sources (and header) with ``name``'s replacements as their own library and register
    its targets under ``<target>_<name>``; those names, in ``build._SYMBOLS`` order (panel matmul, attention,
    panel rows, decoder layer)."""
    sources = {path.name: path.read_text() for path in build.SOURCES + build.HEADERS}
    for file, old, new in VARIANTS[name]:
        if old not in sources[file]:
            raise SystemExit(f"variant {name}: {old!r} is not in {file} any more")
        sources[file] = sources[file].replace(old, new)
    (workdir / name).mkdir()
    paths = []
    for file, text in sources.items():  # a directory of its own: the sources' #include "common.h" finds its header
        (workdir / name / file).write_text(text)
        if file.endswith(".cc"):
            paths.append(workdir / name / file)
    so = workdir / f"{name}.so"
    cxx = build._compiler()
    if cxx is None:
        raise SystemExit("no C++ compiler")
    try:
        build._build(cxx, so, tuple(paths))
    except RuntimeError as e:
        raise SystemExit(f"variant {name} did not build: {e}") from None
    lib = ctypes.CDLL(str(so))
    targets = []
    for target, symbol in build._SYMBOLS.items():
        targets.append(f"{target}_{name}")
        jax.ffi.register_ffi_target(targets[-1], jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return tuple(targets)


ENGINE_SYSTEMS = {  # --engine -> (target, max_model_len, {system: (speculative_config or None, step kinds)})
    "shipped": ("builtin:target", 136, {
        "plain": (None, [(0, True)]),
        "draft_model": ({"method": "draft_model", "model": "builtin:draft"}, [(0, True), (1, False), (2, False),
                                                                            (4, False)]),
        "eagle3": ({"method": "eagle3", "model": "builtin:eagle3"}, [(1, False), (2, False), (4, False)])}),
    "smollm2": ("builtin:smollm2", 256, {
        "smollm2_eagle3": ({"method": "eagle3", "model": "builtin:smollm2_eagle3"},
                           [(0, True), (1, False), (2, False), (4, False)])}),
}
"""A step kind is (K, detached): K drafts a row (a chained head drafting K ahead), or the target alone."""


def engine_steps(args, targets: dict) -> dict:
    """``--engine``: each system built per variant (its steps compiled while the kernels' target names point at
    that variant), then every step kind timed in interleaved rounds (every other round reversed)."""
    import specjax

    model, max_len, systems = ENGINE_SYSTEMS[args.engine]
    kw = dict(max_model_len=max_len, max_num_seqs=1, batch_buckets=[1], query_buckets=(1, 64), max_prefill_chunk=64,
              seed=0)
    llms = {}
    for variant, names in targets.items():
        with _tracing_for(variant, names):
            for system, (spec, _) in systems.items():
                extra = {} if spec is None else {"speculative_config": {**spec, "num_speculative_tokens": 4,
                                                                        "adaptive": False}}
                llms[variant, system] = specjax.LLM(model, **kw, **extra)
                runner = llms[variant, system].engine.runner
                plain = runner.executables if runner.detached_executables is None else runner.detached_executables
                text = plain.get((1, 1, 0)).as_text()
                if f'"{names[0]}"' not in text or (not llama.FUSE_CPU_LAYERS and f'"{names[3]}"' in text):
                    raise SystemExit(f"{variant}: {system}'s step does not call {names[0]}, or calls {names[3]}")
    names = list(targets)
    times = {(v, s, kind): [] for v in names for s, (_, kinds) in systems.items() for kind in kinds}
    repeats = 10 if args.engine == "shipped" else 4
    for r in range(args.rounds):
        for system, (_, kinds) in systems.items():
            for k, detached in kinds:
                for variant in names if r % 2 == 0 else names[::-1]:
                    runner = llms[variant, system].engine.runner
                    times[variant, system, (k, detached)].append(
                        runner.time_step((1, 1, k), detached, repeats=repeats, draft_ahead=k) * 1e3)
    rows = {}
    for system, (_, kinds) in systems.items():
        for kind in kinds:
            label = f"{system} {'detached' if kind[1] else f'K={kind[0]}'}"
            built = times["built", system, kind]
            for variant in names:
                mine = times[variant, system, kind]
                rel = statistics.median(a / b for a, b in zip(mine, built))
                rows[f"{label} {variant}"] = {"ms": statistics.median(mine), "vs_built": rel, "times_ms": mine}
                print(f"{label:28s} {variant:22s} {statistics.median(mine):7.3f} ms  vs built (paired) {rel:.3f}")
    return rows


def forward_steps(args, targets: dict) -> dict:
    """The model's forward (``bench_verify_cost.make_step``) at T = 1 and T = K + 1, compiled per variant."""
    config, params, _ = bv.load(args.model)
    params = bv.layouts_of(args.model, config, params)[args.layout]
    width = -(-(args.context + args.k + 1) // bv.BLOCK_SIZE)
    kv = KVCache.allocate(num_layers=config.num_hidden_layers, num_blocks=args.batch * width,
                          block_size=bv.BLOCK_SIZE, num_kv_heads=config.num_key_value_heads,
                          head_dim=config.head_dim, dtype=jnp.float32)
    ts = (1, args.k + 1)
    exes = {}
    for name, names in targets.items():
        matmul, attention, _, layer = names
        with _tracing_for(name, names):
            for t in ts:
                inputs = bv.step_inputs(args.batch, t, args.context, width)
                exe = bv.compile_exe(bv.make_step(config, t), (params, kv, *inputs))
                text = exe.as_text()
                if f'"{matmul}"' not in text or (f'"{attention}"' not in text and f'"{layer}"' not in text):
                    raise SystemExit(f"{name}: the step does not call {matmul} and {attention} or {layer}")
                if not llama.FUSE_CPU_LAYERS and f'"{layer}"' in text:
                    raise SystemExit(f"{name}: the step calls {layer}")
                exes[(name, t)] = (exe, inputs)
    state = {"kv": kv}

    def call(key) -> None:
        exe, inputs = exes[key]
        logits, state["kv"] = exe(params, state["kv"], *inputs)
        jax.block_until_ready(logits)

    keys = list(exes)
    times = {key: [] for key in keys}
    for r in range(args.rounds):
        for key in keys if r % 2 == 0 else keys[::-1]:
            call(key)
            start = time.perf_counter()
            for _ in range(3):
                call(key)
            times[key].append((time.perf_counter() - start) / 3 * 1e3)
    rows = {}
    for name in targets:
        one, many = (statistics.median(times[(name, t)]) for t in ts)
        rel = [statistics.median(a / b for a, b in zip(times[(name, t)], times[("built", t)])) for t in ts]
        rows[name] = {"t1_ms": one, "tk_ms": many, "ratio": many / one, "t1_vs_built": rel[0],
                      "tk_vs_built": rel[1], "t1_times_ms": times[(name, 1)], "tk_times_ms": times[(name, ts[1])]}
        print(f"{name:20s} T=1 {one:7.2f} ms  T={ts[1]} {many:7.2f} ms  ratio {many / one:.3f}  "
              f"vs built (paired): T=1 {rel[0]:.3f}  T={ts[1]} {rel[1]:.3f}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), required=True)
    ap.add_argument("--model", default="smollm2", help="as bench_verify_cost.py's --models")
    ap.add_argument("--layout", default="after", choices=["after", "blocks", "int8"],
                    help="bench_verify_cost.py's layouts: float panels, or (smollm2) the GGUF file's blocks, with "
                         "float or (int8) int8 activations")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--k", type=int, default=4, help="the verify step has K + 1 query tokens per row")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--engine", choices=list(ENGINE_SYSTEMS),
                    help="time whole engine steps of these systems instead of --model's forward")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if build.load() is None:
        raise SystemExit("the CPU kernels are unavailable here")
    targets = {"built": _built_targets()}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants:
            targets[name] = build_variant(name, Path(tmp))
        if args.engine:
            rows = engine_steps(args, targets)
        else:
            rows = forward_steps(args, targets)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        out = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_info(),
               "args": {k: str(v) for k, v in vars(args).items()}, "command": " ".join(["python"] + sys.argv),
               "results": rows}
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
