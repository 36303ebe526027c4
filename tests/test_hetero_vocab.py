"""Draft models with their own tokenizer (``use_heterogeneous_vocab``): the id maps and lossless drafting.

Two byte-level BPE tokenizers are trained on the same small corpus (the stdlib's
``json`` package) with vocabularies of 700 (target) and 512 (draft). Trained on
the same text, the smaller one's tokens get the same ids as in the larger one,
so the draft tokenizer's ids are then shuffled: an identity map in place of the
real one would draft the wrong tokens and fail the acceptance test below.
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import specjax
from models.llama import LlamaConfig, init_params
from specjax.buckets import count_compiles
from specjax.config import SpeculativeConfig
from specjax.kv_cache import KVCache
from specjax.spec_decode.draft_model import draft_propose
from specjax.step import StepBatch
from specjax.spec_decode.vocab_map import VocabMap, build_vocab_map, load_vocab_map
from specjax.train.corpus import CorpusConfig, TokenizerConfig, iter_texts, list_files, save_tokenizer, stdlib_root
from specjax.train.corpus import train_tokenizer
from tiny_models import make_tiny_checkpoint

# One row bucket and two length buckets: few compiles keep the file fast.
KW = dict(max_model_len=64, max_num_seqs=4, block_size=8, max_prefill_chunk=16, batch_buckets=(4,),
          query_buckets=(4, 16))
V_TARGET, V_DRAFT = 700, 512
EOS = 0  # "<|endoftext|>" in both tokenizers
TEXT_PROMPTS = ["def decode(self, s):", "import json\n", "class JSONEncoder(object):\n    def", "    return"]


def _shuffle_ids(tok, seed: int):
    """The same tokenizer with its non-special ids permuted (merges are stored as strings, so they still apply)."""
    from tokenizers import Tokenizer

    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    specials = {t["content"] for t in data["added_tokens"]}
    names = sorted((s for s in vocab if s not in specials), key=vocab.get)
    ids = sorted(vocab[s] for s in names)
    for s, i in zip(names, np.random.default_rng(seed).permutation(ids).tolist()):
        vocab[s] = i
    return Tokenizer.from_str(json.dumps(data))


@pytest.fixture(scope="module")
def tokenizers_pair():
    cfg = CorpusConfig(root=str(stdlib_root() / "json"))
    files = list_files(cfg)
    target = train_tokenizer(iter_texts(files, cfg), TokenizerConfig(vocab_size=V_TARGET))
    draft = train_tokenizer(iter_texts(files, cfg), TokenizerConfig(vocab_size=V_DRAFT))
    assert (target.get_vocab_size(), draft.get_vocab_size()) == (V_TARGET, V_DRAFT)
    return target, _shuffle_ids(draft, seed=0)


@pytest.fixture(scope="module")
def vocab_map(tokenizers_pair):
    return build_vocab_map(*tokenizers_pair, target_vocab_size=V_TARGET, draft_vocab_size=V_DRAFT)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, tokenizers_pair):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("target"), vocab_size=V_TARGET, eos_token_id=EOS, seed=0)
    save_tokenizer(tokenizers_pair[0], path)
    return path


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, tokenizers_pair):
    # An unrelated random draft: agrees with the target only by chance.
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("draft"), vocab_size=V_DRAFT, eos_token_id=EOS, seed=5,
                                num_layers=1, hidden_size=32, num_kv_heads=2)
    save_tokenizer(tokenizers_pair[1], path)
    return path


def _rewrite(src, dst, tensors: dict, vocab_size: int, tokenizer) -> None:
    """Copy checkpoint ``src`` to ``dst`` with ``tensors`` replaced, ``vocab_size`` and ``tokenizer``."""
    shutil.copytree(src, dst)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["vocab_size"] = vocab_size
    (dst / "config.json").write_text(json.dumps(config))
    save_tokenizer(tokenizer, dst)


@pytest.fixture(scope="module")
def shared_pair(tmp_path_factory, target_dir, tokenizers_pair, vocab_map):
    """(target, draft) dirs where the draft IS the target, reindexed to the draft tokenizer's ids.

    The target's LM-head rows of tokens the draft lacks are zeroed, so it emits shared tokens only (their
    logits spread around 0 with std ~10, so the max is positive): on prompts of shared tokens the
    draft then computes the target's logits exactly and should propose what the target picks.
    """
    root = tmp_path_factory.mktemp("shared")
    tensors = load_file(str(target_dir / "model.safetensors"))
    d2t = vocab_map.draft_to_target
    assert (d2t >= 0).all()  # the 512-token vocabulary is inside the 700-token one
    lm_head = tensors["lm_head.weight"].copy()  # [V_target, D]
    lm_head[np.setdiff1d(np.arange(V_TARGET), d2t)] = 0.0
    target = root / "target"
    _rewrite(target_dir, target, {**tensors, "lm_head.weight": lm_head}, V_TARGET, tokenizers_pair[0])
    draft = {**tensors, "lm_head.weight": lm_head[d2t], "model.embed_tokens.weight": tensors["model.embed_tokens.weight"][d2t]}
    _rewrite(target_dir, root / "draft", draft, V_DRAFT, tokenizers_pair[1])
    return target, root / "draft"


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _spec(draft, k=3, **kw):
    # Fixed K unless a test says otherwise: acceptance is asserted, and the adaptive controller may decode plainly.
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k, "use_heterogeneous_vocab": True,
            "adaptive": False, **kw}


# --------------------------------------------------------------------------- the maps


def _toy_tokenizer(vocab: dict, merges: list, specials: list, unk=None):
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk))
    tok.add_special_tokens(specials)
    return tok


@pytest.mark.parametrize("unk, last_resort", [(None, 3), ("c", 4)])
def test_toy_maps_exact(unk, last_resort):
    target = _toy_tokenizer({"<s>": 0, "a": 1, "b": 2, "ab": 3, "abb": 4, "<t>": 5}, [("a", "b"), ("ab", "b")],
                            ["<s>", "<t>"])
    # "<t>" is plain text in the draft: it must not stand in for the target's special "<t>".
    draft = _toy_tokenizer({"b": 0, "a": 1, "bb": 2, "<s>": 3, "c": 4, "<t>": 5}, [("b", "b")], ["<s>"], unk=unk)
    m = build_vocab_map(target, draft, target_vocab_size=8, draft_vocab_size=7)  # both models padded
    # "ab" -> longest draft suffix "b"; "abb" -> "bb"; special "<t>" and padding -> the last resort
    # (the draft's unk token, else its first special token "<s>").
    r = last_resort
    np.testing.assert_array_equal(m.target_to_draft, np.array([3, 1, 0, 0, 2, r, r, r], np.int32))
    np.testing.assert_array_equal(m.draft_to_target, np.array([2, 1, -1, 0, -1, -1, -1], np.int32))
    assert m.num_shared == 3


def test_trained_maps(tokenizers_pair, vocab_map):
    target, draft = tokenizers_pair
    t2d, d2t = vocab_map.arrays
    assert t2d.shape == (V_TARGET,) and d2t.shape == (V_DRAFT,) and t2d.dtype == d2t.dtype == np.int32
    for s in ("Ġself", "Ġreturn", "json", "<|endoftext|>", "<|bos|>"):  # present in both: maps both ways
        t_id, d_id = target.token_to_id(s), draft.token_to_id(s)
        assert t_id is not None and d_id is not None, s
        assert (t2d[t_id], d2t[d_id]) == (d_id, t_id), s
    # "self" is a target-only merge: the draft reads it as its longest suffix in the draft's vocabulary, "lf".
    assert draft.token_to_id("self") is None and draft.token_to_id("elf") is None
    assert t2d[target.token_to_id("self")] == draft.token_to_id("lf")
    assert (t2d[d2t] == np.arange(V_DRAFT)).all()  # a bijection on the shared tokens
    assert vocab_map.num_shared == V_DRAFT and (t2d != np.arange(V_TARGET)).sum() > V_TARGET // 2  # ids shuffled
    # Target-only tokens: the draft has no such id (-1 backwards), and they draft from their longest suffix.
    only_target = [s for s in target.get_vocab() if draft.token_to_id(s) is None]
    assert len(only_target) == V_TARGET - V_DRAFT
    reverse = build_vocab_map(draft, target, target_vocab_size=V_DRAFT, draft_vocab_size=V_TARGET)
    for s in only_target[:20]:
        assert reverse.draft_to_target[target.token_to_id(s)] == -1, s
        suffix = next(s[i:] for i in range(1, len(s)) if draft.token_to_id(s[i:]) is not None)
        assert t2d[target.token_to_id(s)] == draft.token_to_id(suffix), s


def test_map_errors(tokenizers_pair):
    target, _ = tokenizers_pair
    disjoint = _toy_tokenizer({"x": 0, "y": 1}, [], [])
    with pytest.raises(ValueError, match="num_shared"):
        build_vocab_map(disjoint, _toy_tokenizer({"z": 0}, [], []), target_vocab_size=2, draft_vocab_size=1)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab_map(target, disjoint, target_vocab_size=V_TARGET, draft_vocab_size=0)
    with pytest.raises(ValueError, match="target_to_draft"):
        VocabMap(target_to_draft=np.zeros(3, np.int64), draft_to_target=np.zeros(2, np.int32), num_shared=2)
    with pytest.raises(ValueError, match="draft_to_target"):
        VocabMap(target_to_draft=np.zeros(3, np.int32), draft_to_target=np.array([0, 3], np.int32), num_shared=2)


def test_draft_propose_maps_context_masks_and_maps_drafts():
    """draft_propose alone: a map that shifts ids by 4 shifts the drafts by 4; a banned (unshared) argmax is skipped."""
    cfg = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=16)
    params = init_params(cfg, jax.random.key(0))
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 50.0  # spread logits: clear argmax margins
    b, k, bs = 2, 3, 4
    ctx = np.array([[5, 9, 2, 11], [7, 7, 3, 14]], np.int32)  # [B, C] draft ids
    positions = np.tile(np.arange(4, dtype=np.int32), (b, 1))  # [B, C]
    tables = np.array([[0, 1], [2, 3]], np.int32)  # [B, M]: two blocks of 4 per row
    zeros = np.zeros((b,), np.int32)

    @jax.jit
    def propose(tokens, vocab_map):
        cache = KVCache.allocate(num_layers=1, num_blocks=4, block_size=bs, num_kv_heads=2, head_dim=16,
                                 dtype=jnp.float32)
        batch = StepBatch.zeros(b, 4, k, max_blocks=2).replace(
            tokens=tokens, positions=positions, slot_mapping=tables[:, :1] * bs + positions, block_tables=tables,
            last_index=zeros + 3, num_drafts=zeros + k,
        )
        ids, _, _ = draft_propose(params, cache, batch, jax.random.split(jax.random.key(1), b),
                                  config=cfg, k=k, probabilistic=False, vocab_map=vocab_map)
        return ids  # [B, K]

    run = lambda tokens, vocab_map: np.asarray(propose(tokens, vocab_map))  # noqa: E731

    plain = run(ctx, None)
    # Target ids = draft ids + 4 (a 20-token target vocabulary; target ids 0..3 exist only there).
    t2d = np.concatenate([np.zeros(4, np.int32), np.arange(16, dtype=np.int32)])  # [20]
    d2t = np.arange(16, dtype=np.int32) + 4  # [16]
    np.testing.assert_array_equal(run(ctx + 4, (t2d, d2t)), plain + 4)
    # Unshare each row's first plain draft: the draft must pick another token, and one the target has.
    banned = np.unique(plain[:, 0])
    d2t_banned = d2t.copy()
    d2t_banned[banned] = -1
    out = run(ctx + 4, (t2d, d2t_banned))
    assert set(out.ravel().tolist()) <= set(d2t_banned[d2t_banned >= 0].tolist())
    assert (out[:, 0] != plain[:, 0] + 4).all()


# --------------------------------------------------------------------------- config and loading


@pytest.mark.parametrize("kw, field", [
    ({"draft_sample_method": "probabilistic"}, "draft_sample_method"),
    ({"method": "ngram", "model": None}, "use_heterogeneous_vocab=True needs method='draft_model'"),
    ({"method": "suffix", "model": None}, "use_heterogeneous_vocab=True needs method='draft_model'"),
    ({"use_heterogeneous_vocab": 1}, "use_heterogeneous_vocab must be a bool"),
    ({"use_heterogeneous_vocab": "yes"}, "use_heterogeneous_vocab must be a bool"),
])
def test_config_errors_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig(**{**_spec("some/draft"), **kw})


def test_mismatched_draft_needs_the_flag(target_dir, draft_dir, tmp_path):
    with pytest.raises(ValueError, match="vocab_size=512 differs.*use_heterogeneous_vocab=True"):
        specjax.LLM(target_dir, speculative_config={"model": str(draft_dir), "num_speculative_tokens": 2},
                    warmup=False, **KW)
    bare = tmp_path / "bare"
    shutil.copytree(draft_dir, bare)
    (bare / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="draft's tokenizer.json"):
        specjax.LLM(target_dir, speculative_config=_spec(bare), warmup=False, **KW)
    with pytest.raises(ValueError, match="target's tokenizer.json"):
        load_vocab_map(None, draft_dir, target_vocab_size=V_TARGET, draft_vocab_size=V_DRAFT)


# --------------------------------------------------------------------------- generation


def _prompts(tok, shared_ids):
    rng = np.random.default_rng(1)
    out = [{"prompt_token_ids": tok.encode(p).ids} for p in TEXT_PROMPTS]
    out.append({"prompt_token_ids": rng.choice(shared_ids, size=21).tolist()})
    return out


def test_greedy_output_equals_plain(target_dir, draft_dir, tokenizers_pair, vocab_map):
    target_tok = tokenizers_pair[0]
    prompts = _prompts(target_tok, vocab_map.draft_to_target)
    # Target-only tokens in the context: the draft reads them through the suffix fallback.
    assert any(t not in set(vocab_map.draft_to_target.tolist()) for p in prompts for t in p["prompt_token_ids"])
    params = [specjax.SamplingParams(temperature=0.0, max_tokens=m) for m in (12, 20, 7, 16, 18)]
    expected = _ids(specjax.LLM(target_dir, warmup=False, **KW).generate(prompts, params))
    llm = specjax.LLM(target_dir, speculative_config=_spec(draft_dir, k=3), warmup=True, **KW)
    with count_compiles() as counter:  # the maps are arguments of the warmed-up executables
        assert _ids(llm.generate(prompts, params)) == expected
    assert counter.count == 0
    m = llm.get_metrics()
    assert m["num_drafts"] > 0 and m["num_draft_tokens"] >= m["num_accepted_tokens"]


def test_reindexed_copy_of_the_target_is_accepted(shared_pair, vocab_map):
    target, draft = shared_pair
    rng = np.random.default_rng(2)
    prompts = [{"prompt_token_ids": rng.choice(vocab_map.draft_to_target, size=n).tolist()} for n in (5, 17, 30)]
    params = specjax.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = _ids(specjax.LLM(target, warmup=False, **KW).generate(prompts, params))
    llm = specjax.LLM(target, speculative_config=_spec(draft, k=3), warmup=False, **KW)
    assert _ids(llm.generate(prompts, params)) == expected
    # The draft computes the target's own logits on the shared tokens: (nearly) every draft is accepted.
    assert llm.get_metrics()["acceptance_rate"] > 0.9
