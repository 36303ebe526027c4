"""The sharding plan: one mesh, one function from params to PartitionSpecs, for target and draft alike.

Mesh axes: ``dp`` splits the rows of a step (data parallel on one host), ``tp``
splits the model (Megatron-style tensor parallel). Under ``jax.jit`` with these
in/out shardings, XLA's SPMD partitioner inserts the collectives: one
all-reduce after each row-parallel projection (o_proj, down_proj) and an
all-gather of the vocab-sharded logits.

Layout per parameter (the letters of models/llama.py):

===============================  ======================  =====================
parameter                        shape                   spec
===============================  ======================  =====================
embed_tokens.embedding           [V, D]                  ('tp', None)  vocab-parallel
lm_head.kernel                   [D, V]                  (None, 'tp')  vocab-parallel
q_proj.kernel / bias             [D, H, E] / [H, E]      column-parallel on H
k_proj, v_proj kernel / bias     [D, G, E] / [G, E]      column-parallel on G
o_proj.kernel                    [H, E, D]               row-parallel on H
gate_proj, up_proj.kernel        [D, F]                  column-parallel on F
down_proj.kernel                 [F, D]                  row-parallel on F
norms, o_proj.bias               [D] / [E]               replicated
paged KV cache, per layer        [slots, G, E]           (None, 'tp', None)
===============================  ======================  =====================

A dimension that ``tp`` does not divide is replicated instead (documented
fallback, logged once per model): e.g. MQA's single KV head with tp = 2 keeps
k/v projections and the KV cache whole on every device, as vLLM does when tp
exceeds the KV head count, while q/o heads stay split. The KV cache's slot axis
is not split over ``dp``: every dp group holds the whole cache (rows may move
between dp groups from one step to the next).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.cpu_layout import has_int8_activations, is_cpu_layout, to_cpu_layout
from models.llama import LlamaConfig
from specjax.backends import use_cpu_weight_layout
from specjax.config import AUTO_QUANTIZED_DRAFTS, QUANTIZABLE_METHODS, SpeculativeConfig

logger = logging.getLogger(__name__)

DP, TP = "dp", "tp"


def make_mesh(*, tensor_parallel_size: int = 1, data_parallel_size: int = 1, devices=None) -> Mesh:
    """A ``(dp, tp)`` mesh over the first ``dp * tp`` devices (all local devices when None given)."""
    for name, value in (("tensor_parallel_size", tensor_parallel_size), ("data_parallel_size", data_parallel_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    devices = list(jax.local_devices() if devices is None else devices)
    need = tensor_parallel_size * data_parallel_size
    if need > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} x data_parallel_size={data_parallel_size} needs {need} "
            f"devices, only {len(devices)} available ({devices[0].platform}); on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={need} before importing jax"
        )
    grid = np.asarray(devices[:need], dtype=object).reshape(data_parallel_size, tensor_parallel_size)
    # Auto axes: the SPMD partitioner propagates shardings through the model (no per-op annotations).
    return Mesh(grid, (DP, TP), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _split(n: int, tp: int) -> str | None:
    """The ``tp`` axis name if ``tp`` divides ``n`` (and there is something to split), else None (replicate)."""
    return TP if tp > 1 and n % tp == 0 else None


def param_partition_specs(params: Any, config: LlamaConfig, *, tp: int) -> Any:
    """PartitionSpecs for a Llama-family param pytree (same structure), per the table in this module's doc.

    Used identically for the target and the draft; a draft with ``tp = 1`` is
    fully replicated. Raises ValueError on a parameter it does not know, so a new
    layer cannot silently end up replicated.
    """
    h, g, f, v = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size, config.vocab_size
    heads, kv_heads, ffn, vocab = _split(h, tp), _split(g, tp), _split(f, tp), _split(v, tp)
    rules = {
        ("embed_tokens", "embedding"): P(vocab, None),
        ("lm_head", "kernel"): P(None, vocab),
        ("q_proj", "kernel"): P(None, heads, None),
        ("q_proj", "bias"): P(heads, None),
        ("k_proj", "kernel"): P(None, kv_heads, None),
        ("k_proj", "bias"): P(kv_heads, None),
        ("v_proj", "kernel"): P(None, kv_heads, None),
        ("v_proj", "bias"): P(kv_heads, None),
        ("o_proj", "kernel"): P(heads, None, None),
        ("o_proj", "bias"): P(),
        ("gate_proj", "kernel"): P(None, ffn),
        ("up_proj", "kernel"): P(None, ffn),
        ("down_proj", "kernel"): P(ffn, None),
    }
    norms = {"input_layernorm", "post_attention_layernorm", "norm", "q_norm", "k_norm"}
    # models.cpu_layout's fused weight panels: for one device only.
    cpu_layout = {("qkv_proj", "kernel_p"), ("qkv_proj", "bias"), ("o_proj", "kernel_p"),
                  ("gate_up_proj", "kernel_p"), ("down_proj", "kernel_p"), ("lm_head", "kernel_p"),
                  ("embed_tokens", "embedding_p")}

    def spec(path, leaf) -> P:
        names = tuple(getattr(k, "key", str(k)) for k in path)
        if names[-2:] in rules:
            return rules[names[-2:]]
        if names[-2:] in cpu_layout:
            if tp > 1:
                raise ValueError(f"parameter {'/'.join(names)} is in the one-device CPU layout; "
                                 f"it cannot be split tp={tp} ways (load the checkpoint layout)")
            return P()
        if len(names) >= 2 and names[-2] in norms and names[-1] == "scale":
            return P()
        raise ValueError(f"no sharding rule for parameter {'/'.join(names)} with shape {np.shape(leaf)}")

    specs = jax.tree_util.tree_map_with_path(spec, params)
    if tp > 1:
        replicated = [name for name, axis in (("attention heads", heads), ("kv heads", kv_heads), ("ffn", ffn),
                                              ("vocab", vocab)) if axis is None]
        if replicated:
            logger.warning("tp=%d does not divide %s of this model; those weights are replicated", tp,
                           ", ".join(replicated))
    return specs


def kv_partition_spec(config: LlamaConfig, *, tp: int) -> P:
    """PartitionSpec of each layer's ``[slots, G, E]`` K and V arrays: KV heads on ``tp`` when it divides them."""
    return P(None, _split(config.num_key_value_heads, tp), None)


