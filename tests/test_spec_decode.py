"""Speculative decoding in the engine: lossless greedy, exact sampling, metrics, compiles, validation."""

import jax
import numpy as np
import pytest
import torch
from scipy import stats

import specjax
from specjax.buckets import count_compiles
from specjax.config import SpeculativeConfig
from tiny_models import load_hf_torch_model, make_tiny_checkpoint

KW = dict(max_model_len=64, max_num_seqs=4, block_size=8, max_prefill_chunk=16)
EOS = 3
GREEDY = specjax.SamplingParams(temperature=0.0, max_tokens=14)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    # A small vocabulary makes the random model loop, so ngram/suffix lookups find matches.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("target"), family="llama", num_kv_heads=2,
                                vocab_size=32, eos_token_id=EOS, seed=0)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    # A different random model: it agrees with the target only sometimes, so drafts get rejected.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("draft"), family="llama", num_kv_heads=1,
                                vocab_size=32, num_layers=1, hidden_size=32, eos_token_id=EOS, seed=7)


@pytest.fixture(scope="module")
def plain(target_dir):
    return specjax.LLM(target_dir, warmup=False, **KW)


def _prompts(seed, lengths, vocab=32):
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        pattern = rng.integers(4, vocab, size=max(2, n // 3)).tolist()
        out.append({"prompt_token_ids": (pattern * 4)[:n]})  # repetitive prompts give ngram something to find
    return out


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


PROMPTS = _prompts(0, [5, 23, 2, 37, 9, 50])


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
def test_greedy_spec_equals_plain(target_dir, draft_dir, plain, method, k):
    spec = {"method": method, "num_speculative_tokens": k}
    if method == "draft_model":
        spec["model"] = str(draft_dir)
    if method == "ngram":
        spec.update(prompt_lookup_min=1, prompt_lookup_max=3)
    params = [specjax.SamplingParams(temperature=0.0, max_tokens=m) for m in (14, 9, 20, 27, 3, 13)]
    expected = _ids(plain.generate(PROMPTS, params))
    llm = specjax.LLM(target_dir, speculative_config=spec, warmup=False, **KW)
    assert _ids(llm.generate(PROMPTS, params)) == expected
    m = llm.get_metrics()
    assert m["num_drafts"] > 0 and m["num_draft_tokens"] >= m["num_accepted_tokens"]
    assert len(m["accepted_per_position"]) == k
    # The edge of max_model_len (64): the 50-token prompt is capped there, drafts never pass it.
    assert len(expected[5]) == 13 and len(_ids(llm.generate(PROMPTS[5:], GREEDY))[0]) == 14


class OracleProposer:
    """Test proposer: row "right" drafts the true greedy continuation, row "wrong" a token the target never picks."""

    def __init__(self, continuations, wrong_ids):
        self.continuations = continuations  # prompt tuple -> full greedy output
        self.wrong_ids = wrong_ids

    def propose(self, request_ids, token_ids, max_drafts):
        out = []
        for ids, cap in zip(token_ids, max_drafts):
            for prompt, cont in self.continuations.items():
                if tuple(ids[: len(prompt)]) == prompt:
                    done = len(ids) - len(prompt)
                    if prompt in self.wrong_ids:
                        drafts = [(cont[done] + 1) % 32 if done < len(cont) else 5] * cap
                    else:
                        drafts = cont[done: done + cap]
                    out.append(np.asarray(drafts, np.int32))
        return out

    def finish(self, *args):
        pass


def test_mixed_batch_all_accepted_next_to_first_position_rejection(target_dir, plain):
    prompts = _prompts(1, [7, 12])
    params = specjax.SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    expected = _ids(plain.generate(prompts, params))
    keys = [tuple(p["prompt_token_ids"]) for p in prompts]
    k = 4
    llm = specjax.LLM(target_dir, speculative_config={"method": "ngram", "num_speculative_tokens": k,
                                                      "adaptive": False}, warmup=False, **KW)
    llm.engine.proposer.drafter = OracleProposer(dict(zip(keys, expected)), wrong_ids={keys[1]})
    assert _ids(llm.generate(prompts, params)) == expected
    m = llm.get_metrics()
    # The first token of each row comes from its prompt's step. Row 0 then accepts every draft plus a bonus:
    # 5 + 5 + 5 + 4 tokens (the last step drafts 3: only 4 tokens remain). Row 1 is rejected at position 0
    # every step and advances by the corrected token alone; it drafts while at least 2 tokens remain: 18 steps.
    assert m["num_drafts"] == 4 + 18
    assert m["num_accepted_tokens"] == 3 * k + 3
    assert m["accepted_per_position"] == [4, 4, 4, 3]


def test_stop_inside_an_accepted_block(target_dir, plain):
    prompts = _prompts(2, [6])
    base = _ids(plain.generate(prompts, specjax.SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)))[0]
    stop = base[6]
    cut = base[: base.index(stop) + 1]
    llm = specjax.LLM(target_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 5},
                      warmup=False, **KW)
    llm.engine.proposer.drafter = OracleProposer({tuple(prompts[0]["prompt_token_ids"]): base}, wrong_ids=set())
    out = llm.generate(prompts, specjax.SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                                      stop_token_ids=[stop]))[0].outputs[0]
    assert out.token_ids == cut and out.finish_reason == "stop"
    out = llm.generate(prompts, specjax.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == base[:8] and out.finish_reason == "length"


@pytest.mark.parametrize("k", [2, 4])
def test_self_drafting_accepts_everything_greedy(target_dir, plain, k):
    llm = specjax.LLM(target_dir, speculative_config={"model": str(target_dir), "num_speculative_tokens": k},
                      warmup=False, **KW)
    params = specjax.SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True)
    assert _ids(llm.generate(PROMPTS[:4], params)) == _ids(plain.generate(PROMPTS[:4], params))
    m = llm.get_metrics()
    assert m["acceptance_rate"] == 1.0
    # Capped drafts at max_tokens' edge still count: every draft verified is fully accepted.
    assert m["mean_acceptance_length"] == pytest.approx(1 + m["num_accepted_tokens"] / m["num_drafts"])
    full = [n for n in m["accepted_per_position"]]
    assert full[0] == m["num_drafts"]


