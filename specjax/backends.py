"""Which implementation runs where: the one place that picks kernels per platform.

Every choice of kernel vs XLA path is made here from ``jax.default_backend()``,
so the engine, the sampler front end and the model never test the platform
themselves.
"""

from __future__ import annotations

import jax


def use_pallas_sampler() -> bool:
    """True when the engine's rejection sampler should run the fused Pallas kernel.

    TPU only for now: the kernel's blocks span the whole vocabulary, which Mosaic
    accepts and Triton (GPU) does not.
    """
    return jax.default_backend() == "tpu"
