"""models/llama.py + models/loading.py against transformers (tiny random checkpoints, CPU).

Every case builds a tiny HF checkpoint with ``tiny_models.make_tiny_checkpoint``,
loads it with ``load_hf_model`` and compares our paged-KV forward with the
transformers torch model loaded from the same directory.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_models import load_hf_torch_model, make_tiny_checkpoint  # noqa: E402

from models.llama import LlamaConfig, forward, init_params, lm_head_logits, num_params, rope_inv_freq  # noqa: E402
from models.loading import load_hf_model, load_tokenizer, read_generation_eos  # noqa: E402
from specjax.kv_cache import AttentionMetadata, KVCache  # noqa: E402

BLOCK_SIZE = 4
NUM_BLOCKS = 20  # 80 slots: room for two rows of 32 tokens plus unused blocks
MAX_BLOCKS = 8  # block-table width: 32 tokens per row
WIDTH = 16  # padded query width of every multi-token call (one compile per case)
PROMPT_LENS = (16, 11)  # ragged rows
NEW_TOKENS = 16

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small on purpose: with head_dim 16 this puts frequencies in all three bands.
    "original_max_position_embeddings": 16,
}
CASES = {
    "llama_mha": dict(family="llama"),
    "llama_gqa": dict(family="llama", num_kv_heads=2),
    "llama_mqa": dict(family="llama", num_kv_heads=1),
    "llama3_rope": dict(family="llama", num_kv_heads=2, rope_scaling=LLAMA3_ROPE),
    "llama_linear_rope_bias": dict(family="llama", num_kv_heads=2, rope_scaling={"rope_type": "linear", "factor": 2.0}, attention_bias=True),
    "qwen2": dict(family="qwen2", num_kv_heads=2),
    "qwen3": dict(family="qwen3", num_kv_heads=2, head_dim=24),  # head_dim * heads != hidden
    "mistral": dict(family="mistral", num_kv_heads=2),
    "tied": dict(family="qwen2", num_kv_heads=1, tie_word_embeddings=True),
}

_forward = jax.jit(forward, static_argnames=("config",), donate_argnames=("kv_cache",))


# --------------------------------------------------------------------------- helpers


class PagedRows:
    """Test-side block bookkeeping: each row owns randomly chosen (shuffled) physical blocks."""

    def __init__(self, rng: np.random.Generator, tokens_needed: list[int]):
        perm = rng.permutation(NUM_BLOCKS)
        self.tables = np.full((len(tokens_needed), MAX_BLOCKS), -1, np.int32)  # [B, M]; -1 = unused
        used = 0
        for b, n in enumerate(tokens_needed):
            nb = -(-n // BLOCK_SIZE)
            assert nb <= MAX_BLOCKS and used + nb <= NUM_BLOCKS
            self.tables[b, :nb] = perm[used : used + nb]
            used += nb

    def slot(self, b: int, pos: int) -> int:
        block = self.tables[b, pos // BLOCK_SIZE]
        assert block >= 0
        return int(block * BLOCK_SIZE + pos % BLOCK_SIZE)

    def batch(self, row_tokens: list[list[int]], starts: list[int], width: int):
        """Pad each row's new tokens (at positions start, start+1, ...) to ``width``; empty row = padding."""
        b = len(row_tokens)
        tokens = np.zeros((b, width), np.int32)
        positions = np.zeros((b, width), np.int32)  # padding queries: position 0, slot -1
        slots = np.full((b, width), -1, np.int32)
        for i, (toks, start) in enumerate(zip(row_tokens, starts)):
            assert len(toks) <= width
            for j, tok in enumerate(toks):
                tokens[i, j] = tok
                positions[i, j] = start + j
                slots[i, j] = self.slot(i, start + j)
        meta = AttentionMetadata(slot_mapping=jnp.asarray(slots), block_tables=jnp.asarray(self.tables))
        return jnp.asarray(tokens), jnp.asarray(positions), meta


