"""The CPU verify path of issue 14: ``models.cpu_layout.to_cpu_layout`` + the C++ kernels.

* The derived layout gives transformers' logits and greedy tokens (prefill, a
  5-token verify chunk, 2-row decode steps).
* The executables the engine compiles on CPU (``CompiledBuckets`` with
  ``compiler_options()``) run every projection and the LM head through the
  panel kernel's custom call and every layer's attention through the attention
  kernel's, for a (K+1)-token verify and a one-token step.
* The engine picks the layout per ``SPECJAX_WEIGHT_LAYOUT``; it cannot be sharded.
The kernels themselves are tested against their numpy references in test_cpu_kernels.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from test_models import (  # noqa: E402
    CASES,
    WIDTH,
    PagedRows,
    _forward,
    assert_logits_close,
    greedy_reference_loop,
    hf_logits,
    new_cache,
)
from tiny_models import load_hf_torch_model, make_tiny_checkpoint  # noqa: E402

from models import cpu_layout, llama  # noqa: E402
from models.cpu_kernels.build import ATTENTION_TARGET, LAYER_TARGET, TARGET  # noqa: E402
from models.cpu_kernels.panel_matmul import panel_width, unpack  # noqa: E402
from models.llama import (  # noqa: E402
    LlamaConfig,
    embedding_rows,
    forward,
    init_params,
    is_cpu_layout,
    lm_head_logits,
    to_cpu_layout,
)
from models.loading import load_hf_model, read_generation_eos  # noqa: E402
from specjax.buckets import CompiledBuckets  # noqa: E402
from specjax.kv_cache import AttentionMetadata, KVCache  # noqa: E402

# q/k/v + o biases (llama), qk-norm with head_dim * heads != hidden (qwen3), tied head with MQA + qkv bias (qwen2):
# layers as separate operations; GQA with llama3 RoPE scaling: each layer one fused call.
LAYOUT_CASES = ("llama_linear_rope_bias", "qwen3", "tied", "llama3_rope")


@pytest.fixture(scope="module", params=LAYOUT_CASES)
def case(request, tmp_path_factory):
    name = request.param
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(f"cpu_{name}"), seed=len(name), **CASES[name])
    config, params = load_hf_model(path)
    rng = np.random.default_rng(321)
    prompts = [rng.integers(2, config.vocab_size - 1, size=n).tolist() for n in (14, 9)]
    return name, path, config, params, to_cpu_layout(params, config), load_hf_torch_model(path), prompts


def test_cpu_layout_logits_match_transformers(case):
    """Prefill (32 rows), a 5-token verify chunk of one row, then 2-row decode steps."""
    _, _, c, params, cpu_params, hf, prompts = case
    assert is_cpu_layout(cpu_params) and not is_cpu_layout(params)
    refs = [hf_logits(hf, p) for p in prompts]
    rows = PagedRows(np.random.default_rng(5), [len(p) for p in prompts])
    cache = new_cache(c)
    done = [6, 4]
    tokens, positions, meta = rows.batch([p[:d] for p, d in zip(prompts, done)], [0, 0], WIDTH)
    logits, hidden, cache = _forward(cpu_params, tokens, positions, cache, meta, config=c)
    for b, d in enumerate(done):
        assert_logits_close(logits[b, :d], refs[b][:d])
    np.testing.assert_allclose(lm_head_logits(cpu_params, hidden, config=c), logits, rtol=1e-5, atol=1e-4)

    # Row 0 verifies 5 tokens, row 1 is padding; only row 0 sits in the batch (B*T = 5).
    tokens, positions, _ = rows.batch([prompts[0][6:11]], [6], 5)
    meta = AttentionMetadata(slot_mapping=jnp.asarray([[rows.slot(0, 6 + j) for j in range(5)]], jnp.int32),
                             block_tables=jnp.asarray(rows.tables[:1]))
    logits, _, cache = _forward(cpu_params, tokens, positions, cache, meta, config=c)
    assert_logits_close(logits[0], refs[0][6:11])
    done[0] = 11

    while done != [len(p) for p in prompts]:  # decode both rows (B*T = 2); a finished row becomes padding
        chunk = [p[d : d + 1] for p, d in zip(prompts, done)]
        tokens, positions, meta = rows.batch(chunk, done, 1)
        logits, _, cache = _forward(cpu_params, tokens, positions, cache, meta, config=c)
        for b, toks in enumerate(chunk):
            if toks:
                assert_logits_close(logits[b, 0], refs[b][done[b]])
                done[b] += 1


def test_cpu_layout_greedy_matches_transformers_generate(case):
    _, path, c, _, cpu_params, hf, prompts = case
    eos_ids = read_generation_eos(path, c)
    ours = greedy_reference_loop(c, cpu_params, prompts, 12, eos_ids, np.random.default_rng(8))
    for prompt, out in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
        assert out == ref[0, len(prompt) :].tolist()


def test_to_cpu_layout_shapes_dtypes_and_refusal():
    c = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=12, attention_bias=True, attention_out_bias=True, qk_norm=True,
                    architecture="Qwen3ForCausalLM")
    params = init_params(c, jax.random.key(0), dtype=jnp.bfloat16)
    cpu = to_cpu_layout(params, c)
    layer, src = cpu["layers_1"], params["layers_1"]
    h, g, e = 4, 2, 12
    w = panel_width()  # columns per panel on this machine

    def panels(n, k):
        return (-(-n // w), k, w)

    assert layer["self_attn"]["qkv_proj"]["kernel_p"].shape == panels(96, 32)  # (H+2G)*E = 96 outputs
    assert layer["self_attn"]["qkv_proj"]["bias"].shape == ((h + 2 * g) * e,)
    assert layer["self_attn"]["o_proj"]["kernel_p"].shape == panels(32, h * e)
    assert layer["mlp"]["gate_up_proj"]["kernel_p"].shape == panels(96, 32)
    assert layer["mlp"]["down_proj"]["kernel_p"].shape == panels(32, 48)
    assert cpu["lm_head"]["kernel_p"].shape == panels(96, 32)
    assert {x.dtype for x in jax.tree_util.tree_leaves(cpu)} == {jnp.dtype(jnp.bfloat16)}
    # Values: unpacked panels are the transposed checkpoint columns, in q, k, v / gate, up order.
    qkv = unpack(np.asarray(layer["self_attn"]["qkv_proj"]["kernel_p"], np.float32), 96)
    np.testing.assert_array_equal(qkv[h * e : (h + g) * e], np.asarray(src["self_attn"]["k_proj"]["kernel"],
                                                                      np.float32).reshape(32, -1).T)
    gate_up = unpack(np.asarray(layer["mlp"]["gate_up_proj"]["kernel_p"], np.float32), 96)
    np.testing.assert_array_equal(gate_up[48:], np.asarray(src["mlp"]["up_proj"]["kernel"], np.float32).T)
    np.testing.assert_array_equal(np.asarray(layer["self_attn"]["q_norm"]["scale"]),
                                  np.asarray(src["self_attn"]["q_norm"]["scale"]))
    assert layer["self_attn"]["o_proj"]["bias"] is src["self_attn"]["o_proj"]["bias"]
    with pytest.raises(ValueError, match="already in the CPU layout"):
        to_cpu_layout(cpu, c)


def test_tied_embedding_is_packed_once_and_looked_up_from_the_panels():
    c = LlamaConfig(vocab_size=70, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=8, tie_word_embeddings=True)
    params = init_params(c, jax.random.key(3))
    cpu = to_cpu_layout(params, c)
    assert set(cpu["embed_tokens"]) == {"embedding_p"} and cpu["embed_tokens"]["embedding_p"].shape == (-(-70 // panel_width()), 16, panel_width())
    table = np.asarray(params["embed_tokens"]["embedding"])  # [V, D]
    ids = jnp.asarray([[0, 31, 32, 69], [69, 5, -3, 7]], jnp.int32)  # a negative (padding) id reads row 0
    np.testing.assert_array_equal(np.asarray(embedding_rows(cpu["embed_tokens"], ids)),
                                  table[np.clip(np.asarray(ids), 0, 69)])
    assert np.isfinite(np.asarray(embedding_rows(cpu["embed_tokens"], jnp.asarray([[500]])))).all()


@pytest.mark.parametrize("tied", [True, False])
def test_weights_that_are_all_bfloat16_values_are_packed_in_bfloat16_with_identical_logits(tied):
    """A float32 model whose weights are bfloat16 values (a bfloat16 checkpoint upcast at load, as every shipped
    model is) gets bfloat16 panels and the same logits, bit for bit, as the same panels held in float32; a matrix
    with one value that is not a bfloat16 stays float32; norms and activations stay float32."""
    c = LlamaConfig(vocab_size=80, hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=12, tie_word_embeddings=tied)
    exact = jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32), init_params(c, jax.random.key(4)))
    down = np.array(exact["layers_1"]["mlp"]["down_proj"]["kernel"])
    down[3, 5] = np.nextafter(down[3, 5], np.float32(1))  # one value a bfloat16 cannot hold
    exact["layers_1"]["mlp"]["down_proj"]["kernel"] = jnp.asarray(down)
    cpu = to_cpu_layout(exact, c)
    leaves = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(cpu)}
    panels = {k: v.dtype for k, v in leaves.items() if k.endswith("_p']")}
    assert panels.pop("['layers_1']['mlp']['down_proj']['kernel_p']") == jnp.float32  # 4 per layer + the LM head remain
    assert len(panels) == 4 * 2 and set(panels.values()) == {jnp.dtype(jnp.bfloat16)}
    assert {v.dtype for k, v in leaves.items() if not k.endswith("_p']")} == {jnp.dtype(jnp.float32)}
    np.testing.assert_array_equal(unpack(np.asarray(cpu["layers_1"]["mlp"]["down_proj"]["kernel_p"]), 48), down.T)
    wide = jax.tree.map(lambda a: a.astype(jnp.float32), cpu)  # the same values, held in float32
    cache = KVCache.allocate(num_layers=2, num_blocks=4, block_size=8, num_kv_heads=2, head_dim=12, dtype=jnp.float32)
    for t in (5, 1):
        tokens = jnp.asarray(np.random.default_rng(t).integers(0, 80, size=(2, t)), jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(3, 3 + t, dtype=jnp.int32), (2, t))
        slots = jnp.concatenate([positions[:1], positions[1:] + 16])  # row 1 in blocks 2 and 3
        args = (cache, tokens, positions, slots, jnp.asarray([[0, 1], [2, 3]], jnp.int32))
        step = jax.jit(_step_fn(c, t))
        narrow_logits, wide_logits = step(cpu, *args)[0], step(wide, *args)[0]
        assert narrow_logits.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(narrow_logits), np.asarray(wide_logits))
        np.testing.assert_allclose(np.asarray(narrow_logits), np.asarray(step(exact, *args)[0]), rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- which kernels run


def _step_fn(config: LlamaConfig, t: int):
    def step(params, kv_cache, tokens, positions, slots, tables):
        md = AttentionMetadata(slot_mapping=slots, block_tables=tables)
        idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens.shape)  # logits at every position
        logits, _, kv_cache = forward(params, tokens, positions, kv_cache, md, config=config, logits_indices=idx)
        return logits, kv_cache

    return step


def _engine_compiled_text(config: LlamaConfig, params, t: int) -> str:
    """HLO text of the step the engine would compile for one row of ``t`` query tokens."""
    cache = KVCache.allocate(num_layers=config.num_hidden_layers, num_blocks=4, block_size=8,
                             num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim, dtype=jnp.float32)
    positions = jnp.arange(3, 3 + t, dtype=jnp.int32)[None]  # [1, T]
    args = (params, cache, jnp.zeros((1, t), jnp.int32), positions, positions, jnp.arange(4, dtype=jnp.int32)[None])
    buckets = CompiledBuckets("verify_cost_test", jax.jit(_step_fn(config, t), donate_argnums=(1,)), lambda _: args)
    return buckets.get(t).as_text()


def _run_step(config: LlamaConfig, params, t: int) -> jax.Array:
    """The logits of one row of ``t`` query tokens, through the step of :func:`_engine_compiled_text`."""
    cache = KVCache.allocate(num_layers=config.num_hidden_layers, num_blocks=4, block_size=8,
                             num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim, dtype=jnp.float32)
    positions = jnp.arange(3, 3 + t, dtype=jnp.int32)[None]  # [1, T]
    tokens = jnp.arange(7, 7 + t, dtype=jnp.int32)[None]
    return jax.jit(_step_fn(config, t))(params, cache, tokens, positions, positions,
                                        jnp.arange(4, dtype=jnp.int32)[None])[0]


def _entry(text: str) -> str:
    return text.split("\nENTRY ")[1]


def _calls(entry: str, target: str = TARGET) -> list[str]:
    return [line for line in entry.splitlines() if "custom-call(" in line and f'"{target}"' in line]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the XLA:CPU executable")
@pytest.mark.parametrize("tied", [True, False])
def test_engine_executables_run_every_projection_and_attention_through_the_cpu_kernels(tied, monkeypatch):
    c = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tied)
    params = init_params(c, jax.random.key(1))
    cpu = to_cpu_layout(params, c)
    for t in (5, 1):  # a K = 4 verify and a one-token step: the same kernels, no dot left
        entry = _entry(_engine_compiled_text(c, cpu, t))  # each layer one fused call, then the LM head
        assert len(_calls(entry, LAYER_TARGET)) == c.num_hidden_layers, entry
        assert len(_calls(entry)) == 1 and not _calls(entry, ATTENTION_TARGET), entry
        assert " dot(" not in entry
    monkeypatch.setattr(llama, "FUSE_CPU_LAYERS", False)
    weights = 4 * c.num_hidden_layers + 1  # qkv, o, gate_up, down per layer + the LM head
    for t in (5, 1):  # the layers as separate operations
        entry = _entry(_engine_compiled_text(c, cpu, t))
        assert len(_calls(entry)) == weights, entry
        assert len(_calls(entry, ATTENTION_TARGET)) == c.num_hidden_layers, entry
        assert not _calls(entry, LAYER_TARGET) and " dot(" not in entry
    before = _entry(_engine_compiled_text(c, params, 5))  # checkpoint layout: XLA's own kernels
    assert not _calls(before) and "custom-call(" not in before


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU kernels")
@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.bfloat16])
def test_fused_decoder_layers_match_the_layers_as_separate_operations(cache_dtype, monkeypatch):
    """Two rows of 5 query tokens (row 1 half padding: slots -1), GQA, over caches holding earlier keys: the fused
    layers give the separate operations' logits and write the same slots, and no other."""
    c = LlamaConfig(vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                    num_attention_heads=6, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5)
    cpu = to_cpu_layout(init_params(c, jax.random.key(3)), c)
    rng = np.random.default_rng(4)
    slots = 8 * 8
    filled = [jnp.asarray(rng.standard_normal((slots, 2, 16)), cache_dtype) for _ in range(4)]
    positions = jnp.asarray([[9, 10, 11, 12, 13], [3, 4, 0, 0, 0]], jnp.int32)
    tables = jnp.asarray([[5, 1, -1, -1], [2, 7, -1, -1]], jnp.int32)
    slot_mapping = jnp.asarray([[41, 42, 43, 44, 45], [19, 20, -1, -1, -1]], jnp.int32)  # 5 * 8 + 1 = 41, ...
    tokens = jnp.asarray(rng.integers(0, 300, (2, 5)), jnp.int32)
    md = AttentionMetadata(slot_mapping=slot_mapping, block_tables=tables)

    def run():  # traced anew for each setting of FUSE_CPU_LAYERS
        cache = KVCache(k=tuple(filled[:2]), v=tuple(filled[2:]), block_size=8)
        step = jax.jit(lambda p, k: forward(p, tokens, positions, k, md, config=c))
        calls = step.lower(cpu, cache).as_text().count(LAYER_TARGET)
        logits, _, cache = step(cpu, cache)
        return np.asarray(logits), [np.asarray(a, np.float32) for a in cache.k + cache.v], calls

    fused, fused_cache, calls = run()
    assert calls == c.num_hidden_layers
    monkeypatch.setattr(llama, "FUSE_CPU_LAYERS", False)
    separate, separate_cache, calls = run()
    assert calls == 0
    np.testing.assert_allclose(fused[0], separate[0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(fused[1, :2], separate[1, :2], rtol=2e-5, atol=2e-5)
    written = np.asarray([41, 42, 43, 44, 45, 19, 20])
    for before, a, b in zip(filled[:2] + filled[2:], fused_cache, separate_cache):
        untouched = np.setdiff1d(np.arange(slots), written)
        np.testing.assert_array_equal(a[untouched], np.asarray(before, np.float32)[untouched])
        tol = 1e-2 if cache_dtype == jnp.bfloat16 else 2e-5  # one bfloat16 rounding step apart at most
        np.testing.assert_allclose(a[written], b[written], rtol=tol, atol=tol)
        assert not np.allclose(a[written], np.asarray(before, np.float32)[written])


def test_fused_decoder_layer_takes_only_layers_it_computes_and_refuses_bad_inputs():
    from models.cpu_kernels.decoder_layer import decoder_layer, fused_weights

    c = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8)
    layer = to_cpu_layout(init_params(c, jax.random.key(0)), c)["layers_0"]
    weights = fused_weights(layer)
    assert weights is not None and set(weights) == {"in_scale", "post_scale", "qkv_p", "o_p", "gate_up_p", "down_p"}
    attn = layer["self_attn"]
    with_bias = {**layer, "self_attn": {**attn, "qkv_proj": {**attn["qkv_proj"], "bias": jnp.zeros(32)}}}
    bf16_norm = {**layer, "input_layernorm": {"scale": layer["input_layernorm"]["scale"].astype(jnp.bfloat16)}}
    assert fused_weights(with_bias) is None and fused_weights(bf16_norm) is None

    x, pos = jnp.zeros((1, 2, 32), jnp.float32), jnp.zeros((1, 2), jnp.int32)
    cache, tables, rope = jnp.zeros((16, 2, 8), jnp.float32), jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2, 8))
    kw = dict(weights=weights, num_heads=4, intermediate=48, block_size=8, eps=1e-6)
    out, k, v = decoder_layer(x, pos, pos, tables, cache, cache, rope, **kw)
    assert out.shape == x.shape and k.shape == v.shape == cache.shape
    with pytest.raises(ValueError, match="x must be float32"):
        decoder_layer(x.astype(jnp.bfloat16), pos, pos, tables, cache, cache, rope, **kw)
    with pytest.raises(ValueError, match="rope"):
        decoder_layer(x, pos, pos, tables, cache, cache, rope[..., :4], **kw)
    with pytest.raises(ValueError, match="num_heads=3"):
        decoder_layer(x, pos, pos, tables, cache, cache, rope, **{**kw, "num_heads": 3})
    with pytest.raises(ValueError, match="block_size=5"):
        decoder_layer(x, pos, pos, tables, cache, cache, rope, **{**kw, "block_size": 5})
    with pytest.raises(ValueError, match=r"weights\['o_p'\]"):
        decoder_layer(x, pos, pos, tables, cache, cache, rope, **{**kw, "weights": {**weights, "o_p": weights["qkv_p"]}})


