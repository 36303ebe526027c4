"""Which implementation runs where: the one place that picks kernels per platform.

Every choice of Pallas kernel vs XLA path is made here, from
``jax.default_backend()`` and two environment variables (read when a step is
traced, i.e. at its first compile):

``SPECJAX_ATTENTION_BACKEND``  ``auto`` (default) | ``xla`` | ``pallas``
    auto: TPU -> JAX's ragged paged attention (every row kind: prefill chunks,
    decode, K+1-token verification); GPU -> JAX's Pallas paged decode attention
    for one-token rows and the XLA path for wider rows; CPU -> the C++ kernel
    ``models/cpu_kernels/paged_attention.cc`` for a model in the derived CPU weight
    layout (one CPU device, kernels built; see below), else the XLA path.
    ``pallas`` is ``auto`` that refuses to run on CPU; ``xla`` forces the XLA path.
``SPECJAX_SAMPLER_BACKEND``  ``auto`` (default) | ``xla`` | ``pallas``
    auto: the V-tiled fused Pallas rejection kernel on TPU; the batched XLA path
    on GPU (until the device check shows the kernel faster there) and CPU.
``SPECJAX_WEIGHT_LAYOUT``  ``auto`` (default) | ``checkpoint`` | ``cpu``
    auto: a model on one CPU device runs in ``models.cpu_layout`` (fused weights
    packed into panels that the C++ kernel ``models/cpu_kernels/panel_matmul.cc``
    streams once for a K+1-token verify, issue 14) when that kernel builds here;
    models on several devices, other platforms and machines without a C++ compiler
    keep the checkpoint layout. ``cpu`` is ``auto`` that refuses where it does not
    apply or the kernel is missing; ``checkpoint`` never converts.

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

# Attention implementations (specjax.attention dispatches on these names).
XLA = "xla"
RAGGED_TPU = "ragged_paged_tpu"  # jax.experimental.pallas.ops.tpu.ragged_paged_attention
PAGED_DECODE_GPU = "paged_decode_gpu"  # jax.experimental.pallas.ops.gpu.paged_attention's kernel, T == 1 rows
PAGED_CPU = "paged_cpu"  # models/cpu_kernels/paged_attention.cc, an XLA FFI custom call, every row kind


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


def attention_backend(num_query_tokens: int | None = None, cpu_layout: bool = False) -> str:
    """The attention implementation for rows of ``num_query_tokens`` (static T; None = any width).

    ``cpu_layout``: the calling model runs in the derived CPU weight layout, which
    :func:`use_cpu_weight_layout` grants only on one CPU device with the C++ kernels
    built (or is a draft head beside such a target); the attention kernel is a custom
    call with no sharding rule, so only such a model gets it."""
    if _choice(ATTENTION_ENV) == XLA:
        return XLA
    plat = platform()
    if plat == "tpu":
        return RAGGED_TPU
    if plat == "gpu" and num_query_tokens == 1:
        return PAGED_DECODE_GPU
    if plat == "cpu" and cpu_layout:
        return PAGED_CPU
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


def use_cpu_weight_layout(devices) -> bool:
    """Whether a model placed on ``devices`` runs in the derived CPU weight layout (module doc).

    Only a model on one CPU device: the C++ kernels are custom calls with no sharding rule. Measured
    side by side in the engine (benchmarks/bench_layout.py, 2026-12-04, 2-core AVX2), greedy decoding took
    0.57-0.82x the time in that layout for every model tried, the shipped 7.5M target (plain and
    draft_model K=4) to SmolLM2-135M, so ``auto`` has no size threshold."""
    value = os.environ.get(LAYOUT_ENV, "auto").strip().lower() or "auto"
    if value not in LAYOUTS:
        raise ValueError(f"{LAYOUT_ENV} must be one of {LAYOUTS}, got {value!r}")
    devices = list(devices)
    applies = len(devices) == 1 and devices[0].platform == "cpu"
    if value == "cpu" and not applies:
        raise ValueError(f"{LAYOUT_ENV}=cpu needs a model on one CPU device, got {len(devices)} device(s) on "
                         f"{sorted({d.platform for d in devices})}")
    if value == "checkpoint" or not applies:
        return False
    from models.cpu_kernels.panel_matmul import available  # builds the kernel on first use (cpu_kernels.build)

    if available():
        return True
    if value == "cpu":
        raise ValueError(f"{LAYOUT_ENV}=cpu needs the C++ panel-matmul kernel, which could not be built here "
                         "(a C++ compiler is needed once; the log says what failed)")
    return False


STEP_COST_SLOTS = {"cpu": 16, "gpu": 256, "tpu": 256}
"""What one step's own cost (launch, weight reads, fetch) is worth in padded token slots, per platform: the
default ``mixed_step_padding`` (``LLM(mixed_step_padding="auto")``). CPU: measured on the shipped target, a step
of 8 rows x 1 token 2.7 ms, each slot of an 8 x 64 step ~0.11 ms (2-core AVX2). GPU and TPU: not measured yet
(the device check is the place); a step reads every weight once and a slot costs two flops per weight, so the
worth is about a chip's peak matmul rate over its memory bandwidth in bytes per weight: ~300 for an H100's
published bf16 figures (989 TFLOP/s, 3.35 TB/s), ~240 for a TPU v5e's (197 TFLOP/s, 819 GB/s)."""


def step_cost_slots() -> int:
    """:data:`STEP_COST_SLOTS` for this platform."""
    return STEP_COST_SLOTS.get(platform(), STEP_COST_SLOTS["gpu"])


def describe() -> dict[str, str]:
    """What runs here, for logs and benchmark records."""
    return {
        "platform": platform(),
        "attention_decode": attention_backend(1),
        "attention_multi_token": attention_backend(None),
        "attention_cpu_layout": attention_backend(None, cpu_layout=True),
        "sampler": "pallas_" + sampler_kernel_platform() if use_pallas_sampler() else "xla",
        ATTENTION_ENV: os.environ.get(ATTENTION_ENV, "auto"),
        SAMPLER_ENV: os.environ.get(SAMPLER_ENV, "auto"),
        LAYOUT_ENV: os.environ.get(LAYOUT_ENV, "auto"),
    }
