"""Builds the C++ CPU kernels on the machine that runs them, caches the library, registers it with XLA.

The sources (one library) are compiled once per (source, compiler, jaxlib, CPU) with ``-march=native`` into
``$SPECJAX_CACHE_DIR/cpu_kernels`` (default ``~/.cache/specjax/cpu_kernels``); later processes load the
cached file in milliseconds. The build is atomic (temporary file, then rename), so parallel test workers
or jobs sharing a cache directory never load a half-written library. Without a C++ compiler
(``$CXX``, else ``c++``/``g++``/``clang++``) or the XLA FFI headers, :func:`load` returns None and says why
in the log; callers then keep XLA's own kernels (``specjax.backends.use_cpu_weight_layout``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = (HERE / "panel_matmul.cc", HERE / "paged_attention.cc", HERE / "decoder_layer.cc")
HEADERS = (HERE / "common.h", HERE / "panels.h", HERE / "attention.h")
TARGET = "specjax_panel_matmul"
"""XLA custom-call target name of the panel matmul (what compiled HLO calls)."""
ATTENTION_TARGET = "specjax_paged_attention"
"""XLA custom-call target name of the paged attention."""
ROWS_TARGET = "specjax_panel_rows"
"""XLA custom-call target name of the row lookup from panels."""
LAYER_TARGET = "specjax_decoder_layer"
"""XLA custom-call target name of the fused decoder layer."""
_SYMBOLS = {TARGET: "SpecjaxPanelMatmul", ATTENTION_TARGET: "SpecjaxPagedAttention", ROWS_TARGET: "SpecjaxPanelRows",
            LAYER_TARGET: "SpecjaxDecoderLayer"}
FLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-std=gnu++17", "-shared", "-fPIC")
CACHE_ENV = "SPECJAX_CACHE_DIR"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU model and flags (a shared cache dir may span machines)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features")]
        return "\n".join(sorted(set(keep)))
    except OSError:
        return platform.processor() or platform.machine()


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "specjax")
    return Path(root) / "cpu_kernels"


def _build(cxx: str, out: Path, sources: tuple[Path, ...] = SOURCES) -> None:
    """Compile ``sources`` (the kernels, or variants of them elsewhere that include ``common.h``) into ``out``."""
    include = jax.ffi.include_dir()
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cxx, *FLAGS, f"-I{include}", f"-I{HERE}", *map(str, sources), "-o", tmp]
        logger.info("building the CPU kernels (once per machine): %s", " ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed:\n{proc.stderr[-4000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_panel_width: int | None = None  # what the loaded library's SpecjaxPanelWidth() returned


@functools.cache
def load() -> str | None:
    """Build (or find) and register the kernels; the panel matmul's target name, or None when unavailable.

    One library holds every kernel, so a non-None answer means all of them are registered."""
    cxx = _compiler()
    if cxx is None:
        logger.warning("no C++ compiler found ($CXX, c++, g++, clang++): the CPU kernels are off")
        return None
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join(
        [*(p.read_text() for p in SOURCES + HEADERS), " ".join(FLAGS), version, jaxlib.__version__,
         platform.machine(), _cpu_signature()]
    ).encode()).hexdigest()[:16]
    lib_path = cache_dir() / f"specjax_cpu_kernels-{key}.so"
    try:
        if not lib_path.exists():
            _build(cxx, lib_path)
        lib = ctypes.cdll.LoadLibrary(str(lib_path))
        for target, symbol in _SYMBOLS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        global _panel_width
        _panel_width = int(lib.SpecjaxPanelWidth())
    except (OSError, RuntimeError, AttributeError) as e:
        logger.warning("the CPU kernels are off: %s", e)
        return None
    return TARGET


def panel_width() -> int | None:
    """Output columns per panel of the built panel kernel (two of the machine's float vectors), or None
    when the kernels are unavailable here."""
    return _panel_width if load() is not None else None


def available() -> bool:
    """Whether the kernels are built and registered here (builds them on first call; :func:`load`)."""
    return load() is not None