def new_cache(config: LlamaConfig, dtype=jnp.float32) -> KVCache:
    return KVCache.allocate(
        num_layers=config.num_hidden_layers,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        dtype=dtype,
    )


def hf_logits(hf_model, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float().numpy()  # [T, V]


def assert_logits_close(ours, ref, rel=1e-4):
    ours, ref = np.asarray(ours), np.asarray(ref)
    scale = max(1.0, float(np.abs(ref).max()))
    np.testing.assert_allclose(ours, ref, rtol=0, atol=rel * scale)


def greedy_reference_loop(config, params, prompts, max_new_tokens, eos_ids, rng):
    """Plain greedy decoding with our ``forward``: one padded prefill, then 1-token decode steps.

    Rows run in lockstep through the paged cache; a row that emitted EOS becomes padding.
    """
    rows = PagedRows(rng, [len(p) + max_new_tokens for p in prompts])
    cache = new_cache(config)
    tokens, positions, meta = rows.batch([list(p) for p in prompts], [0] * len(prompts), WIDTH)
    last = jnp.asarray([[len(p) - 1] for p in prompts], jnp.int32)  # [B, 1]
    logits, _, cache = _forward(params, tokens, positions, cache, meta, config=config, logits_indices=last)
    outputs = [[] for _ in prompts]
    done = [False] * len(prompts)
    next_ids = np.asarray(jnp.argmax(logits[:, -1], axis=-1))
    for _ in range(max_new_tokens):
        for b, tok in enumerate(next_ids):
            if not done[b]:
                outputs[b].append(int(tok))
                done[b] = int(tok) in eos_ids or len(outputs[b]) == max_new_tokens
        if all(done):
            break
        step_tokens = [[] if done[b] else [outputs[b][-1]] for b in range(len(prompts))]
        starts = [len(p) + len(o) - 1 for p, o in zip(prompts, outputs)]
        tokens, positions, meta = rows.batch(step_tokens, starts, 1)
        logits, _, cache = _forward(params, tokens, positions, cache, meta, config=config)
        next_ids = np.asarray(jnp.argmax(logits[:, 0], axis=-1))
    return outputs


# --------------------------------------------------------------------------- fixtures


class Case:
    def __init__(self, name, path, config, params, hf_model, prompts):
        self.name, self.path, self.config, self.params, self.hf, self.prompts = name, path, config, params, hf_model, prompts


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory) -> Case:
    name = request.param
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(name), seed=len(name), **CASES[name])
    config, params = load_hf_model(path)
    rng = np.random.default_rng(123)
    prompts = [rng.integers(2, config.vocab_size - 1, size=n).tolist() for n in PROMPT_LENS]
    return Case(name, path, config, params, load_hf_torch_model(path), prompts)


@pytest.fixture(scope="module")
def gqa_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gqa_plain"), "llama", num_kv_heads=2, seed=7)


# --------------------------------------------------------------------------- model vs transformers


def test_config_matches_hf(case: Case):
    hf_cfg, c = case.hf.config, case.config
    assert c.architecture == type(case.hf).__name__
    assert (c.num_attention_heads, c.num_key_value_heads) == (hf_cfg.num_attention_heads, hf_cfg.num_key_value_heads)
    assert c.head_dim == case.hf.model.layers[0].self_attn.head_dim
    assert c.tie_word_embeddings == hf_cfg.tie_word_embeddings
    assert c.attention_bias == (case.hf.model.layers[0].self_attn.q_proj.bias is not None)
    assert c.attention_out_bias == (case.hf.model.layers[0].self_attn.o_proj.bias is not None)
    assert c.qk_norm == hasattr(case.hf.model.layers[0].self_attn, "q_norm")
    assert ("lm_head" in case.params) == (not c.tie_word_embeddings)
    assert num_params(case.params) == sum(p.numel() for p in case.hf.parameters())  # tied counted once by torch
    # RoPE frequencies (default / linear / llama3) equal HF's.
    np.testing.assert_allclose(rope_inv_freq(c), case.hf.model.rotary_emb.inv_freq.numpy(), rtol=1e-6)


