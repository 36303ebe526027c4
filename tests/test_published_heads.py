"""Published draft heads (EAGLE-3 as its authors and ``speculators`` write it, EAGLE-1, Medusa from FasterDecoding
and vLLM): tiny checkpoints in exactly those layouts (torch names, [out, in] weights, d2t offsets, t2d mask) load,
and their drafts equal a torch reference written from the papers' equations (independent of specjax), fed with
target features from ``transformers``. Through the engine, greedy output equals plain decoding."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import specjax
from models.heads import FusionHead, combine_hidden_states, head_embed, head_greedy_tokens, head_target_logits, \
    load_head, medusa_greedy_tokens, medusa_target_logits
from models.loading import load_hf_model
from models.published_heads import detect_head_method
from specjax.kv_cache import AttentionMetadata, KVCache
from tiny_models import load_hf_torch_model, make_tiny_checkpoint

V, D, LAYERS = 64, 32, 8  # target: vocab, width, depth
H, G, E, F = 4, 2, 8, 64  # head: q heads, kv heads, head dim, ffn
KW = dict(max_model_len=96, max_num_seqs=2, block_size=8, max_prefill_chunk=16, warmup=False)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("target"), family="llama", vocab_size=V, hidden_size=D,
                                num_layers=LAYERS, num_heads=4, num_kv_heads=2, eos_token_id=None, seed=0)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_hf_model(target_dir, "float32")


@pytest.fixture(scope="module")
def hf_target(target_dir):
    return load_hf_torch_model(target_dir)


# --------------------------------------------------------------------------- checkpoints in published layouts


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _w(gen, out_dim, in_dim, scale=1.5):
    return scale * torch.randn(out_dim, in_dim, generator=gen) / math.sqrt(in_dim)


def _norm_w(gen, n):
    return 1.0 + 0.2 * torch.randn(n, generator=gen)


def _layer_tensors(gen, prefix, qkv_in, *, input_norm=True, hidden_norm=False):
    t = {f"{prefix}self_attn.q_proj.weight": _w(gen, H * E, qkv_in),
         f"{prefix}self_attn.k_proj.weight": _w(gen, G * E, qkv_in),
         f"{prefix}self_attn.v_proj.weight": _w(gen, G * E, qkv_in),
         f"{prefix}self_attn.o_proj.weight": _w(gen, D, H * E),
         f"{prefix}mlp.gate_proj.weight": _w(gen, F, D), f"{prefix}mlp.up_proj.weight": _w(gen, F, D),
         f"{prefix}mlp.down_proj.weight": _w(gen, D, F),
         f"{prefix}post_attention_layernorm.weight": _norm_w(gen, D)}
    if input_norm:
        t[f"{prefix}input_layernorm.weight"] = _norm_w(gen, D)
    if hidden_norm:
        t[f"{prefix}hidden_norm.weight"] = _norm_w(gen, D)
    return t


def _llama_cfg(**kw):
    return {"hidden_size": D, "intermediate_size": F, "num_attention_heads": H, "num_key_value_heads": G,
            "head_dim": E, "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "vocab_size": V,
            "max_position_embeddings": 256, "hidden_act": "silu", "rope_theta": 10000.0, **kw}


def _write(path, config, tensors, name="model.safetensors"):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / name))
    return path


def _draft_vocab(gen, size):
    ids = torch.sort(torch.randperm(V, generator=gen)[:size]).values
    return ids, ids - torch.arange(size), torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True)


def eagle3_authors(path, *, seed=0, aux=None, draft_vocab=40, rope_scaling=None):
    """SafeAILab EAGLE-3: midlayer.*, fc [D, 3D], norm, lm_head [Vd, D], d2t offsets (int64), t2d (bool)."""
    gen = _gen(seed)
    ids, d2t, t2d = _draft_vocab(gen, draft_vocab)
    t = {"fc.weight": _w(gen, D, 3 * D), "norm.weight": _norm_w(gen, D), "lm_head.weight": _w(gen, draft_vocab, D, 4),
         "d2t": d2t.to(torch.int64), "t2d": t2d, **_layer_tensors(gen, "midlayer.", 2 * D, hidden_norm=True)}
    cfg = _llama_cfg(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab, model_type="llama")
    if rope_scaling:
        cfg["rope_scaling"] = rope_scaling
    if aux is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True}
    return _write(path, cfg, t)


def eagle3_speculators(path, *, seed=1, aux=(2, 4, 6), draft_vocab=48, embed=True):
    """speculators Eagle3Speculator: layers.0.*, fc with bias, embed_tokens, norm_before_residual."""
    gen = _gen(seed)
    ids, d2t, t2d = _draft_vocab(gen, draft_vocab)
    t = {"fc.weight": _w(gen, D, 3 * D), "fc.bias": 0.2 * torch.randn(D, generator=gen),
         "norm.weight": _norm_w(gen, D), "lm_head.weight": _w(gen, draft_vocab, D, 4), "d2t": d2t, "t2d": t2d,
         **_layer_tensors(gen, "layers.0.", 2 * D, hidden_norm=True)}
    if embed:
        t["embed_tokens.weight"] = 0.5 * torch.randn(V, D, generator=gen)
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": draft_vocab,
           "norm_before_residual": True, "eagle_aux_hidden_state_layer_ids": list(aux),
           "transformer_layer_config": _llama_cfg(model_type="llama"),
           "speculators_config": {"algorithm": "eagle3", "verifier": {"architectures": ["LlamaForCausalLM"]}}}
    return _write(path, cfg, t)


def eagle1_authors(path, *, seed=2):
    """SafeAILab EAGLE-1: fc [D, 2D] with bias over [embedding; feature], layers.0.* with no input_layernorm."""
    gen = _gen(seed)
    t = {"fc.weight": _w(gen, D, 2 * D), "fc.bias": 0.2 * torch.randn(D, generator=gen),
         "embed_tokens.weight": torch.randn(V, D, generator=gen),  # a copy the loaders ignore
         **_layer_tensors(gen, "layers.0.", D, input_norm=False)}
    return _write(path, _llama_cfg(architectures=["LlamaForCausalLM"], model_type="llama"), t)


def medusa_fasterdecoding(path, *, seed=3, heads=3, layers=2):
    """FasterDecoding Medusa: {i}.{j}.linear.{weight,bias} ResBlocks, {i}.{layers}.weight LM heads."""
    gen = _gen(seed)
    t = {}
    for i in range(heads):
        for j in range(layers):
            t[f"{i}.{j}.linear.weight"] = _w(gen, D, D, 1.0)
            t[f"{i}.{j}.linear.bias"] = 0.2 * torch.randn(D, generator=gen)
        t[f"{i}.{layers}.weight"] = _w(gen, V, D, 4)
    cfg = {"medusa_num_heads": heads, "medusa_num_layers": layers, "base_model_name_or_path": "tiny"}
    return _write(path, cfg, t, "medusa_lm_head.safetensors")


def medusa_vllm(path, *, seed=4, heads=2, truncated=24):
    """vLLM MedusaModel: blocks.{i}.layers.{j}.weight (no bias), lm_heads.{i}.weight over token_map."""
    gen = _gen(seed)
    token_map = torch.sort(torch.randperm(V, generator=gen)[:truncated]).values
    t = {"token_map": token_map}
    for i in range(heads):
        t[f"blocks.{i}.layers.0.weight"] = _w(gen, D, D, 1.0)
        t[f"lm_heads.{i}.weight"] = _w(gen, truncated, D, 4)
    cfg = {"architectures": ["MedusaModel"], "num_heads": heads, "num_hidden_layers": 1, "hidden_size": D,
           "vocab_size": V, "truncated_vocab_size": truncated}
    return _write(path, cfg, t)


# --------------------------------------------------------------------------- torch reference (from the papers)


def t_rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def t_rope(x, pos, inv_freq):  # x [T, n, e]: rotate-half RoPE
    f = pos[:, None].double() * inv_freq[None].double()
    cos, sin = torch.cat([f.cos(), f.cos()], -1).float()[:, None], torch.cat([f.sin(), f.sin()], -1).float()[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def t_inv_freq(rope_scaling=None):
    inv = 1.0 / (10000.0 ** (torch.arange(0, E, 2).double() / E))
    if rope_scaling:  # transformers' own llama3 RoPE as the reference frequencies
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        cfg = LlamaConfig(hidden_size=D, num_attention_heads=H, head_dim=E, max_position_embeddings=256,
                          rope_parameters={"rope_theta": 10000.0, **rope_scaling},
                          rope_scaling={"rope_theta": 10000.0, **rope_scaling})
        inv = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")[0].double()
    return inv


def t_attention(t, prefix, a, pos, inv_freq):
    n = a.shape[0]
    q = t_rope((a @ t[prefix + "self_attn.q_proj.weight"].T).view(n, H, E), pos, inv_freq)
    k = t_rope((a @ t[prefix + "self_attn.k_proj.weight"].T).view(n, G, E), pos, inv_freq)
    v = (a @ t[prefix + "self_attn.v_proj.weight"].T).view(n, G, E)
    k, v = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)
    s = torch.einsum("thd,shd->hts", q, k) / math.sqrt(E)
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(n, H * E)
    return o @ t[prefix + "self_attn.o_proj.weight"].T


def t_mlp(t, prefix, x):
    g, u = x @ t[prefix + "mlp.gate_proj.weight"].T, x @ t[prefix + "mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(g) * u) @ t[prefix + "mlp.down_proj.weight"].T


def ref_eagle3_layer(t, prefix, emb, hid, pos, inv_freq, norm_before_residual):
    """EAGLE-3: attention over [norm(embedding); norm(hidden)], residual = the hidden (or its norm)."""
    h_n = t_rms(hid, t[prefix + "hidden_norm.weight"])
    residual = h_n if norm_before_residual else hid
    a = torch.cat([t_rms(emb, t[prefix + "input_layernorm.weight"]), h_n], -1)
    x = residual + t_attention(t, prefix, a, pos, inv_freq)
    return x + t_mlp(t, prefix, t_rms(x, t[prefix + "post_attention_layernorm.weight"]))


def ref_eagle1_layer(t, prefix, emb, hid, pos, inv_freq):
    """EAGLE-1: fc([embedding; feature]) + b, a decoder layer without input norm."""
    x = torch.cat([emb, hid], -1) @ t["fc.weight"].T + t["fc.bias"]
    x = x + t_attention(t, prefix, x, pos, inv_freq)
    return x + t_mlp(t, prefix, t_rms(x, t[prefix + "post_attention_layernorm.weight"]))


def ref_fusion_drafts(layer, to_logits, to_token, embed, tokens, feats, k):
    """Chained greedy drafting by recomputation: entry p = (x_{p+1}, feature_p); a draft's entry feeds back the
    layer output. Returns (K drafts as target ids, target-vocab logits of the first draft)."""
    toks, hid, drafts, first = list(tokens[1:]), feats, [], None
    for _ in range(k):
        out = layer(embed(torch.tensor(toks)), hid, torch.arange(len(toks)))
        logits = to_logits(out[-1])
        first = logits if first is None else first
        drafts.append(to_token(logits))
        toks.append(drafts[-1])
        hid = torch.cat([hid, out[-1:]], 0)
    return drafts, first


def hf_features(hf_target, tokens, layer_ids):
    """(final-normed hidden [T, D], residual streams entering ``layer_ids`` [T, A*D]) from transformers."""
    captured = {}
    hooks = [hf_target.model.layers[i].register_forward_pre_hook(
        lambda m, args, kwargs, i=i: captured.__setitem__(i, (args[0] if args else kwargs["hidden_states"])[0]),
        with_kwargs=True) for i in set(layer_ids)]
    with torch.no_grad():
        out = hf_target.model(input_ids=torch.tensor([tokens]))
    for h in hooks:
        h.remove()
    aux = torch.cat([captured[i] for i in layer_ids], -1) if layer_ids else None
    return out.last_hidden_state[0], aux


# --------------------------------------------------------------------------- specjax side


def specjax_fusion_drafts(hc, hp, target, tokens, feats, k):
    """The engine's recipe: one paged pass over the entries, then K-1 chained one-entry steps."""
    t_config, t_params = target
    n = len(tokens) - 1
    block = 8
    nb = -(-(n + k) // block)
    cache = KVCache.allocate(num_layers=1, num_blocks=nb, block_size=block, num_kv_heads=hc.num_key_value_heads,
                             head_dim=hc.head_dim, dtype=jnp.float32)
    tables = jnp.arange(nb, dtype=jnp.int32)[None]
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    head = FusionHead(hc)
    emb = head_embed(hp, t_params, jnp.asarray(tokens[1:])[None], config=hc)
    f = combine_hidden_states(hp, jnp.asarray(feats.numpy())[None], config=hc)
    x, kc, vc = head.apply({"params": hp}, emb, f, pos, cache.k[0], cache.v[0],
                           AttentionMetadata(slot_mapping=pos, block_tables=tables), block)
    g = x[:, -1:]
    kw = dict(config=hc, target_config=t_config)
    first = head_target_logits(hp, t_params, g, **kw)[0, 0]
    drafts = [int(head_greedy_tokens(hp, t_params, g, **kw)[0, 0])]
    for i in range(1, k):
        p = jnp.asarray([[n - 1 + i]], jnp.int32)
        e = head_embed(hp, t_params, jnp.asarray([[drafts[-1]]]), config=hc)
        g, kc, vc = head.apply({"params": hp}, e, g, p, kc, vc, AttentionMetadata(slot_mapping=p, block_tables=tables),
                               block)
        drafts.append(int(head_greedy_tokens(hp, t_params, g, **kw)[0, 0]))
    return drafts, np.asarray(first)


def _context(seed, n=13):
    return np.random.default_rng(seed).integers(2, V, size=n).tolist()


def _check_logits(first_ref, first_sj, d2t_ids):
    """Target-vocab logits: the reference's at the draft vocabulary, -inf elsewhere."""
    finite = np.isfinite(first_sj)
    assert set(np.flatnonzero(finite).tolist()) == set(d2t_ids)
    np.testing.assert_allclose(first_sj[finite], first_ref[finite], rtol=2e-4, atol=2e-4)


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("variant", ["authors_default_aux", "authors_rope_llama3", "speculators"])
def test_eagle3_published_drafts_equal_the_reference(variant, tmp_path, target, hf_target):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}
    if variant == "speculators":
        path, nbr = eagle3_speculators(tmp_path / "h"), True
        aux, own_embed = [2, 4, 6], True
    else:
        # No fused layers named: vLLM's default (2, L//2, L-3) of the target, counted as layers' inputs.
        path, nbr = eagle3_authors(tmp_path / "h", rope_scaling=rope if variant.endswith("llama3") else None), False
        aux, own_embed = [2, LAYERS // 2, LAYERS - 3], False
    assert detect_head_method(path) == "eagle3"
    with pytest.raises(ValueError, match="target_config") if variant != "speculators" else _nullctx():
        load_head(path)
    hc, hp = load_head(path, target_config=target[0])
    assert hc.layout == "eagle3" and hc.aux_layer_ids == tuple(i - 1 for i in aux)
    t = {k: v.float() if v.is_floating_point() else v for k, v in
         __import__("safetensors.torch", fromlist=["load_file"]).load_file(str(path / "model.safetensors")).items()}
    prefix = "layers.0." if variant == "speculators" else "midlayer."
    inv_freq = t_inv_freq(rope if variant.endswith("llama3") else None)
    table = t["embed_tokens.weight"] if own_embed else hf_target.model.embed_tokens.weight.detach()
    ids = (torch.arange(len(t["d2t"])) + t["d2t"]).tolist()
    tokens = _context(5)
    _, aux_feats = hf_features(hf_target, tokens[:-1], aux)
    g = aux_feats @ t["fc.weight"].T + (t["fc.bias"] if "fc.bias" in t else 0)

    def to_logits(h):
        full = torch.full((V,), float("-inf"))
        full[ids] = t_rms(h, t["norm.weight"]) @ t["lm_head.weight"].T
        return full

    with torch.no_grad():
        ref, ref_first = ref_fusion_drafts(
            lambda e, h, p: ref_eagle3_layer(t, prefix, e, h, p, inv_freq, nbr), to_logits,
            lambda lg: int(lg.argmax()), lambda x: table[x], tokens, g, k=4)
    drafts, first = specjax_fusion_drafts(hc, hp, target, tokens, aux_feats, 4)
    assert drafts == ref
    _check_logits(ref_first.numpy(), first, ids)


def test_eagle1_published_drafts_equal_the_reference(tmp_path, target, hf_target):
    path = eagle1_authors(tmp_path / "h")
    assert detect_head_method(path) == "eagle"
    hc, hp = load_head(path)
    assert hc.layout == "eagle1" and hc.fc_bias and "embed_tokens" not in hp
    from safetensors.torch import load_file

    t = load_file(str(path / "model.safetensors"))
    lm = hf_target.lm_head.weight.detach()
    tokens = _context(6)
    hidden, _ = hf_features(hf_target, tokens[:-1], [])
    with torch.no_grad():
        ref, ref_first = ref_fusion_drafts(
            lambda e, h, p: ref_eagle1_layer(t, "layers.0.", e, h, p, t_inv_freq()), lambda h: h @ lm.T,
            lambda lg: int(lg.argmax()), lambda x: hf_target.model.embed_tokens.weight.detach()[x], tokens, hidden, 4)
    drafts, first = specjax_fusion_drafts(hc, hp, target, tokens, hidden, 4)
    assert drafts == ref
    np.testing.assert_allclose(first, ref_first.numpy(), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("kind", ["fasterdecoding", "vllm"])
def test_medusa_published_drafts_equal_the_reference(kind, tmp_path, target, hf_target):
    path = medusa_fasterdecoding(tmp_path / "h") if kind == "fasterdecoding" else medusa_vllm(tmp_path / "h")
    assert detect_head_method(path) == "medusa"
    hc, hp = load_head(path)
    from safetensors.torch import load_file

    t = load_file(str(next(path.glob("*.safetensors"))))
    hidden, _ = hf_features(hf_target, _context(7, 9), [])
    h = hidden[-3:]  # three positions' final-normed hidden states
    ref_tokens, ref_logits = [], []
    for i in range(hc.num_medusa_heads):  # Medusa: x <- x + SiLU(W x + b) per block, then head i's LM head
        x = h
        for j in range(hc.medusa_num_layers):
            if kind == "fasterdecoding":
                x = x + torch.nn.functional.silu(x @ t[f"{i}.{j}.linear.weight"].T + t[f"{i}.{j}.linear.bias"])
            else:
                x = x + torch.nn.functional.silu(x @ t[f"blocks.{i}.layers.{j}.weight"].T)
        lg = x @ (t[f"{i}.{hc.medusa_num_layers}.weight"] if kind == "fasterdecoding" else t[f"lm_heads.{i}.weight"]).T
        if kind == "vllm":
            full = torch.full((3, V), float("-inf"))
            full[:, t["token_map"]] = lg
            lg = full
        ref_logits.append(lg)
        ref_tokens.append(lg.argmax(-1))
    kw = dict(config=hc, target_config=target[0])
    hj = jnp.asarray(h.detach().numpy())
    got = np.asarray(medusa_greedy_tokens(hp, target[1], hj, **kw))  # [3, N]
    assert got.tolist() == torch.stack(ref_tokens, 1).tolist()
    logits = np.asarray(medusa_target_logits(hp, target[1], hj, **kw))
    ref = torch.stack(ref_logits, 1).detach().numpy()
    assert (np.isfinite(logits) == np.isfinite(ref)).all()
    np.testing.assert_allclose(logits[np.isfinite(ref)], ref[np.isfinite(ref)], rtol=2e-4, atol=2e-4)


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_bad_published_heads_are_refused_by_name(tmp_path, target):
    path = eagle3_authors(tmp_path / "ok", aux=[2, 4, 6])
    cfg = json.loads((path / "config.json").read_text())

    def variant(name, edit_cfg=None, edit_t=None):
        from safetensors.torch import load_file

        t = load_file(str(path / "model.safetensors"))
        c = json.loads(json.dumps(cfg))
        if edit_cfg:
            edit_cfg(c)
        if edit_t:
            edit_t(t)
        return _write(tmp_path / name, c, t)

    with pytest.raises(ValueError, match="t2d"):
        load_head(variant("t2d", edit_t=lambda t: t.__setitem__("t2d", ~t["t2d"])))
    with pytest.raises(ValueError, match="embedding output"):
        load_head(variant("aux0", edit_cfg=lambda c: c["eagle_config"].__setitem__(
            "eagle_aux_hidden_state_layer_ids", [0, 4, 6])))
    with pytest.raises(ValueError, match="midlayer.self_attn.k_proj.weight"):
        load_head(variant("missing", edit_t=lambda t: t.pop("midlayer.self_attn.k_proj.weight")))
    with pytest.raises(ValueError, match="num_hidden_layers=2"):
        load_head(variant("deep", edit_cfg=lambda c: c.__setitem__("num_hidden_layers", 2)))
    spec = eagle3_speculators(tmp_path / "spec")
    c = json.loads((spec / "config.json").read_text())
    c["norm_before_fc"] = True
    (spec / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match="norm_before_fc"):
        load_head(spec)
    with pytest.raises(ValueError, match="aux_layer_ids \\[8\\]"):
        load_head(variant("far", edit_cfg=lambda c: c["eagle_config"].__setitem__(
            "eagle_aux_hidden_state_layer_ids", [2, 4, 9])))[0].check_target(target[0])


def test_a_plain_draft_model_is_not_taken_for_a_head(target_dir):
    assert detect_head_method(target_dir) is None


@pytest.mark.parametrize("make", [lambda p: eagle3_authors(p, aux=[2, 5, 7]), eagle3_speculators, eagle1_authors,
                                  medusa_fasterdecoding], ids=["eagle3", "speculators", "eagle1", "medusa"])
def test_published_heads_in_the_engine_equal_plain_greedy(make, tmp_path, target_dir):
    path = make(tmp_path / "head")
    method = detect_head_method(path)
    prompts = [{"prompt_token_ids": _context(s, n)} for s, n in ((1, 5), (2, 21))]
    params = specjax.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = specjax.LLM(str(target_dir), **KW).generate(prompts, params)
    llm = specjax.LLM(str(target_dir), speculative_config={"method": method, "model": str(path),
                                                           "num_speculative_tokens": 2, "adaptive": False}, **KW)
    spec = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert llm.get_metrics()["num_draft_tokens"] > 0
