"""vLLM's sampling surface, exact under speculation: processors and filters, logprobs, stop strings, n.

Reference distributions and log-probabilities are computed here from transformers' logits with the
textbook definitions in numpy, never by calling the code under test.
"""

import numpy as np
import pytest
import torch
from scipy import stats

import specjax
from tiny_models import load_hf_torch_model, make_tiny_checkpoint

KW = dict(max_model_len=64, max_num_seqs=4, block_size=8, max_prefill_chunk=16, query_buckets=(1, 16), warmup=False)
EOS = 3


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("t"), vocab_size=32, eos_token_id=EOS, seed=0)


@pytest.fixture(scope="module")
def plain(target_dir):
    return specjax.LLM(target_dir, **KW)


@pytest.fixture(scope="module")
def speculative(target_dir):
    """Self-drafting: every method path runs, many drafts are accepted, K fixed so outputs are comparable."""
    return specjax.LLM(target_dir, speculative_config={"model": str(target_dir), "num_speculative_tokens": 3,
                                                       "adaptive": False}, **KW)


PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 5, 6]}, {"prompt_token_ids": [9, 10, 11]}]


def _ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


# --------------------------------------------------------------------------- validation


def test_unknown_field_lists_the_supported_ones():
    with pytest.raises(ValueError, match=r"no field\(s\) \['best_of'\]; supported: \[.*'logprobs'.*'min_p'"):
        specjax.SamplingParams(best_of=2)