def test_last_level_cache_bytes_reads_the_largest_cache_of_sysfs(tmp_path):
    for index, size in enumerate(("48K", "32K", "2048K", "307200K")):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    (tmp_path / "index4").mkdir()  # no size file: skipped
    assert cpu_layout.last_level_cache_bytes(str(tmp_path)) == 307200 * 1024
    assert cpu_layout.last_level_cache_bytes(str(tmp_path / "absent")) is None


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the XLA:CPU executable")
@pytest.mark.parametrize("fused", [True, False])
def test_a_model_beyond_the_last_level_cache_runs_every_product_with_the_streaming_prefetch(fused, monkeypatch):
    """``stream`` is set on each panel product and fused layer of a model whose weights exceed the last-level cache
    (here made small), and nowhere when they fit or the cache size is unknown; the logits are the same."""
    monkeypatch.setattr(llama, "FUSE_CPU_LAYERS", fused)
    c = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    cpu = to_cpu_layout(init_params(c, jax.random.key(1)), c)
    size = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(cpu))
    logits = {}
    for llc, stream in ((size - 1, "true"), (size, "false"), (None, "false")):
        monkeypatch.setattr(cpu_layout, "last_level_cache_bytes", lambda llc=llc: llc)
        entry = _entry(_engine_compiled_text(c, cpu, 5))
        calls = _calls(entry) + _calls(entry, LAYER_TARGET)
        assert len(calls) == (c.num_hidden_layers + 1 if fused else 4 * c.num_hidden_layers + 1), entry
        assert all(f"stream = {stream}" in call for call in calls), calls
        logits[llc] = np.asarray(_run_step(c, cpu, 5))
    np.testing.assert_array_equal(logits[size - 1], logits[size])


