"""``speculative_config.quantization="q8_0"``: a draft model's or head's weights as Q8_0 blocks with int8
activations on the CPU. The quantizer on exact vectors, the layouts it builds, lossless output with it, refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from models.cpu_kernels.panel_matmul import available as cpu_kernels_available
from models.cpu_layout import dequantize_q8_0, model_q8_0, quantize_q8_0, to_cpu_layout
from models.heads import HeadConfig, head_to_cpu_layout, init_head_params
from models.loading import load_model
from specjax.parallel import sharding
from tiny_models import make_tiny_checkpoint

needs_kernels = pytest.mark.skipif(jax.default_backend() != "cpu" or not cpu_kernels_available(),
                                   reason="the C++ CPU kernels")
KW = dict(max_model_len=64, max_num_seqs=2, block_size=8, max_prefill_chunk=16, warmup=False)


def test_quantize_q8_0_recovers_the_blocks_a_weight_was_made_of():
    rng = np.random.default_rng(0)
    n, k = 5, 96
    q = rng.integers(-127, 128, size=(n, k // 32, 32)).astype(np.int8)
    q[..., 0] = np.where(rng.random((n, k // 32)) < 0.5, 127, -127)  # each block reaches +-127: d = max|w| / 127
    d = rng.uniform(1e-3, 2.0, size=(n, k // 32)).astype(np.float16)
    d[2, 1] = 0  # an all-zero block
    q[2, 1] = 0
    w = (q.astype(np.float32) * d.astype(np.float32)[..., None]).reshape(n, k)  # exact in float32
    m = quantize_q8_0(w)
    assert m.kind == "q8_0" and m.q.dtype == np.int8 and m.d.dtype == np.float16
    np.testing.assert_array_equal(m.q, q.reshape(n, k))
    np.testing.assert_array_equal(m.d, d)
    np.testing.assert_array_equal(dequantize_q8_0(m), w)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(np.ones((2, 48), np.float32))


def test_q8_0_rounds_each_weight_to_within_half_a_step_of_its_block():
    w = np.random.default_rng(1).normal(size=(64, 256)).astype(np.float32)
    w[3, :32] *= 1e4  # blocks of very different scales
    m = quantize_q8_0(w)
    step = np.repeat(m.d.astype(np.float32), 32, axis=1)  # [N, K]: each weight's block scale
    assert np.all(np.abs(dequantize_q8_0(m) - w) <= 0.5 * step * (1 + 1e-6))
    assert np.all(np.abs(m.q.astype(np.int32)) <= 127)


def _prefill_logits(config, params, tokens):
    from models.llama import forward
    from specjax.kv_cache import AttentionMetadata, KVCache

    t = len(tokens)
    kv = KVCache.allocate(num_layers=config.num_hidden_layers, num_blocks=4, block_size=16,
                          num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim, dtype=jnp.float32)
    md = AttentionMetadata(slot_mapping=jnp.arange(t, dtype=jnp.int32)[None], block_tables=jnp.arange(4)[None])
    logits, _, _ = forward(params, jnp.asarray([tokens], jnp.int32), jnp.arange(t, dtype=jnp.int32)[None], kv, md,
                           config=config, logits_indices=jnp.arange(t, dtype=jnp.int32)[None])
    return np.asarray(logits[0])


@needs_kernels
@pytest.mark.parametrize("tied", [False, True])
def test_q8_0_draft_layout_is_int8_everywhere_and_approximates_the_float_logits(tmp_path, tied):
    path = make_tiny_checkpoint(tmp_path / "m", num_kv_heads=2, tie_word_embeddings=tied, seed=3)
    config, params = load_model(path)
    deq, blocks = model_q8_0(params, config)
    expect = {f"layers_{i}/{g}/{p}" for i in range(config.num_hidden_layers)
              for g, ps in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                            ("mlp", ("gate_proj", "up_proj", "down_proj"))) for p in ps}
    assert set(blocks) == expect | {"embed_tokens" if tied else "lm_head"}
    q8 = to_cpu_layout(deq, config, quantized=blocks, int8_activations=True)
    panels = {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(q8)
              if "_p'" in jax.tree_util.keystr(path)}
    assert len(panels) == 4 * config.num_hidden_layers + 1
    assert all(leaf.dtype == np.int32 for leaf in panels.values())  # Q8_0 in the int8-activation layout
    tokens = [1, 5, 9, 2, 7, 7, 30, 4]
    ours = _prefill_logits(config, q8, tokens)
    exact = _prefill_logits(config, to_cpu_layout(params, config), tokens)
    # Close to the float model's (weights and activations rounded to 8 bits per block of 32: 4.1-4.4% of the
    # logits' norm on these random tiny models); a misplaced block or scale would be ~100% off.
    assert not np.array_equal(ours, exact)
    assert np.linalg.norm(ours - exact) < 0.1 * np.linalg.norm(exact)


@needs_kernels
def test_q8_0_head_layout_quantizes_its_layer_fc_and_lm_head(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "t", num_kv_heads=2, seed=4)
    target_config, _ = load_model(path)
    head = HeadConfig.for_target("eagle3", target_config, draft_vocab_size=64)
    params = init_head_params(head, jax.random.key(0))
    q8 = head_to_cpu_layout(params, head, q8_0=True)
    floats = head_to_cpu_layout(params, head)
    for name in ("fc", "fc_aux", "lm_head"):
        if name in params:
            assert q8[name]["kernel_p"].dtype == np.int32, name
            assert floats[name]["kernel_p"].dtype != np.int32, name
    for entry in (q8["layer"]["self_attn"]["qkv_proj"], q8["layer"]["mlp"]["down_proj"]):
        assert entry["kernel_p"].dtype == np.int32
    medusa = HeadConfig.for_target("medusa", target_config)
    with pytest.raises(ValueError, match="no Q8_0 layout"):
        head_to_cpu_layout(init_head_params(medusa, jax.random.key(1)), medusa, q8_0=True)


def _proposer_panels(llm):
    return [leaf for leaf in jax.tree.leaves(llm.engine.runner.params[1]) if getattr(leaf, "ndim", 0) == 3]


@needs_kernels
@pytest.mark.parametrize("spec", [
    {"method": "draft_model", "model": "builtin:draft", "num_speculative_tokens": 3},
    {"method": "eagle3", "model": "builtin:eagle3", "num_speculative_tokens": 3},
], ids=["draft_model", "eagle3"])
def test_q8_0_drafts_keep_output_exact(spec):
    """The shipped pair with its draft quantized: greedy output is plain decoding's (the target verifies every
    draft), and the drafts are still good enough to be accepted. (Sampled: test_spec_decode's distribution test.)"""
    kw = dict(KW, max_model_len=96)
    prompts = ["def parse(line):\n    ", "import os\n\nclass Config:\n"]
    greedy = specjax.SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = specjax.LLM("builtin:target", **kw)
    llm = specjax.LLM("builtin:target", speculative_config={**spec, "quantization": "q8_0"}, **kw)
    panels = _proposer_panels(llm)
    assert panels and all(p.dtype == np.int32 for p in panels)
    ids = lambda m, p: [o.outputs[0].token_ids for o in m.generate(prompts, p, use_tqdm=False)]  # noqa: E731
    assert ids(llm, greedy) == ids(plain, greedy)
    assert llm.get_metrics()["acceptance_rate"] > 0.3


@pytest.mark.parametrize("spec,field", [
    ({"method": "draft_model", "model": "builtin:draft", "quantization": "q4_0"}, "quantization must be one of"),
    ({"method": "ngram", "quantization": "q8_0"}, "quantization='q8_0'.*method='ngram'"),
    ({"method": "medusa", "model": "builtin:medusa", "quantization": "q8_0"}, "quantization='q8_0'.*method='medusa'"),
])
def test_quantization_is_validated_naming_the_field(spec, field):
    with pytest.raises(ValueError, match=field):
        specjax.LLM("builtin:target", speculative_config={**spec, "num_speculative_tokens": 2}, **KW)


def test_quantization_is_refused_off_the_cpu_layout_before_any_weights_load(monkeypatch):
    import specjax.spec_decode.draft_model as draft_model
    import specjax.spec_decode.heads as heads

    monkeypatch.setattr(sharding, "use_cpu_weight_layout", lambda devices: False)
    monkeypatch.setattr(specjax.llm, "load_model", lambda *a, **k: pytest.fail("loaded the target"))
    monkeypatch.setattr(draft_model, "load_model", lambda *a, **k: pytest.fail("loaded the draft"))
    monkeypatch.setattr(heads, "load_head", lambda *a, **k: pytest.fail("loaded the head"))
    for spec in ({"method": "draft_model", "model": "builtin:draft"}, {"method": "eagle3", "model": "builtin:eagle3"}):
        with pytest.raises(ValueError, match="speculative_config.quantization='q8_0' needs the CPU kernels"):
            specjax.LLM("builtin:target", speculative_config={**spec, "num_speculative_tokens": 2,
                                                              "quantization": "q8_0"}, **KW)


def test_auto_resolves_to_q8_0_only_for_the_built_in_drafts_on_the_cpu_layout(monkeypatch):
    from specjax.config import SpeculativeConfig

    mesh = sharding.make_mesh()
    resolve = lambda **spec: sharding.resolve_draft_quantization(  # noqa: E731
        mesh, SpeculativeConfig.from_dict({"num_speculative_tokens": 2, **spec})).quantization
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2}).quantization == "auto"
    monkeypatch.setattr(sharding, "use_cpu_weight_layout", lambda devices: True)
    for model in ("builtin:draft", "builtin:eagle3", "builtin:smollm2_eagle3"):
        method = "draft_model" if model == "builtin:draft" else "eagle3"
        assert resolve(method=method, model=model) == "q8_0"
        assert resolve(method=method, model=model, quantization=None) is None  # None: the weights as stored
    # Derived fields stay as validated (rates from a length: constructing the config again would refuse both).
    assert resolve(method="draft_model", model="builtin:draft", rejection_sample_method="synthetic",
                   synthetic_acceptance_length=2.0) == "q8_0"
    assert resolve(method="draft_model", model="/some/draft") is None  # a user's draft runs as given
    assert resolve(method="medusa", model="builtin:medusa") is None
    assert resolve(method="medusa", model="builtin:eagle3") is None  # (a mismatch the head's loader refuses)
    assert resolve(method="ngram") is None
    monkeypatch.setattr(sharding, "use_cpu_weight_layout", lambda devices: False)
    assert resolve(method="draft_model", model="builtin:draft") is None  # no error: off the layout it is None


@needs_kernels
def test_the_shipped_draft_runs_in_q8_0_blocks_unless_quantization_is_none():
    spec = {"method": "draft_model", "model": "builtin:draft", "num_speculative_tokens": 2}
    auto = specjax.LLM("builtin:target", speculative_config=spec, **KW)
    assert auto.speculative_config.quantization == "q8_0"
    assert all(p.dtype == np.int32 for p in _proposer_panels(auto))
    stored = specjax.LLM("builtin:target", speculative_config={**spec, "quantization": None}, **KW)
    assert stored.speculative_config.quantization is None
    assert not any(p.dtype == np.int32 for p in _proposer_panels(stored))


@needs_kernels
def test_quantization_names_the_field_for_a_width_q8_0_cannot_split(tmp_path):
    target = make_tiny_checkpoint(tmp_path / "t", vocab_size=64, seed=5)
    draft = make_tiny_checkpoint(tmp_path / "d", vocab_size=64, hidden_size=16, num_heads=2, num_layers=1, seed=6)
    with pytest.raises(ValueError, match="speculative_config.quantization: .*multiple of 32"):
        specjax.LLM(str(target), speculative_config={"model": str(draft), "num_speculative_tokens": 2,
                                                     "quantization": "q8_0"}, **KW)