@pytest.mark.parametrize("kwargs,field", [
    (dict(n=0), "n"), (dict(min_p=1.5), "min_p"), (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias={1: 101.0}), r"logit_bias\[1\]"), (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(min_tokens=9, max_tokens=4), "min_tokens"), (dict(stop=[""]), "stop"), (dict(stop=5), "stop"),
    (dict(logprobs=21), "logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(bad_words=["\ud800"]), "bad_words"), (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
    (dict(skip_special_tokens="no"), "skip_special_tokens"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        specjax.SamplingParams(**kwargs)


def test_request_level_checks_name_the_field(plain):
    with pytest.raises(ValueError, match="logit_bias has ids outside"):
        plain.generate(PROMPTS[:1], specjax.SamplingParams(logit_bias={40: 1.0}))
    with pytest.raises(ValueError, match="bad_words"):  # the tiny model has no tokenizer
        plain.generate(PROMPTS[:1], specjax.SamplingParams(bad_words=["x"]))


# --------------------------------------------------------------------------- greedy: identical to plain decoding


GREEDY_CASES = {
    "penalties": dict(repetition_penalty=1.6, presence_penalty=0.8, frequency_penalty=0.5),
    "logit_bias": dict(logit_bias={7: 4.0, 12: -100.0, 17: 3.0}),
    "min_tokens": dict(min_tokens=10, logit_bias={EOS: 30.0}),
    "min_p": dict(min_p=0.5),
}


@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_with_processors_equals_plain_decoding(plain, speculative, case):
    params = specjax.SamplingParams(temperature=0.0, max_tokens=14, **GREEDY_CASES[case])
    expected = _ids(plain.generate(PROMPTS, params))
    assert _ids(speculative.generate(PROMPTS, params)) == expected
    assert speculative.get_metrics()["num_accepted_tokens"] > 0
    base = _ids(plain.generate(PROMPTS, specjax.SamplingParams(temperature=0.0, max_tokens=14)))
    if case != "min_p":  # min-p leaves greedy decoding alone; every other processor changes this output
        assert expected != base
    if case == "min_tokens":  # EOS is pushed up by the bias, yet held back until 10 tokens are out
        assert all(len(c) >= 10 and EOS not in c[:9] for out in expected for c in out)


# --------------------------------------------------------------------------- logprobs


def test_logprobs_are_transformers_log_softmax_under_speculation(target_dir, plain, speculative):
    hf = load_hf_torch_model(target_dir)
    params = specjax.SamplingParams(temperature=0.0, max_tokens=10, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    for llm in (plain, speculative):
        for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
            c = out.outputs[0]
            seq = prompt["prompt_token_ids"] + c.token_ids
            with torch.no_grad():
                ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].double(), -1).numpy()  # [T, V]
            n_prompt = len(prompt["prompt_token_ids"])
            for i, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
                row = ref[n_prompt - 1 + i]
                assert entry[token].logprob == pytest.approx(row[token], abs=2e-4)
                assert entry[token].rank == 1 + int((row > row[token] + 1e-6).sum())
                top = np.argsort(-row)[:3]
                assert set(entry) >= set(top.tolist()) and len(entry) <= 4
            assert c.cumulative_logprob == pytest.approx(
                sum(ref[n_prompt - 1 + i, t] for i, t in enumerate(c.token_ids)), abs=2e-3)
            assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n_prompt
            for i in range(1, n_prompt):
                token = prompt["prompt_token_ids"][i]
                assert out.prompt_logprobs[i][token].logprob == pytest.approx(ref[i - 1, token], abs=2e-4)


# --------------------------------------------------------------------------- stop strings and n


@pytest.fixture(scope="module")
def shipped():
    return specjax.LLM("builtin:target", max_model_len=128, max_num_seqs=2, max_prefill_chunk=64,
                       query_buckets=(1, 64), warmup=False)


@pytest.fixture(scope="module")
def shipped_spec():
    return specjax.LLM("builtin:target", speculative_config={"model": "builtin:target", "num_speculative_tokens": 4,
                                                             "adaptive": False},
                       max_model_len=128, max_num_seqs=2, max_prefill_chunk=64, query_buckets=(1, 64), warmup=False)


def test_stop_strings_cut_the_committed_text_also_inside_accepted_blocks(shipped, shipped_spec):
    prompt = "def parse_args(argv):\n    parser = "
    base = shipped.generate(prompt, specjax.SamplingParams(temperature=0.0, max_tokens=40))[0].outputs[0]
    stop = base.text[len(base.text) // 2: len(base.text) // 2 + 3]  # a string from the middle of the output
    for include in (False, True):
        params = specjax.SamplingParams(temperature=0.0, max_tokens=40, stop=[stop, "never-appears"],
                                        include_stop_str_in_output=include)
        for llm in (shipped, shipped_spec):  # self-drafting: whole blocks are accepted at once
            c = llm.generate(prompt, params)[0].outputs[0]
            at = base.text.find(stop)
            assert c.finish_reason == "stop" and c.stop_reason == stop
            assert c.text == base.text[: at + (len(stop) if include else 0)]
            assert c.token_ids == base.token_ids[: len(c.token_ids)] and len(c.token_ids) < len(base.token_ids)
    assert shipped_spec.get_metrics()["num_accepted_tokens"] > 0


def test_n_completions_each_seeded_and_the_first_is_the_single_one(shipped):
    params = specjax.SamplingParams(temperature=1.0, max_tokens=8, seed=7, n=3)
    out = shipped.generate("import os\n", params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    ids = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(ids)) > 1
    single = shipped.generate("import os\n", specjax.SamplingParams(temperature=1.0, max_tokens=8, seed=7))[0]
    assert single.outputs[0].token_ids == out.outputs[0].token_ids
    again = shipped.generate("import os\n", params)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == ids  # seeded: reproducible


def test_single_token_bad_words_are_never_generated(shipped):
    tok = shipped.get_tokenizer()
    base = shipped.generate("import os\n", specjax.SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0]
    banned = tok.decode([base.token_ids[0]]).strip()
    if len(tok.encode(banned, add_special_tokens=False).ids) != 1:
        pytest.skip("the first output token is not a standalone word")
    out = shipped.generate("import os\n", specjax.SamplingParams(temperature=0.0, max_tokens=12,
                                                                 bad_words=[banned]))[0].outputs[0]
    banned_ids = {tok.encode(f, add_special_tokens=False).ids[0] for f in (banned, " " + banned)
                  if len(tok.encode(f, add_special_tokens=False).ids) == 1}
    assert not banned_ids & set(out.token_ids)
    with pytest.raises(ValueError, match="bad_words"):
        shipped.generate("x", specjax.SamplingParams(bad_words=["definitely not one token at all"]))


# --------------------------------------------------------------------------- sampling: the exact law


def _softmax(z):
    z = z - z.max()
    e = np.exp(z)
    return e / e.sum()


def _reference_step(logits, prompt, out, cfg):
    """The next-token law after ``prompt + out`` (textbook definitions, vLLM's order)."""
    x = logits.astype(np.float64).copy()
    for tok, b in cfg.get("logit_bias", {}).items():
        x[tok] += b
    if len(out) < cfg.get("min_tokens", 0):
        x[EOS_SMALL] = -np.inf
    counts = np.bincount(np.asarray(out, int), minlength=len(x))
    seen = (counts > 0) | np.isin(np.arange(len(x)), prompt)
    r = cfg.get("repetition_penalty", 1.0)
    x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    x = x - cfg.get("frequency_penalty", 0.0) * counts - cfg.get("presence_penalty", 0.0) * (counts > 0)
    p = _softmax(x / cfg.get("temperature", 1.0))
    if cfg.get("min_p", 0.0) > 0:
        p = np.where(p >= cfg["min_p"] * p.max(), p, 0.0)
        p /= p.sum()
    return p


EOS_SMALL = 2
LAW_CASES = {
    "repetition": dict(repetition_penalty=2.5),
    "presence_frequency": dict(presence_penalty=1.5, frequency_penalty=1.0),
    "min_p": dict(min_p=0.3, temperature=0.8),
    "logit_bias": dict(logit_bias={1: 2.0, 4: -1.5}),
    "min_tokens": dict(min_tokens=2, logit_bias={EOS_SMALL: 1.5}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LAW_CASES))
def test_sampled_three_token_law_is_the_transformed_targets_under_speculation(tmp_path, case):
    """(t1, t2, t3) frequencies with a probabilistic draft model (t2, t3 verified in one step, so t3 is judged
    with t2 counted as context) match the law computed from transformers' logits."""
    cfg = LAW_CASES[case]
    vocab = 6
    target = make_tiny_checkpoint(tmp_path / "t", vocab_size=vocab, eos_token_id=EOS_SMALL, logit_scale=1.5, seed=1)
    draft = make_tiny_checkpoint(tmp_path / "d", vocab_size=vocab, eos_token_id=EOS_SMALL, logit_scale=1.5, seed=2,
                                 num_layers=1)
    prompt = [1, 4, 0]
    hf = load_hf_torch_model(target)
    law = np.zeros((vocab,) * 3)
    with torch.no_grad():
        l1 = hf(torch.tensor([prompt])).logits[0, -1].double().numpy()
        p1 = _reference_step(l1, prompt, [], cfg)
        l2 = hf(torch.tensor([prompt + [a] for a in range(vocab)])).logits[:, -1].double().numpy()
        l3 = hf(torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])).logits[:, -1]
        l3 = l3.double().numpy().reshape(vocab, vocab, vocab)
    for a in range(vocab):
        p2 = _reference_step(l2[a], prompt, [a], cfg)
        for b in range(vocab):
            law[a, b] = p1[a] * p2[b] * _reference_step(l3[a, b], prompt, [a, b], cfg)
    law = law.ravel()
    n = 3000
    llm = specjax.LLM(target, speculative_config={"model": str(draft), "num_speculative_tokens": 2,
                                                  "adaptive": False},
                      warmup=False, max_model_len=16, max_num_seqs=64, block_size=4, max_prefill_chunk=4,
                      num_kv_blocks=64 * 4, max_num_batched_tokens=256)
    extra = {k: v for k, v in cfg.items() if k != "temperature"}
    # EOS is an ordinary token here, except for min_tokens, which holds it back for the first two tokens.
    params = [specjax.SamplingParams(temperature=cfg.get("temperature", 1.0), max_tokens=4, seed=s,
                                     ignore_eos="min_tokens" not in cfg, **extra) for s in range(n)]
    outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)]
    counts = np.bincount([(o[0] * vocab + o[1]) * vocab + o[2] for o in outs], minlength=vocab ** 3)
    assert llm.get_metrics()["num_accepted_tokens"] > 0
    assert counts[law == 0].sum() == 0  # nothing the transforms rule out is ever sampled
    keep = law * n >= 5  # chi-square needs expected counts >= 5; pool the rest (when it has any mass)
    obs, exp = counts[keep], law[keep] * n
    if law[~keep].sum() > 0:
        obs, exp = np.append(obs, counts[~keep].sum()), np.append(exp, law[~keep].sum() * n)
    assert stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-3
    assert 0.5 * np.abs(counts / n - law).sum() < 0.08
