"""XLA compiler options the library sets for its own executables (never a user's global flags).

:func:`compiler_options` is passed to ``Lowered.compile`` for every engine
executable (``specjax.buckets.CompiledBuckets``). It returns None today: on
XLA:CPU no option made a (K+1)-token verify step cheaper, which is why the
derived CPU weight layout runs its projections through a C++ custom call instead
(``models.cpu_layout`` + ``models/cpu_kernels/panel_matmul.cc``, issue 14; XLA
options do not reach that kernel). What was measured before the kernel existed,
against the layout's earlier XLA formulation (a broadcast multiply summed over
the contraction, "row-streaming"; jaxlib 0.10.2, 2-core x86_64 with AVX-512;
numbers in benchmarks/README.md, "Verify cost on CPU"):

* ``xla_cpu_experimental_ynn_fusion_type``: values are the enum names
  ``LIBRARY_FUSION_TYPE_{DOT,ELTWISE,REDUCE,INDIVIDUAL_DOT,INDIVIDUAL_CONVOLUTION}``
  (one value as a compile option; XLA_FLAGS also takes comma lists and +/-
  prefixes). By default this jaxlib sends every dot with 2+ rows, and the
  broadcast-multiply-reduce of the row-streaming formulation, to YNNPACK. Setting it to
  ``""`` (accepted, with a logged "Unsupported fusion type: 0") sends dots to
  Eigen instead: on a 64 MB weight 5 rows cost ~1.6x one row instead of ~2.5x,
  but it also removes the row-streaming kernel (~1.1x there), so it is not set.
* ``xla_cpu_experimental_xnn_fusion_type``, ``xla_cpu_use_onednn``,
  ``xla_cpu_experimental_onednn_custom_call``: no change (YNNPACK or Eigen claims
  the dot first; no xnn/onednn fusion appeared in the compiled HLO).
* ``xla_cpu_multi_thread_eigen=false`` with
  ``--xla_backend_extra_options=xla_force_enable_experimental_llvm_ir_gemm``
  (XLA_FLAGS only; meant to select XLA's own tiled LLVM IR GEMM): dots with
  2-16 rows ran 3.6-6.4x slower than with Eigen.
* ``xla_cpu_prefer_vector_width=512``, ``xla_cpu_enable_fast_math=true``: within
  run-to-run noise on a SmolLM2-shaped layer stack.
* ``xla_cpu_enable_custom_matmul_tiling``, ``xla_cpu_matmul_tiling_{m,n,k}_dim``:
  rejected by this jaxlib ("No such compile option").
"""

from __future__ import annotations

from typing import Any


def compiler_options() -> dict[str, Any] | None:
    """Options passed to ``Lowered.compile`` for every engine executable; None = XLA's defaults (see module doc)."""
    return None
