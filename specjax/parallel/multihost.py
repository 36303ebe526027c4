"""Multi-host start-up for data-parallel jobs: JAX's own multi-controller runtime, nothing invented.

A TPU pod slice (or a GPU cluster) runs one Python process per host, every one
executing the same program. ``jax.distributed.initialize`` connects them (a
coordinator at process 0, heartbeats, a key-value store and barriers) and tells
each its ``process_index`` out of ``process_count``. ``specjax batch`` uses
exactly that much: each process runs its own local ``LLM`` on its own chips and
takes the input lines ``i`` with ``i % process_count == process_index`` (data
parallelism over hosts, no cross-host model sharding), writes its own part file
(:func:`part_path`), and process 0 merges the parts after a :func:`barrier`.

On TPU VMs, Slurm or Open MPI the coordinator address, process count and index
come from the environment (JAX's cluster auto-detection); elsewhere pass them
(``--coordinator-address HOST:PORT --num-processes N --process-id I``) or set
``JAX_COORDINATOR_ADDRESS`` / ``SPECJAX_NUM_PROCESSES`` / ``SPECJAX_PROCESS_ID``.
On CPU the cross-process collectives go through gloo, which must be chosen
before ``initialize``; that setting only affects the CPU backend, so it is made
unconditionally.
"""

from __future__ import annotations

import dataclasses
import logging
import os

logger = logging.getLogger(__name__)

ENV_NUM_PROCESSES = "SPECJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "SPECJAX_PROCESS_ID"
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"  # JAX's own name: jax.distributed.initialize reads it too


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProcessInfo:
    """Where this process stands in the job."""

    index: int = 0
    count: int = 1
    distributed: bool = False
    """True once ``jax.distributed`` is initialised (barriers then go through its coordinator)."""

    def __post_init__(self) -> None:
        for name, value in (("process_id", self.index), ("num_processes", self.count)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if self.count < 1:
            raise ValueError(f"num_processes must be >= 1, got {self.count}")
        if not 0 <= self.index < self.count:
            raise ValueError(f"process_id must be in [0, num_processes={self.count}), got {self.index}")

    def owns(self, line_index: int) -> bool:
        """Whether input line ``line_index`` (0-based) belongs to this process: round-robin by index."""
        return line_index % self.count == self.index


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an int, got {value!r}") from None


def _is_initialized() -> bool:
    from jax._src import distributed

    return distributed.global_state.client is not None


# JAX cluster types whose presence means "this process is one of several launched together". Kubernetes
# is left out on purpose: a lone pod would otherwise try to bootstrap from the k8s API.
AUTO_CLUSTERS = ("GceTpuCluster", "GkeTpuCluster", "SlurmCluster", "OmpiCluster")


def cluster_detected() -> bool:
    """Whether JAX's cluster detection recognises a TPU VM, a Slurm job step or an Open MPI launch.

    Uses JAX's private cluster registry; if that moves, this answers False and
    the flags / environment variables are the way in.
    """
    try:
        from jax._src import clusters

        for env in clusters.ClusterEnv._cluster_types:
            if env.__name__ in AUTO_CLUSTERS and env.is_env_present():
                return True
    except Exception:  # noqa: BLE001 - detection is best effort, never a reason to fail
        logger.debug("JAX cluster auto-detection unavailable", exc_info=True)
    return False


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    initialization_timeout: int = 300,
) -> ProcessInfo:
    """``jax.distributed.initialize`` with the arguments given, the environment's, or JAX's auto-detection.

    Must run before anything touches a JAX backend (``jax.devices()``, the first
    computation). Arguments left as None are read from ``JAX_COORDINATOR_ADDRESS``
    / ``SPECJAX_NUM_PROCESSES`` / ``SPECJAX_PROCESS_ID``, and what is still missing
    is left to JAX's cluster detection (TPU VM metadata, Slurm, Open MPI). Calling
    it again after a successful initialisation returns the current layout.
    """
    import jax

    if _is_initialized():
        return process_info()
    if num_processes is None:
        num_processes = _env_int(ENV_NUM_PROCESSES)
    if process_id is None:
        process_id = _env_int(ENV_PROCESS_ID)
    if coordinator_address is None:
        coordinator_address = os.environ.get(ENV_COORDINATOR) or None
    if num_processes is not None and process_id is not None:
        ProcessInfo(index=process_id, count=num_processes)  # validates both, naming the field
    elif num_processes is not None:
        ProcessInfo(index=0, count=num_processes)
    if coordinator_address is not None:
        host, sep, port = coordinator_address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"coordinator_address must be HOST:PORT, got {coordinator_address!r}")
    # gloo: the CPU backend's cross-process collectives (barriers fall back on them); TPU/GPU ignore it.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id,
        initialization_timeout=initialization_timeout,
    )
    info = process_info()
    logger.info("jax.distributed initialised: process %d of %d (coordinator %s)", info.index, info.count,
                coordinator_address or "auto-detected")
    return info


def process_info() -> ProcessInfo:
    """This process's index and the process count (0 of 1 when ``jax.distributed`` is not initialised)."""
    if not _is_initialized():
        return ProcessInfo()
    import jax

    return ProcessInfo(index=jax.process_index(), count=jax.process_count(), distributed=True)


def barrier(name: str, *, timeout_s: float = 24 * 3600.0) -> None:
    """Block until every process reaches the barrier ``name`` (a no-op for one process).

    Goes through the coordinator's ``wait_at_barrier`` so that a process that
    finished its shard early can wait as long as the slowest one needs (a device
    collective such as ``multihost_utils.sync_global_devices`` would do too, but
    its transport may time out first); falls back on that collective if the
    client API is not there.
    """
    info = process_info()
    if info.count == 1:
        return
    from jax._src import distributed

    client = distributed.global_state.client
    if client is not None and hasattr(client, "wait_at_barrier"):
        client.wait_at_barrier(name, int(timeout_s * 1000))
        return
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def part_path(output: str | os.PathLike, index: int, count: int) -> str:
    """The part file process ``index`` of ``count`` writes for ``output``: ``OUTPUT.part-00003-of-00016``."""
    return f"{os.fspath(output)}.part-{index:05d}-of-{count:05d}"