def test_prefill_logits_match_transformers(case: Case):
    """Both prompts (ragged) in one padded call through a shuffled block table."""
    c = case.config
    rows = PagedRows(np.random.default_rng(0), [len(p) for p in case.prompts])
    tokens, positions, meta = rows.batch(case.prompts, [0, 0], WIDTH)
    logits, hidden, cache = _forward(case.params, tokens, positions, new_cache(c), meta, config=c)
    assert logits.dtype == jnp.float32 and logits.shape == (2, WIDTH, c.vocab_size)
    assert hidden.shape == (2, WIDTH, c.hidden_size)
    assert isinstance(cache, KVCache) and len(cache.k) == c.num_hidden_layers
    assert cache.k[0].shape == (NUM_BLOCKS * BLOCK_SIZE, c.num_key_value_heads, c.head_dim)
    for b, prompt in enumerate(case.prompts):
        n = len(prompt)
        assert_logits_close(logits[b, :n], hf_logits(case.hf, prompt))
        with torch.no_grad():
            hf_hidden = case.hf.model(torch.tensor([prompt])).last_hidden_state[0].numpy()
        np.testing.assert_allclose(np.asarray(hidden[b, :n]), hf_hidden, atol=1e-4 * max(1, np.abs(hf_hidden).max()))
    # The LM-head helper reproduces the logits from the hidden states.
    np.testing.assert_allclose(lm_head_logits(case.params, hidden, config=c), logits, rtol=1e-5, atol=1e-4)


def test_prefill_chunk_then_decode_matches_full_forward(case: Case):
    """Prefill a prefix, verify a 4-token chunk (like spec-decode verification), then decode token by token."""
    c = case.config
    refs = [hf_logits(case.hf, p) for p in case.prompts]
    rows = PagedRows(np.random.default_rng(1), [len(p) for p in case.prompts])
    cache = new_cache(c)
    done = [0, 0]  # tokens of each row already in the cache

    def run(counts, width):
        nonlocal cache
        chunks = [p[d : d + k] for p, d, k in zip(case.prompts, done, counts)]
        tokens, positions, meta = rows.batch(chunks, done, width)
        logits, _, cache = _forward(case.params, tokens, positions, cache, meta, config=c)
        for b, chunk in enumerate(chunks):
            if chunk:
                assert_logits_close(logits[b, : len(chunk)], refs[b][done[b] : done[b] + len(chunk)])
                done[b] += len(chunk)

    run([5, 3], WIDTH)  # prefill
    run([4, 4], WIDTH)  # multi-token chunk
    while done != [len(p) for p in case.prompts]:  # decode; a finished row becomes padding
        run([min(1, len(p) - d) for p, d in zip(case.prompts, done)], 1)


def test_logits_indices_gather(case: Case):
    c = case.config
    rows = PagedRows(np.random.default_rng(2), [len(p) for p in case.prompts])
    tokens, positions, meta = rows.batch(case.prompts, [0, 0], WIDTH)
    idx = jnp.asarray([[15, 0, 7], [10, 10, 2]], jnp.int32)  # [B, L]
    logits, hidden, _ = _forward(case.params, tokens, positions, new_cache(c), meta, config=c, logits_indices=idx)
    assert logits.shape == (2, 3, c.vocab_size) and hidden.shape == (2, WIDTH, c.hidden_size)
    for b, prompt in enumerate(case.prompts):
        assert_logits_close(logits[b], hf_logits(case.hf, prompt)[np.asarray(idx[b])])


def test_greedy_matches_transformers_generate(case: Case):
    c = case.config
    eos_ids = read_generation_eos(case.path, c)
    assert eos_ids == (c.vocab_size - 1,)  # make_tiny_checkpoint's default EOS
    ours = greedy_reference_loop(c, case.params, case.prompts, NEW_TOKENS, eos_ids, np.random.default_rng(3))
    for prompt, out in zip(case.prompts, ours):
        with torch.no_grad():
            ref = case.hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert out == ref[0, len(prompt) :].tolist()