def check_int8_activations(mesh: Mesh, quantized: Any) -> None:
    """ValueError naming ``int8_activations`` unless it can apply: the CPU kernels' weight layout on this mesh and
    a model file with GGUF blocks (``models.loading.load_blocks``)."""
    if not use_cpu_weight_layout(mesh.devices.flat):
        raise ValueError("int8_activations=True needs the CPU kernels' weight layout (one CPU device with the "
                         "kernels built; specjax.backends.use_cpu_weight_layout), which this mesh does not run")
    if not quantized:
        raise ValueError("int8_activations=True needs a GGUF model file with Q4_0, Q4_1 or Q8_0 blocks; "
                         "this model has none")


def resolve_draft_quantization(mesh: Mesh, spec: SpeculativeConfig) -> SpeculativeConfig:
    """``spec`` with ``quantization="auto"`` resolved: "q8_0" for a built-in draft in ``AUTO_QUANTIZED_DRAFTS`` where
    the CPU kernels' weight layout runs on this mesh (the quantized panels are theirs), else None. A quantization
    given outright that cannot apply there is refused (ValueError naming ``speculative_config.quantization``)."""
    quantization = spec.quantization
    if quantization == "auto":
        auto = (str(spec.model) in AUTO_QUANTIZED_DRAFTS and spec.method in QUANTIZABLE_METHODS
                and use_cpu_weight_layout(mesh.devices.flat))
        return spec.with_quantization("q8_0" if auto else None)
    if quantization is not None and not use_cpu_weight_layout(mesh.devices.flat):
        raise ValueError(f"speculative_config.quantization={quantization!r} needs the CPU kernels' weight layout "
                         "(one CPU device with the kernels built; specjax.backends.use_cpu_weight_layout), which "
                         "this mesh does not run")
    return spec


def quantized_draft(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, a draft's weights being quantized for ``speculative_config.quantization``: a
    ValueError it raises (a width Q8_0 blocks cannot split) is raised again naming the field."""
    try:
        return fn(*args, **kwargs)
    except ValueError as e:
        raise ValueError(f"speculative_config.quantization: {e}") from e


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardingPlan:
    """Shardings of one model (target or draft) on the engine's mesh."""

    mesh: Mesh
    tp: int
    """How many ways this model is split on the mesh's ``tp`` axis: the mesh's size there, or 1 (replicated)."""

    def __post_init__(self) -> None:
        size = self.mesh.shape[TP]
        if self.tp not in (1, size):
            raise ValueError(f"tp={self.tp} must be 1 or the mesh's tp size {size}")

    @property
    def rows(self) -> NamedSharding:
        """Batch-major step inputs and outputs: rows split over ``dp``, whole on each ``tp`` device."""
        return NamedSharding(self.mesh, P(DP))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def layout(self, params: Any, config: LlamaConfig, *, quantized: Any = None, int8_activations: bool = False) -> Any:
        """``params`` in the layout this plan runs them in: ``models.cpu_layout``'s on a one-CPU-device mesh
        (``specjax.backends.use_cpu_weight_layout``), else as given. Converting copies the weights.
        ``quantized``: the model file's GGUF blocks (``models.loading.load_blocks``), kept where exact;
        ``int8_activations``: in the layout for int8 activations (:func:`check_int8_activations` first)."""
        if int8_activations:
            check_int8_activations(self.mesh, quantized)
        if use_cpu_weight_layout(self.mesh.devices.flat) and not is_cpu_layout(params):
            params = to_cpu_layout(params, config, quantized=quantized, int8_activations=int8_activations)
        if int8_activations and not has_int8_activations(params):
            raise ValueError("int8_activations=True: none of the model file's quantized blocks gives its weights "
                             "exactly, so no projection would run with int8 activations")
        return params

    def params(self, params: Any, config: LlamaConfig) -> Any:
        """NamedShardings for ``params`` (same pytree structure)."""
        specs = param_partition_specs(params, config, tp=self.tp)
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, P))

    def kv(self, config: LlamaConfig) -> NamedSharding:
        """One sharding for every K/V array of the model's paged cache (a pytree prefix for KVCache)."""
        return NamedSharding(self.mesh, kv_partition_spec(config, tp=self.tp))