def test_drafting_rows_never_share_a_step_with_prompt_chunks(target_dir, plain):
    """A step with a prompt chunk verifies no drafts: decoding rows that draft take turns with prompt chunks,
    where a plain engine mixes them (one rows bucket, so mixing pads nothing)."""
    prompts = _prompts(5, [4, 9, 3, 12, 2, 7, 30, 5])  # 8 requests for 4 seats: prompts arrive while rows decode
    params = specjax.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kw = dict(KW, batch_buckets=(4,))
    steps = {}
    for name, spec in (("plain", None), ("spec", {"model": str(target_dir), "num_speculative_tokens": 2,
                                                  "adaptive": False})):
        llm = specjax.LLM(target_dir, speculative_config=spec, warmup=False, **kw)
        schedule, steps[name] = llm.engine.scheduler.schedule, []

        def record(*, drafting, schedule=schedule, out=steps[name]):
            rows = schedule(drafting=drafting)
            out.append([r.num_new for r in rows])
            return rows

        llm.engine.scheduler.schedule = record
        assert _ids(llm.generate(prompts, params)) == _ids(plain.generate(prompts, params))
        if spec is not None:
            assert llm.get_metrics()["acceptance_rate"] == 1.0  # (self-drafting: every decoding step drafts)

    def mixes(step):
        return 1 in step and max(step) > 1

    assert any(mixes(step) for step in steps["plain"])
    assert not any(mixes(step) for step in steps["spec"])
    chunk_turns = [step for step in steps["spec"] if max(step) > 1]
    assert len(chunk_turns) >= 4  # (the later prompts' chunks ran in steps of their own)


def test_self_drafting_probabilistic_at_temperature_one(target_dir):
    k = 3
    llm = specjax.LLM(target_dir, speculative_config={
        "model": str(target_dir), "num_speculative_tokens": k, "draft_sample_method": "probabilistic"},
        warmup=False, **KW)
    params = specjax.SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=3)
    llm.generate(PROMPTS[:4], params)
    m = llm.get_metrics()
    assert m["acceptance_rate"] > 0.97
    assert m["mean_acceptance_length"] > 1 + 0.97 * k * m["num_draft_tokens"] / (k * m["num_drafts"])