# --------------------------------------------------------------------------- dtypes, sharding, files


@pytest.mark.parametrize("name", ["qwen3", "tied"])
def test_bfloat16_params_roughly_match(name, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(f"bf16_{name}"), seed=len(name), **CASES[name])
    config, params = load_hf_model(path, dtype="bfloat16")
    assert {x.dtype for x in jax.tree_util.tree_leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    prompt = list(range(3, 3 + WIDTH))
    rows = PagedRows(np.random.default_rng(0), [WIDTH])
    tokens, positions, meta = rows.batch([prompt], [0], WIDTH)
    logits, hidden, cache = _forward(params, tokens, positions, new_cache(config, jnp.bfloat16), meta, config=config)
    assert logits.dtype == jnp.float32 and hidden.dtype == jnp.bfloat16 and cache.k[0].dtype == jnp.bfloat16
    ref = hf_logits(load_hf_torch_model(path), prompt)
    err = np.abs(np.asarray(logits[0]) - ref)
    assert err.max() < 0.05 * np.abs(ref).max(), err.max()
    assert np.mean(np.argmax(logits[0], -1) == np.argmax(ref, -1)) >= 0.8


def test_bfloat16_sharded_file_loads(tmp_path, gqa_dir):
    """A bf16, sharded (index.json) checkpoint: float32 load == HF's float32 view of the same file."""
    path = make_tiny_checkpoint(tmp_path / "ckpt", "llama", num_kv_heads=2, seed=7, dtype="bfloat16", max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 1
    config, params = load_hf_model(path, dtype="float32")
    config_ref, params_ref = load_hf_model(gqa_dir)  # same weights, fp32, single file
    assert config == config_ref
    # The bf16 file holds the fp32 weights rounded to bf16.
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(params_ref)):
        assert a.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jnp.bfloat16).astype(jnp.float32)))
    hf = load_hf_torch_model(path, torch.float32)
    prompt = list(range(5, 5 + WIDTH))
    rows = PagedRows(np.random.default_rng(0), [WIDTH])
    tokens, positions, meta = rows.batch([prompt], [0], WIDTH)
    logits, _, _ = _forward(params, tokens, positions, new_cache(config), meta, config=config)
    assert_logits_close(logits[0], hf_logits(hf, prompt))
    # bf16 load of a bf16 file is exact.
    _, params_bf16 = load_hf_model(path, dtype=jnp.bfloat16)
    for a, b in zip(jax.tree_util.tree_leaves(params_bf16), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b))


def test_tokenizer_and_generation_eos(tmp_path, gqa_dir):
    assert load_tokenizer(gqa_dir) is None
    d = tmp_path / "m"
    shutil.copytree(gqa_dir, d)
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.save(str(d / "tokenizer.json"))
    assert load_tokenizer(d).token_to_id("b") == 1
    config, _ = load_hf_model(d)
    assert read_generation_eos(d, config) == (127,)
    gen = json.loads((d / "generation_config.json").read_text())
    gen["eos_token_id"] = [5, 6]
    (d / "generation_config.json").write_text(json.dumps(gen))
    assert read_generation_eos(d, config) == (5, 6)
    (d / "generation_config.json").unlink()
    assert read_generation_eos(d, config) == config.eos_token_ids == (127,)


