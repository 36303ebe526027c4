"""Variants of the panel-matmul kernel against the built one, in one process (issue 14).

Separate processes differ by several percent in the same step (the 1-token SmolLM2 step ranged 29.2-35.1 ms
across eight processes of one kernel, 2026-12-05), which hid effects of that size. Here each variant of
``models/cpu_kernels/panel_matmul.cc`` (the source with text replaced, see ``VARIANTS``) is compiled as its
own library and registered under its own XLA target, so the same process compiles the model's step (the
CPU layout, ``bench_verify_cost.make_step``) once per variant and per query length T, and times them in
interleaved rounds (every other round reversed), 3 calls per round after one untimed. Reported per variant:
the median step time at T = 1 and T = K + 1, their ratio, and the median over rounds of each round's time
relative to the built kernel's.

    python benchmarks/bench_kernel_variants.py --variants plain_prefetch_2k --model smollm2 --rounds 15

The built kernel is what ``models/cpu_kernels/build.py`` builds from the source as it stands.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
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
from models.cpu_kernels import build  # noqa: E402
from specjax.kv_cache import KVCache  # noqa: E402

_PREFETCH = "__builtin_prefetch(ahead + b, 0, 0);"
VARIANTS = {  # name -> [(text in panel_matmul.cc, replacement)]
    # What the kernel did before 2026-12-05 (a plain prefetch 2 KiB ahead).
    "plain_prefetch_2k": [(_PREFETCH, "__builtin_prefetch(ahead + b);"),
                          ("kPrefetchBytes = 4096;", "kPrefetchBytes = 2048;")],
    "plain_prefetch_4k": [(_PREFETCH, "__builtin_prefetch(ahead + b);")],
    "nta_prefetch_2k": [("kPrefetchBytes = 4096;", "kPrefetchBytes = 2048;")],
    "nta_prefetch_8k": [("kPrefetchBytes = 4096;", "kPrefetchBytes = 8192;")],
    "tasks_of_16_panels": [("constexpr int64_t kChunk = 64 / kPanel > 0 ? 64 / kPanel : 1;",
                            "constexpr int64_t kChunk = 16;")],
}


def build_variant(name: str, workdir: Path) -> str:
    """Compile ``name``'s source as its own library, register it; its XLA target name."""
    src = (build.HERE / "panel_matmul.cc").read_text()
    for old, new in VARIANTS[name]:
        if old not in src:
            raise SystemExit(f"variant {name}: {old!r} is not in panel_matmul.cc any more")
        src = src.replace(old, new)
    cc, so = workdir / f"{name}.cc", workdir / f"{name}.so"
    cc.write_text(src)
    cxx = build._compiler()
    if cxx is None:
        raise SystemExit("no C++ compiler")
    done = subprocess.run([cxx, *build.FLAGS, f"-I{jax.ffi.include_dir()}", f"-I{build.HERE}", str(cc),
                           str(build.HERE / "paged_attention.cc"), "-o", str(so)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"variant {name} did not build:\n{done.stderr}")
    lib = ctypes.CDLL(str(so))
    target = f"{build.TARGET}_{name}"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(lib.SpecjaxPanelMatmul), platform="cpu")
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), required=True)
    ap.add_argument("--model", default="smollm2", help="as bench_verify_cost.py's --models")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--k", type=int, default=4, help="the verify step has K + 1 query tokens per row")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if build.load() is None:
        raise SystemExit("the CPU kernels are unavailable here")
    base_target = build.TARGET
    targets = {"built": base_target}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants:
            targets[name] = build_variant(name, Path(tmp))
        config, params, _ = bv.load(args.model)
        params = bv.to_cpu_layout(params, config)
        width = -(-(args.context + args.k + 1) // bv.BLOCK_SIZE)
        kv = KVCache.allocate(num_layers=config.num_hidden_layers, num_blocks=args.batch * width,
                              block_size=bv.BLOCK_SIZE, num_kv_heads=config.num_key_value_heads,
                              head_dim=config.head_dim, dtype=jnp.float32)
        ts = (1, args.k + 1)
        exes = {}
        try:
            for name, target in targets.items():
                build.TARGET = target  # what panel_matmul's ffi_call names while this step is traced
                for t in ts:
                    inputs = bv.step_inputs(args.batch, t, args.context, width)
                    exe = bv.compile_exe(bv.make_step(config, t), (params, kv, *inputs))
                    if f'"{target}"' not in exe.as_text():
                        raise SystemExit(f"{name}: the step does not call {target}")
                    exes[(name, t)] = (exe, inputs)
        finally:
            build.TARGET = base_target
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
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        out = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_info(),
               "args": {k: str(v) for k, v in vars(args).items()}, "command": " ".join(["python"] + sys.argv),
               "results": rows}
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
