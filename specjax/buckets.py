"""Static-shape buckets: ahead-of-time compiled executables, one per bucket, with compile accounting.

The JAX counterpart of CUDA-graph capture: each jitted step is lowered and
compiled once per bucket (at warmup, or on first use), then called as a
compiled executable, which cannot silently retrace or recompile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import jax

from specjax.xla_options import compiler_options

logger = logging.getLogger(__name__)


class CompiledBuckets:
    """A jitted function compiled per bucket key, with a count of compiles and their time."""

    def __init__(self, name: str, jitted: Callable, example_args: Callable[[Hashable], tuple[Any, ...]]):
        """``example_args(bucket)`` returns arguments (arrays or ShapeDtypeStructs) of that bucket's shapes."""
        self.name = name
        self._jitted = jitted
        self.example_args = example_args
        self._compiled: dict[Hashable, Any] = {}
        self.num_compiles = 0
        self.compile_seconds = 0.0

    def get(self, bucket: Hashable):
        exe = self._compiled.get(bucket)
        if exe is None:
            start = time.perf_counter()
            exe = self._jitted.lower(*self.example_args(bucket)).compile(compiler_options())
            self._store(bucket, exe, time.perf_counter() - start)
        return exe

    def _store(self, bucket: Hashable, exe, seconds: float) -> None:
        self.num_compiles += 1
        self.compile_seconds += seconds
        self._compiled[bucket] = exe
        logger.info("compiled %s for bucket %s in %.2fs", self.name, bucket, seconds)

    def compile_all(self, buckets: list[Hashable], *, workers: int, on_done: Callable[[], None] | None = None) -> None:
        """Compile every bucket not compiled yet, ``workers`` XLA compilations at a time.

        Lowering (tracing) runs here, one bucket after another; XLA's compile releases the GIL, so on a
        machine with several cores the compilations overlap. ``on_done`` is called after each bucket.
        """
        from concurrent.futures import ThreadPoolExecutor

        todo = [b for b in dict.fromkeys(buckets) if b not in self._compiled]
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            futures = []
            for bucket in todo:
                lowered = self._jitted.lower(*self.example_args(bucket))
                start = time.perf_counter()
                futures.append((bucket, start, pool.submit(lowered.compile, compiler_options())))
            for bucket, start, future in futures:
                self._store(bucket, future.result(), time.perf_counter() - start)
                if on_done is not None:
                    on_done()


MAPS_PATH = "/proc/self/maps"
MAP_LIMIT_PATH = "/proc/sys/vm/max_map_count"


def memory_maps() -> tuple[int, int] | None:
    """(this process's memory mappings, the kernel's limit on them, ``vm.max_map_count``); None where either is
    unreadable (not Linux).

    XLA:CPU keeps each executable's JIT code in mappings of its own, a few hundred per executable (the shipped
    pair's 56 at max_num_seqs 8: 443 each), and Linux's default limit is 65530: a process holding several LLMs
    reached it while compiling and died ("LLVM compilation error: Cannot allocate memory", then a segfault)."""
    try:
        with open(MAPS_PATH, "rb") as f:
            used = sum(1 for _ in f)
        with open(MAP_LIMIT_PATH) as f:
            limit = int(f.read())
    except (OSError, ValueError):
        return None
    return used, limit


def maps_warning(before: tuple[int, int] | None, after: tuple[int, int] | None) -> str | None:
    """A warning where compiling as much again as between ``before`` and ``after`` (:func:`memory_maps`), e.g.
    another LLM like the one just compiled, would pass the limit; else None."""
    if before is None or after is None:
        return None
    used, limit = after
    added = used - before[0]
    if added <= 0 or used + added <= limit:
        return None
    return (f"this process holds {used} memory mappings of vm.max_map_count={limit}, {added} of them from the "
            "executables just compiled: compiling as many again (another LLM like this one) would fail in XLA "
            "('LLVM compilation error: Cannot allocate memory', then a crash). Hold fewer LLMs in one process, "
            "or raise the limit: sysctl -w vm.max_map_count=262144")


CACHE_ENV = "SPECJAX_COMPILATION_CACHE"


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/specjax/xla`` (``~/.cache/specjax/xla`` when XDG_CACHE_HOME is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "specjax", "xla")


def enable_persistent_cache(setting: bool | str | os.PathLike | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache for this process; returns its directory (None = off).

    ``setting``: None = on in :func:`default_cache_dir` unless the environment variable
    ``SPECJAX_COMPILATION_CACHE`` is ``0`` (or names another directory); False = leave JAX as it is;
    True = on in the default directory; a path = on there. A cache directory the user already gave JAX
    (``jax_compilation_cache_dir``) is never replaced. A second run of the same configuration then loads
    its executables from disk instead of compiling them.
    """
    if setting is None:
        env = os.environ.get(CACHE_ENV)
        if env is not None and env.strip().lower() in ("0", "false", "off", "no", ""):
            return None
        setting = env if env and env.strip().lower() not in ("1", "true", "on", "yes") else True
    if setting is False:
        return None
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    path = default_cache_dir() if setting is True else os.fspath(setting)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    # Engine executables compile in well under JAX's default 1 s threshold on small models: cache them all.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    logger.info("persistent compilation cache: %s", path)
    return path


_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_listener_lock = threading.Lock()
_active_counters: list["CompileCounter"] = []
_listener_installed = False


class CompileCounter:
    """Counts every XLA backend compile in the process while active (any jit, anywhere).

    Stronger than per-bucket bookkeeping: it also catches stray eager jnp ops on
    the host path, which compile small kernels of their own.
    """

    def __init__(self) -> None:
        self.count = 0


def _on_event(event: str, duration: float, **kwargs) -> None:
    if event == _COMPILE_EVENT:
        for counter in _active_counters:
            counter.count += 1


@contextlib.contextmanager
def count_compiles() -> Iterator[CompileCounter]:
    """``with count_compiles() as c: ...; c.count`` is the number of backend compiles inside."""
    global _listener_installed
    with _listener_lock:
        if not _listener_installed:
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            _listener_installed = True
    counter = CompileCounter()
    _active_counters.append(counter)
    try:
        yield counter
    finally:
        _active_counters.remove(counter)