def test_loading_errors(tmp_path, gqa_dir):
    with pytest.raises(ValueError, match="not a directory"):
        load_hf_model(tmp_path / "nope")
    with pytest.raises(ValueError, match="dtype"):
        load_hf_model(gqa_dir, dtype="float16")
    with pytest.raises(ValueError, match="dtype"):
        load_hf_model(gqa_dir, dtype="fp32")

    no_cfg = tmp_path / "no_cfg"
    shutil.copytree(gqa_dir, no_cfg)
    (no_cfg / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json"):
        load_hf_model(no_cfg)

    no_st = tmp_path / "no_st"
    shutil.copytree(gqa_dir, no_st)
    (no_st / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="safetensors"):
        load_hf_model(no_st)

    bad_arch = tmp_path / "bad_arch"
    shutil.copytree(gqa_dir, bad_arch)
    cfg = json.loads((bad_arch / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad_arch / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_hf_model(bad_arch)

    from safetensors.numpy import load_file, save_file

    missing = tmp_path / "missing_tensor"
    shutil.copytree(gqa_dir, missing)
    tensors = load_file(str(missing / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(missing / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf_model(missing)


# --------------------------------------------------------------------------- config


def _hf_dict(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_from_hf_config_v4_and_v5_rope_forms_agree(case: Case):
    d5 = _hf_dict(case.path)
    assert "rope_parameters" in d5  # transformers 5.x form
    d4 = {k: v for k, v in d5.items() if k != "rope_parameters"}
    rope = dict(d5["rope_parameters"])
    d4["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.pop("rope_type")
    d4["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **rope}  # oldest 4.x spelling
    assert LlamaConfig.from_hf_config(d4) == LlamaConfig.from_hf_config(d5) == case.config


def test_from_hf_config_family_specifics():
    base = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    q2 = LlamaConfig.from_hf_config({**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32, "use_sliding_window": False})
    assert q2.attention_bias and not q2.attention_out_bias and not q2.qk_norm and q2.sliding_window is None
    q3 = LlamaConfig.from_hf_config({**base, "architectures": ["Qwen3ForCausalLM"], "head_dim": 8, "attention_bias": True})
    assert q3.qk_norm and q3.attention_bias and q3.attention_out_bias and q3.head_dim == 8
    m = LlamaConfig.from_hf_config({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 64, "eos_token_id": 2})
    assert m.sliding_window == 64 and m.eos_token_ids == (2,) and m.head_dim == 4
    ll = LlamaConfig.from_hf_config({**base, "architectures": ["LlamaForCausalLM"], "eos_token_id": [3, 4], "rope_theta": 5e5,
                                     "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    assert ll.eos_token_ids == (3, 4) and ll.rope_theta == 5e5 and ll.rope_type == "llama3"
    hash(ll)  # static jit argument
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        LlamaConfig.from_hf_config({**base, "architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="architectures.*supported"):
        LlamaConfig.from_hf_config({**base})


@pytest.mark.parametrize(
    "override, field",
    [
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(head_dim=7), "head_dim"),
        (dict(rms_norm_eps=0.0), "rms_norm_eps"),
        (dict(architecture="GPT2LMHeadModel"), "architecture"),
        (dict(rope_scaling={"rope_type": "linear"}), "rope_scaling"),
    ],
)
def test_config_invariants(override, field):
    kw = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=4)
    with pytest.raises(ValueError, match=field):
        LlamaConfig(**{**kw, **override})


def test_init_params_matches_loaded_layout(case: Case):
    """init_params builds exactly the tree (paths, shapes) the loader produces."""
    rand = jax.eval_shape(lambda k: init_params(case.config, k), jax.random.key(0))
    shapes = lambda t: jax.tree_util.tree_map(lambda x: x.shape, t)  # noqa: E731
    assert shapes(rand) == shapes(case.params)
    assert num_params(rand) == num_params(case.params)


def test_init_params_runs_in_bfloat16():
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, qk_norm=True, attention_bias=True)
    params = init_params(config, jax.random.key(0), jnp.bfloat16)
    assert {x.dtype for x in jax.tree_util.tree_leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    assert float(params["layers_1"]["input_layernorm"]["scale"][0]) == 1.0
    assert float(jnp.std(params["layers_0"]["mlp"]["up_proj"]["kernel"].astype(jnp.float32))) == pytest.approx(0.02, rel=0.2)
    rows = PagedRows(np.random.default_rng(0), [3])
    tokens, positions, meta = rows.batch([[1, 2, 3]], [0], 3)
    logits, _, _ = _forward(params, tokens, positions, new_cache(config, jnp.bfloat16), meta, config=config)
    assert logits.shape == (1, 3, 64) and bool(jnp.all(jnp.isfinite(logits)))
