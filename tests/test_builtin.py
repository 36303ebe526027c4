"""The built-in model pair (specjax/builtin/{target,draft}) and the code that trains it."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.llama import LlamaConfig, forward, init_params
from models.loading import convert_hf_state_dict, load_hf_model
from specjax.kv_cache import AttentionMetadata, KVCache
from specjax.train import corpus, export, lm

BUILTIN = Path(__file__).resolve().parent.parent / "specjax" / "builtin"
DIRS = {"target": BUILTIN / "target", "draft": BUILTIN / "draft"}


def _heldout_prompts(n: int = 2, chars: int = 160) -> list[str]:
    _, heldout = corpus.split_files()
    # Skip codec tables: their continuations are trivially repetitive.
    files = [f for f in heldout if not f.startswith("encodings/")] or heldout
    if len(files) < n:
        pytest.skip("this interpreter's stdlib has too few held-out files")
    return [corpus.read_text(f)[:chars] for f in files[:n]]


# --------------------------------------------------------------------------- shipped checkpoints


@pytest.mark.parametrize("role", ["target", "draft"])
def test_shipped_files_present_and_small(role):
    d = DIRS[role]
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (d / name).is_file(), f"{d / name} missing"
    size = lambda root: sum(f.stat().st_size for f in root.rglob("*") if f.is_file())  # noqa: E731
    pair = size(DIRS["target"]) + size(DIRS["draft"])
    assert pair < 20e6, f"the shipped pair takes {pair / 1e6:.1f} MB"
    # Everything shipped (the pair, its heads, the SmolLM2 EAGLE-3 head: 21 MB) stays a small wheel.
    total = size(BUILTIN)
    assert total < 55e6, f"builtin models take {total / 1e6:.1f} MB"


@pytest.mark.parametrize("role", ["target", "draft"])
def test_shipped_greedy_matches_transformers(role):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import specjax

    d = str(DIRS[role])
    prompts = _heldout_prompts()
    hf_tok = AutoTokenizer.from_pretrained(d)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    llm = specjax.LLM(model=d, warmup=False, max_model_len=256, max_num_seqs=2)
    outs = llm.generate(prompts, specjax.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = hf_tok(prompt, return_tensors="pt")["input_ids"]  # [1, P]
        assert ids[0].tolist() == out.prompt_token_ids
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == ref, (prompt, out.outputs[0].token_ids, ref)


def test_shipped_target_logits_match_transformers():
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = str(DIRS["target"])
    config, params = load_hf_model(d)
    ids = AutoTokenizer.from_pretrained(d)(_heldout_prompts(1)[0])["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits.numpy()  # [1, T, V]
    ours = np.asarray(lm.train_forward(params, jnp.asarray([ids], jnp.int32), config=config))  # [1, T, V]
    np.testing.assert_allclose(ours, ref, atol=2e-3 * np.abs(ref).max())


def test_shipped_pair_shares_tokenizer_and_eos():
    t_cfg, d_cfg = (LlamaConfig.from_hf_config(__import__("json").loads((DIRS[r] / "config.json").read_text()))
                    for r in ("target", "draft"))
    assert t_cfg.vocab_size == d_cfg.vocab_size
    assert t_cfg.eos_token_ids == d_cfg.eos_token_ids
    assert (DIRS["target"] / "tokenizer.json").read_bytes() == (DIRS["draft"] / "tokenizer.json").read_bytes()


# --------------------------------------------------------------------------- tokenizer + corpus


def test_tokenizer_round_trips_heldout_text():
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    _, heldout = corpus.split_files()
    text = corpus.read_text(heldout[0])
    tok = Tokenizer.from_file(str(DIRS["target"] / "tokenizer.json"))
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    hf_tok = AutoTokenizer.from_pretrained(str(DIRS["target"]))
    assert hf_tok.decode(hf_tok(text)["input_ids"]) == text
    assert tok.token_to_id(corpus.EOS_TOKEN) == hf_tok.eos_token_id == 0


def test_corpus_split_deterministic_and_disjoint():
    train, heldout = corpus.split_files()
    assert (train, heldout) == corpus.split_files()
    assert heldout and train
    assert not set(train) & set(heldout)
    assert sorted(train + heldout) == corpus.list_files()
    assert all(corpus.is_heldout(f) for f in heldout)
    assert not any(set(Path(f).parts) & corpus.EXCLUDED_DIRS for f in train + heldout)


def test_corpus_split_on_synthetic_tree(tmp_path):
    names = [f"pkg{i % 7}/mod_{i}.py" for i in range(300)] + ["test/x.py", "a/tests/y.py", "idlelib/z.py", "n.txt"]
    for n in names:
        (tmp_path / n).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / n).write_text(f"# {n}\n")
    cfg = corpus.CorpusConfig(root=str(tmp_path), heldout_per_mille=100)
    train, heldout = corpus.split_files(cfg)
    assert len(train) + len(heldout) == 300  # excluded dirs and non-.py files are dropped
    assert 10 <= len(heldout) <= 60  # ~10% by hash
    # A file's side depends on its own path only, not on which other files exist.
    (tmp_path / "pkg0" / "mod_0.py").unlink()
    train2, heldout2 = corpus.split_files(cfg)
    assert set(heldout2) == set(heldout) - {"pkg0/mod_0.py"}
    assert set(train2) == set(train) - {"pkg0/mod_0.py"}


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: corpus.CorpusConfig(heldout_per_mille=0), "heldout_per_mille"),
        (lambda: corpus.TokenizerConfig(vocab_size=100), "vocab_size"),
        (lambda: lm.TrainConfig(steps=0), "steps"),
        (lambda: lm.TrainConfig(steps=10, warmup_steps=10), "warmup_steps"),
        (lambda: lm.TrainConfig(lr=0.0), "lr"),
        (lambda: lm.TrainConfig(distill_alpha=1.5), "distill_alpha"),
    ],
)
def test_config_validation_names_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


# --------------------------------------------------------------------------- training forward + export


def _tiny_config(**kw) -> LlamaConfig:
    base = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, eos_token_ids=(0,), bos_token_id=1)
    return LlamaConfig(**{**base, **kw})


@pytest.mark.parametrize("tied", [False, True])
def test_train_forward_matches_paged_forward(tied):
    cfg = _tiny_config(tie_word_embeddings=tied)
    # x8 weights: logits far from uniform, so a layout bug cannot hide in the noise.
    params = jax.tree_util.tree_map(lambda x: x * 8 if x.ndim > 1 else x, init_params(cfg, jax.random.key(0)))
    b, t, bs = 2, 19, 4
    tokens = jax.random.randint(jax.random.key(1), (b, t), 0, cfg.vocab_size)  # [B, T]
    nb = -(-t // bs)
    cache = KVCache.allocate(num_layers=cfg.num_hidden_layers, num_blocks=b * nb, block_size=bs,
                             num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, dtype=jnp.float32)
    tables = jnp.arange(b * nb, dtype=jnp.int32).reshape(b, nb)  # [B, M]
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))  # [B, T]
    slots = tables[:, pos[0] // bs] * bs + pos % bs  # [B, T]
    ref, _, _ = forward(params, tokens, pos, cache, AttentionMetadata(slot_mapping=slots, block_tables=tables),
                        config=cfg)
    ours = lm.train_forward(params, tokens, config=cfg)
    assert float(jnp.abs(ref).max()) > 1.0
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tied", [False, True])
def test_export_is_inverse_of_loader(tied, tmp_path):
    cfg = _tiny_config(tie_word_embeddings=tied)
    params = init_params(cfg, jax.random.key(2))
    back = convert_hf_state_dict(export.to_hf_state_dict(params, cfg, dtype="float32"), cfg)
    flat_a = jax.tree_util.tree_leaves_with_path(params)
    flat_b = dict(jax.tree_util.tree_leaves_with_path(back))
    assert len(flat_a) == len(flat_b)
    for path, leaf in flat_a:
        np.testing.assert_array_equal(np.asarray(leaf), flat_b[path])
    out = export.export_hf(params, cfg, tmp_path / "m", dtype="float32")
    cfg2, params2 = load_hf_model(out)
    assert cfg2 == cfg
    for (_, a), (_, b2) in zip(flat_a, jax.tree_util.tree_leaves_with_path(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b2))


def test_distill_step_reduces_loss():
    cfg = _tiny_config(tie_word_embeddings=True)
    # x8 weights: a peaked teacher, so the KL starts well above 0.
    teacher = jax.tree_util.tree_map(lambda x: x * 8 if x.ndim > 1 else x, init_params(cfg, jax.random.key(3)))
    tcfg = lm.TrainConfig(steps=30, warmup_steps=2, batch_size=4, seq_len=16, lr=3e-3)
    tx, _ = lm.make_optimizer(tcfg)
    # alpha=1: pure KL (the CE term on random tokens would pull away from the teacher).
    step = lm.make_train_step(cfg, tx, teacher_config=cfg, alpha=1.0)
    params = init_params(cfg, jax.random.key(4))
    opt = tx.init(params)
    stream = np.random.default_rng(0).integers(0, cfg.vocab_size, 500).astype(np.uint16)
    batch = jnp.asarray(lm.get_batch(stream, tcfg, 0))  # one fixed batch: the student can fit it
    losses = []
    for _ in range(tcfg.steps):
        params, opt, m = step(params, opt, batch, teacher)
        losses.append(float(m["kl"]))
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5]), losses


def test_stop_at_step_cut_and_resume_are_reproducible(tmp_path):
    """A run cut by stop_at_step, then resumed, ends exactly where an uncut run of the same schedule ends."""
    cfg = _tiny_config(tie_word_embeddings=True)
    stream = np.random.default_rng(1).integers(0, cfg.vocab_size, 2000).astype(np.uint16)
    kw = dict(steps=6, warmup_steps=1, batch_size=2, seq_len=8, lr=3e-3, ckpt_every=100, log_every=100)
    full, stats = lm.train_loop(cfg, lm.TrainConfig(**kw), stream, tmp_path / "full")
    assert stats["steps_done"] == 6 and not stats["stopped_early"]
    cut, stats = lm.train_loop(cfg, lm.TrainConfig(**kw, stop_at_step=4), stream, tmp_path / "cut")
    assert stats["steps_done"] == 4 and stats["stopped_early"]
    again, stats = lm.train_loop(cfg, lm.TrainConfig(**kw, stop_at_step=4), stream, tmp_path / "cut")
    assert stats["steps_done"] == 4  # resuming at the cut trains nothing more
    resumed, stats = lm.train_loop(cfg, lm.TrainConfig(**kw), stream, tmp_path / "cut")
    assert stats["steps_done"] == 6
    jax.tree.map(np.testing.assert_array_equal, full, resumed)
    assert not np.array_equal(np.asarray(jax.tree.leaves(cut)[0]), np.asarray(jax.tree.leaves(full)[0]))
    with pytest.raises(ValueError, match="stop_at_step"):
        lm.TrainConfig(stop_at_step=-1)