@pytest.mark.slow
@pytest.mark.parametrize("spec", [
    {"method": "draft_model", "num_speculative_tokens": 2},
    {"method": "draft_model", "draft_sample_method": "greedy", "num_speculative_tokens": 2},
    {"method": "draft_model", "num_speculative_tokens": 2, "rejection_sample_method": "block"},
    {"method": "eagle", "num_speculative_tokens": 2},
    {"method": "draft_model", "num_speculative_tokens": 2, "quantization": "q8_0"},
    {"method": "eagle", "num_speculative_tokens": 2, "quantization": "q8_0"},
], ids=["probabilistic", "greedy-draft", "block", "eagle-head", "q8_0-draft", "q8_0-eagle-head"])
def test_sampled_two_token_distribution_is_the_targets(tmp_path, spec):
    """Frequencies of (t1, t2) under speculation (adaptive K, drafts sampled from the draft's own distribution
    by default) match the target's exact joint law (from transformers)."""
    vocab = 6
    target = make_tiny_checkpoint(tmp_path / "t", vocab_size=vocab, eos_token_id=None, logit_scale=1.5, seed=1)
    if spec["method"] == "eagle":
        from models.heads import HeadConfig, init_head_params, save_head
        from models.loading import load_hf_model

        head = HeadConfig.for_target("eagle", load_hf_model(target)[0])
        params = jax.tree.map(lambda x: 3.0 * x if x.ndim > 1 else x, init_head_params(head, jax.random.key(2)))
        draft = save_head(tmp_path / "eagle", head, params, dtype="float32")
    else:
        draft = make_tiny_checkpoint(tmp_path / "d", vocab_size=vocab, eos_token_id=None, logit_scale=1.5, seed=2,
                                     num_layers=1)
    prompt = [1, 4, 2]
    hf = load_hf_torch_model(target)
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].double(), -1).numpy()
        nxt = torch.tensor([prompt + [t] for t in range(vocab)])
        p2 = torch.softmax(hf(nxt).logits[:, -1].double(), -1).numpy()
    joint = (p1[:, None] * p2).ravel()  # [V*V]
    n = 3000
    llm = specjax.LLM(target, speculative_config=spec | {"model": str(draft)}, warmup=False,
                      max_model_len=16, max_num_seqs=64, block_size=4, max_prefill_chunk=4,
                      num_kv_blocks=64 * 4, max_num_batched_tokens=256)
    # t1 comes from the prompt's (plain) step; t2 and t3 from one step verifying up to 2 drafts.
    params = [specjax.SamplingParams(temperature=1.0, max_tokens=4, seed=s) for s in range(n)]
    outs = _ids(llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False))
    counts = np.bincount([o[0] * vocab + o[1] for o in outs], minlength=vocab * vocab)
    assert llm.get_metrics()["num_accepted_tokens"] > 0
    keep = joint * n >= 5  # chi-square needs expected counts >= 5; pool the rest
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(joint[keep], joint[~keep].sum()) * n
    assert stats.chisquare(obs, exp).pvalue > 1e-3
    assert 0.5 * np.abs(counts / n - joint).sum() < 0.06


def test_synthetic_acceptance_length(target_dir):
    llm = specjax.LLM(target_dir, speculative_config={
        "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 1.875, "num_speculative_tokens": 3,
        "adaptive": False}, warmup=False, **KW)
    params = specjax.SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    llm.generate(_prompts(3, [4, 5, 6, 7] * 4), params)
    assert llm.get_metrics()["mean_acceptance_length"] == pytest.approx(1.875, abs=0.15)


def test_dynamic_k_and_zero_compiles_after_warmup(target_dir, draft_dir, plain):
    spec = {"model": str(draft_dir), "num_speculative_tokens": 3,
            "num_speculative_tokens_per_batch_size": [(1, 1, 3), (2, 2, 2), (3, 4, 0)]}
    llm = specjax.LLM(target_dir, speculative_config=spec, warmup=True, **KW)
    warm = llm.get_metrics()["num_compiles"]
    with count_compiles() as counter:
        for i, lengths in enumerate([[5], [9, 30], [3, 17, 41, 8], [12, 2, 6], [25]]):
            prompts = _prompts(10 + i, lengths)
            params = [specjax.SamplingParams(temperature=0.0, max_tokens=10 + j) for j in range(len(lengths))]
            assert _ids(llm.generate(prompts, params)) == _ids(plain.generate(prompts, params))
            llm.generate(prompts, specjax.SamplingParams(temperature=0.8, top_k=5, top_p=0.9, max_tokens=6, seed=i))
    assert counter.count == 0
    assert llm.get_metrics()["num_compiles"] == warm


def test_preemption_under_speculation(target_dir, draft_dir, plain):
    prompts = _prompts(4, [20, 25, 30, 18])
    params = [specjax.SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              specjax.SamplingParams(temperature=0.9, max_tokens=20, seed=1, ignore_eos=True)] * 2
    # A fixed K (adaptive K depends on measured timings). Preemption re-prefills rows, and a step in which a
    # row prefills is plain for every row, so sampled rows see other steps than without preemption: their
    # tokens are then another exact sample, not the same one. Greedy rows must not change at all; the
    # sampled rows must be complete and, with the same schedule, reproducible.
    spec = {"model": str(draft_dir), "num_speculative_tokens": 3, "draft_sample_method": "probabilistic",
            "adaptive": False}
    roomy = specjax.LLM(target_dir, speculative_config=spec, warmup=False, **KW)
    expected = _ids(roomy.generate(prompts, params))
    small = specjax.LLM(target_dir, speculative_config=spec, warmup=False, num_kv_blocks=12, **KW)
    got = _ids(small.generate(prompts, params))
    assert small.get_metrics()["num_preemptions"] > 0
    greedy_rows = [expected[0], expected[2]]
    assert greedy_rows == [got[0], got[2]] == [_ids(plain.generate([prompts[i]], params[i]))[0] for i in (0, 2)]
    assert all(len(row) == 20 and all(0 <= t < 32 for t in row) for row in got)
    again = specjax.LLM(target_dir, speculative_config=spec, warmup=False, num_kv_blocks=12, **KW)
    assert _ids(again.generate(prompts, params)) == got