# --------------------------------------------------------------------------- what the engine runs


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the layout choice for CPU devices")
def test_engine_runs_the_cpu_layout_on_cpu_and_the_checkpoint_layout_when_asked(tmp_path, monkeypatch):
    """On one CPU device the engine's target and draft model run in the derived layout (``auto`` and ``cpu``),
    giving the same greedy tokens as the checkpoint layout; several devices keep the checkpoint layout (``cpu``
    refuses them); layout names are checked."""
    import specjax
    from specjax.backends import use_cpu_weight_layout

    cpu, two_cpus, gpu = jax.devices("cpu")[:1], [SimpleNamespace(platform="cpu")] * 2, [SimpleNamespace(platform="gpu")]
    monkeypatch.setenv("SPECJAX_WEIGHT_LAYOUT", "auto")
    assert use_cpu_weight_layout(cpu)
    assert not use_cpu_weight_layout(two_cpus) and not use_cpu_weight_layout(gpu)
    monkeypatch.setenv("SPECJAX_WEIGHT_LAYOUT", "cpu")
    for devices in (two_cpus, gpu):
        with pytest.raises(ValueError, match="one CPU device"):
            use_cpu_weight_layout(devices)
    monkeypatch.setenv("SPECJAX_WEIGHT_LAYOUT", "checkpoint")
    assert not use_cpu_weight_layout(cpu)

    d = make_tiny_checkpoint(tmp_path / "m", "llama", num_heads=4, num_kv_heads=2)
    spec = {"method": "draft_model", "model": str(d), "num_speculative_tokens": 3, "adaptive": False}
    prompts = [{"prompt_token_ids": [1, 5, 9, 13, 2, 7]}, {"prompt_token_ids": [3, 4, 5, 6, 7, 8, 9]}]
    sp = specjax.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    runs = {}
    for layout in ("cpu", "auto", "checkpoint"):
        monkeypatch.setenv("SPECJAX_WEIGHT_LAYOUT", layout)
        llm = specjax.LLM(str(d), speculative_config=spec, max_model_len=64, max_num_seqs=2, warmup=False)
        target, (draft, _) = llm.runner.params
        assert llm.runner.cpu_weight_layout == is_cpu_layout(target) == is_cpu_layout(draft) == (layout != "checkpoint")
        runs[layout] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert runs["cpu"] == runs["auto"] == runs["checkpoint"]
    monkeypatch.setenv("SPECJAX_WEIGHT_LAYOUT", "fused")
    with pytest.raises(ValueError, match="SPECJAX_WEIGHT_LAYOUT"):
        specjax.LLM(str(d), max_model_len=64, warmup=False)


def test_cpu_layout_cannot_be_sharded():
    from specjax.parallel.sharding import param_partition_specs

    c = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8)
    cpu = to_cpu_layout(init_params(c, jax.random.key(0)), c)
    assert all(all(a is None for a in s) for s in jax.tree.leaves(
        param_partition_specs(cpu, c, tp=1), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))
    with pytest.raises(ValueError, match="kernel_p is in the one-device CPU layout"):
        param_partition_specs(cpu, c, tp=2)
