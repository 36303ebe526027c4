"""Which implementation runs where: the one place that picks kernels per platform.

Every choice of Pallas kernel vs XLA path is made here, from
``jax.default_backend()`` and two environment variables (read when a step is
traced, i.e. at its first compile):

``SPECJAX_ATTENTION_BACKEND``  ``auto`` (default) | ``xla`` | ``pallas``
    auto: TPU -> JAX's ragged paged attention (every row kind: prefill chunks,
    decode, K+1-token verification); GPU -> JAX's Pallas paged decode attention
    for one-token rows and the XLA path for wider rows; CPU -> the XLA path.
    ``pallas`` is ``auto`` that refuses to run on CPU; ``xla`` forces the XLA path.
``SPECJAX_SAMPLER_BACKEND``  ``auto`` (default) | ``xla`` | ``pallas``
    auto: the V-tiled fused Pallas rejection kernel on TPU; the batched XLA path
    on GPU (until the device check shows the kernel faster there) and CPU.
``SPECJAX_WEIGHT_LAYOUT``  ``auto`` (default) | ``checkpoint`` | ``cpu``
    auto: an unsharded model of at least ``CPU_LAYOUT_MIN_BYTES`` of weights on CPU
    devices runs in ``models.llama.to_cpu_layout`` (fused, transposed weights that
    XLA:CPU streams once for a K+1-token verify, issue 14); smaller models, sharded
    models and other platforms keep the checkpoint layout. ``cpu`` converts every
    unsharded CPU model and refuses where it does not apply; ``checkpoint`` never converts.

The engine, the sampler front end and the model never test the platform themselves.
"""

from __future__ import annotations

import os

import jax

ATTENTION_ENV = "SPECJAX_ATTENTION_BACKEND"
SAMPLER_ENV = "SPECJAX_SAMPLER_BACKEND"
LAYOUT_ENV = "SPECJAX_WEIGHT_LAYOUT"
CHOICES = ("auto", "xla", "pallas")
LAYOUTS = ("auto", "checkpoint", "cpu")
CPU_LAYOUT_MIN_BYTES = 256 << 20
"""Smallest model (bytes of weights) ``auto`` converts. Measured side by side in the engine
(benchmarks/bench_layout.py, 2026-12-03): greedy decoding of SmolLM2-135M (513 MiB) took 0.88x the time in the
derived layout, the shipped 7.5M target (29 MiB) 1.10x (plain) and 1.04x (draft_model K=4), a random 30M
Llama (116 MiB) 1.11x; weights that stay in the last-level cache gain nothing from being streamed once."""

# Attention implementations (specjax.attention dispatches on these names).
XLA = "xla"
RAGGED_TPU = "ragged_paged_tpu"  # jax.experimental.pallas.ops.tpu.ragged_paged_attention
PAGED_DECODE_GPU = "paged_decode_gpu"  # jax.experimental.pallas.ops.gpu.paged_attention's kernel, T == 1 rows


def platform() -> str:
    """"tpu", "gpu" or "cpu" (CUDA and ROCm count as "gpu")."""
    backend = jax.default_backend()
    return "gpu" if backend in ("gpu", "cuda", "rocm") else backend


def _choice(env: str) -> str:
    value = os.environ.get(env, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{env} must be one of {CHOICES}, got {value!r}")
    if value == "pallas" and platform() not in ("tpu", "gpu"):
        raise ValueError(f"{env}=pallas needs a TPU or GPU backend, got {jax.default_backend()!r} "
                         "(Pallas kernels run on CPU only in interpret mode, for tests)")
    return value


def attention_backend(num_query_tokens: int | None = None) -> str:
    """The attention implementation for rows of ``num_query_tokens`` (static T; None = any width)."""
    if _choice(ATTENTION_ENV) == XLA:
        return XLA
    plat = platform()
    if plat == "tpu":
        return RAGGED_TPU
    if plat == "gpu" and num_query_tokens == 1:
        return PAGED_DECODE_GPU
    return XLA


def use_pallas_sampler() -> bool:
    """True when the engine's rejection sampler should run the fused Pallas kernel."""
    choice = _choice(SAMPLER_ENV)
    if choice != "auto":
        return choice == "pallas"
    return platform() == "tpu"


def sampler_kernel_platform() -> str:
    """Which kernel bodies (and block sizes) the rejection kernel uses: "tpu" on TPU, else "gpu"."""
    return "tpu" if platform() == "tpu" else "gpu"


def use_cpu_weight_layout(devices, tp: int, weight_bytes: int) -> bool:
    """Whether a model of ``weight_bytes`` placed on ``devices`` and split ``tp`` ways runs in the derived CPU
    weight layout."""
    value = os.environ.get(LAYOUT_ENV, "auto").strip().lower() or "auto"
    if value not in LAYOUTS:
        raise ValueError(f"{LAYOUT_ENV} must be one of {LAYOUTS}, got {value!r}")
    applies = tp == 1 and all(d.platform == "cpu" for d in devices)
    if value == "cpu" and not applies:
        raise ValueError(f"{LAYOUT_ENV}=cpu needs an unsharded model on CPU devices, got tp={tp} on "
                         f"{sorted({d.platform for d in devices})}")
    if value == "auto":
        return applies and weight_bytes >= CPU_LAYOUT_MIN_BYTES
    return value == "cpu"


def describe() -> dict[str, str]:
    """What runs here, for logs and benchmark records."""
    return {
        "platform": platform(),
        "attention_decode": attention_backend(1),
        "attention_multi_token": attention_backend(None),
        "sampler": "pallas_" + sampler_kernel_platform() if use_pallas_sampler() else "xla",
        ATTENTION_ENV: os.environ.get(ATTENTION_ENV, "auto"),
        SAMPLER_ENV: os.environ.get(SAMPLER_ENV, "auto"),
        LAYOUT_ENV: os.environ.get(LAYOUT_ENV, "auto"),
    }