def test_metrics_vllm_vectors():
    from specjax.metrics import SpecDecodeStats

    s = SpecDecodeStats(3)
    for drafted, accepted in [(3, 3), (3, 1), (2, 0)]:
        s.observe(drafted, accepted)
    d = s.as_dict()
    assert d["accepted_per_position"] == [2, 1, 1]
    # Reached positions: 3 of 3 drafts (all accepted), 2 of 3 (the second rejected), 1 of 2.
    assert d["verified_per_position"] == [3, 2, 1]
    assert d["num_drafts"] == 3 and d["num_draft_tokens"] == 8 and d["num_accepted_tokens"] == 4
    assert d["acceptance_rate"] == pytest.approx(4 / 8)
    assert d["mean_acceptance_length"] == pytest.approx(1 + 4 / 3)


@pytest.mark.parametrize("spec,field", [
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "foo", "num_speculative_tokens": 2}, "method"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "model is required"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "tensor_parallel_size": 2}, "tensor_parallel_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 3}, "draft_tensor_parallel_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_rates": [0.5]}, "synthetic_acceptance_rates"),
    ({"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_rates": [0.5, 1.5]}, "synthetic_acceptance_rates"),
    ({"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_rates": [0.5, 0.6]}, "non-increasing"),
    ({"method": "ngram", "num_speculative_tokens": 2, "synthetic_acceptance_rates": [0.5, 0.4]},
     "rejection_sample_method='synthetic'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_length": 3.5}, "synthetic_acceptance_length"),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [(1, 4, 2), (4, 8, 1)]},
     "overlap"),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [(0, 4, 2)]},
     "num_speculative_tokens_per_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "nope"},
     "rejection_sample_method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "bogus"),
])
def test_validation_errors_name_the_field(target_dir, spec, field):
    with pytest.raises(ValueError, match=field):
        specjax.LLM(target_dir, speculative_config=spec, warmup=False, **KW)


def test_draft_vocab_must_match(tmp_path, target_dir):
    other = make_tiny_checkpoint(tmp_path / "v64", vocab_size=64, eos_token_id=EOS)
    with pytest.raises(ValueError, match="vocab_size"):
        specjax.LLM(target_dir, speculative_config={"model": str(other), "num_speculative_tokens": 2},
                    warmup=False, **KW)


def test_method_auto_detection(tmp_path):
    assert SpeculativeConfig(model=str(tmp_path / "tiny-draft"), num_speculative_tokens=2).method == "draft_model"
    assert SpeculativeConfig(model=str(tmp_path / "EAGLE3-llama"), num_speculative_tokens=2).method == "eagle3"
    assert SpeculativeConfig(model=str(tmp_path / "medusa-heads"), num_speculative_tokens=2).method == "medusa"
    with pytest.raises(ValueError, match="model is required for method='eagle'"):
        SpeculativeConfig(method="eagle", num_speculative_tokens=2)
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=3)
    assert cfg.prompt_lookup_min == cfg.prompt_lookup_max == 3


def test_ngram_warmup_covers_no_draft_steps_and_cli_reports_acceptance(target_dir, plain, capsys):
    """Steps where ngram finds nothing run the plain bucket: warmup must have compiled it too."""
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    llm = specjax.LLM(target_dir, speculative_config=spec, warmup=True, **KW)
    prompts = _prompts(20, [3, 30]) + [{"prompt_token_ids": [4, 5, 6, 7, 8, 9]}]  # the last has no repeats
    with count_compiles() as counter:
        got = _ids(llm.generate(prompts, GREEDY))
    assert counter.count == 0
    assert got == _ids(plain.generate(prompts, GREEDY))
    from specjax.cli import main

    rc = main(["generate", "--model", str(target_dir), "--prompt-token-ids", "5,6,7,5,6,7,5,6", "--max-tokens", "16",
               "--temperature", "0", "--no-warmup", "--max-model-len", "64", "--speculative-config", '{"method": "ngram", '
               '"num_speculative_tokens": 2, "prompt_lookup_min": 1}'])
    assert rc == 0
    assert "acceptance rate" in capsys.readouterr().err
