"""The engine end to end: greedy parity with transformers, compiles, preemption, seeds, stops, bad input."""

import json

import numpy as np
import pytest
import torch
import transformers

import specjax
from specjax.buckets import count_compiles
from tiny_models import make_tiny_checkpoint

# Small buckets keep compile time low: rows (1, 2, 4) x query lengths (1, 4, 16).
ENGINE_KW = dict(max_model_len=64, max_num_seqs=4, block_size=8, max_prefill_chunk=16)
EOS = 3


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), family="llama", num_kv_heads=2, eos_token_id=EOS)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return specjax.LLM(llama_dir, warmup=False, **ENGINE_KW)


def _prompts(seed: int, lengths, vocab: int = 128):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(4, vocab, size=n).tolist()} for n in lengths]


def _hf_greedy(model_dir, prompt_ids, max_new_tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    outs = []
    for ids in prompt_ids:
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0,
            )
        outs.append(gen[0, len(ids):].tolist())
    return outs


@pytest.mark.parametrize(
    "family,kw",
    [
        ("llama", dict(num_kv_heads=2)),
        ("llama", dict(num_kv_heads=1, tie_word_embeddings=True)),
        ("qwen2", dict(num_kv_heads=2)),
        ("qwen3", dict(num_kv_heads=2)),
        ("mistral", dict(num_kv_heads=4)),
    ],
    ids=["llama-gqa", "llama-mqa-tied", "qwen2", "qwen3", "mistral"],
)
def test_greedy_matches_transformers_generate(tmp_path, family, kw):
    model_dir = make_tiny_checkpoint(tmp_path, family=family, eos_token_id=EOS, **kw)
    # Ragged batch; 23 and 37 tokens exercise chunked prefill (chunk 16) and multi-block tables.
    prompts = _prompts(1, [5, 23, 1, 37, 9])
    llm = specjax.LLM(model_dir, warmup=False, **ENGINE_KW)
    outs = llm.generate(prompts, specjax.SamplingParams(temperature=0.0, max_tokens=12))
    ref = _hf_greedy(model_dir, [p["prompt_token_ids"] for p in prompts], 12)
    for out, expected in zip(outs, ref):
        assert out.outputs[0].token_ids == expected
        reason = "stop" if expected[-1] == EOS else "length"
        assert out.outputs[0].finish_reason == reason


def test_steady_state_compiles_nothing(llama_dir):
    llm = specjax.LLM(llama_dir, warmup=True, **ENGINE_KW)
    warm = llm.get_metrics()["num_compiles"]
    assert warm == 9  # every (rows, query length) bucket, once
    with count_compiles() as counter:
        for seed, lengths in enumerate([[3], [7, 30, 2], [50, 1, 17, 4], [12, 12]]):
            params = [
                specjax.SamplingParams(temperature=0.0, max_tokens=6),
                specjax.SamplingParams(temperature=0.8, top_k=5, top_p=0.9, max_tokens=9, seed=seed),
                specjax.SamplingParams(temperature=1.0, max_tokens=4),
                specjax.SamplingParams(temperature=0.5, top_p=0.5, max_tokens=5),
            ][: len(lengths)]
            llm.generate(_prompts(seed, lengths), params)
    assert counter.count == 0
    assert llm.get_metrics()["num_compiles"] == warm


def test_preemption_gives_identical_outputs(llama_dir, llm):
    prompts = _prompts(5, [20, 25, 30, 18])
    params = [
        specjax.SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        specjax.SamplingParams(temperature=0.9, max_tokens=20, seed=1, ignore_eos=True),
        specjax.SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        specjax.SamplingParams(temperature=1.0, top_k=8, max_tokens=20, seed=2, ignore_eos=True),
    ]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    # 10 blocks of 8 tokens cannot hold four requests of ~45 tokens: some must be preempted.
    small = specjax.LLM(llama_dir, warmup=False, num_kv_blocks=10, **ENGINE_KW)
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params)]
    assert small.get_metrics()["num_preemptions"] > 0
    assert got == expected


def test_seeded_sampling_is_batch_invariant(llm):
    target = _prompts(9, [11])[0]
    params = specjax.SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate([target], params)[0].outputs[0].token_ids
    others = _prompts(10, [3, 29, 8])
    mixed = llm.generate(
        [others[0], target, others[1], others[2]],
        [specjax.SamplingParams(temperature=0.7, max_tokens=5), params,
         specjax.SamplingParams(temperature=0.0, max_tokens=20), specjax.SamplingParams(max_tokens=9, seed=1234)],
    )
    assert mixed[1].outputs[0].token_ids == alone
    again = llm.generate([target], params)[0].outputs[0].token_ids
    assert again == alone
    other_seed = llm.generate([target], specjax.SamplingParams(
        temperature=1.0, top_p=0.95, max_tokens=16, seed=4321, ignore_eos=True))[0].outputs[0].token_ids
    assert other_seed != alone


def test_stop_tokens_max_tokens_and_max_model_len(llm):
    prompt = _prompts(11, [6])
    base = llm.generate(prompt, specjax.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    ids = base[0].outputs[0].token_ids
    assert len(ids) == 10 and base[0].outputs[0].finish_reason == "length"
    stop = ids[4]
    first = ids.index(stop)
    stopped = llm.generate(prompt, specjax.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                          stop_token_ids=[stop]))[0].outputs[0]
    assert stopped.token_ids == ids[: first + 1] and stopped.finish_reason == "stop"
    long = _prompts(12, [60])
    capped = llm.generate(long, specjax.SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))[0]
    assert len(capped.outputs[0].token_ids) == ENGINE_KW["max_model_len"] - 60
    assert capped.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "make_call,field",
    [
        (lambda: ({"prompt_token_ids": []}, None), r"prompts\[1\] is empty"),
        (lambda: ({"prompt_token_ids": list(range(4, 70))}, None), "max_model_len"),
        (lambda: ({"prompt_token_ids": [5, 128]}, None), "prompt_token_ids"),
        (lambda: ({"prompt_token_ids": [5, -1]}, None), "prompt_token_ids"),
        (lambda: ({"prompt_token_ids": [5]}, dict(temperature=-0.1)), "temperature"),
        (lambda: ({"prompt_token_ids": [5]}, dict(top_p=0.0)), "top_p"),
        (lambda: ({"prompt_token_ids": [5]}, dict(top_p=1.5)), "top_p"),
        (lambda: ({"prompt_token_ids": [5]}, dict(max_tokens=0)), "max_tokens"),
        (lambda: ({"prompt_token_ids": [5]}, dict(top_k=-2)), "top_k"),
        (lambda: ("some text", None), "tokenizer"),
    ],
)
def test_bad_input_names_the_field_and_leaves_engine_usable(llm, make_call, field):
    good = _prompts(13, [7])[0]
    params = specjax.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    before = llm.generate([good], params)[0].outputs[0].token_ids
    bad_prompt, bad_params = make_call()
    with pytest.raises(ValueError, match=field):
        sp = specjax.SamplingParams(**bad_params) if bad_params else params
        llm.generate([good, bad_prompt], sp)
    after = llm.generate([good], params)[0].outputs[0].token_ids
    assert after == before
    assert not llm.engine.has_unfinished


def test_bad_model_directory(tmp_path, llama_dir):
    with pytest.raises(ValueError, match="missing"):
        specjax.LLM(tmp_path / "missing", warmup=False)
    cfg = json.loads((llama_dir / "config.json").read_text())
    bad = tmp_path / "gpt2ish"
    bad.mkdir()
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        specjax.LLM(bad, warmup=False)
    with pytest.raises(ValueError, match="dtype"):
        specjax.LLM(llama_dir, dtype="float16", warmup=False)


def test_cli_generate(llama_dir, capsys):
    from specjax.cli import main

    rc = main(["generate", "--model", str(llama_dir), "--prompt-token-ids", "5,6,7", "--max-tokens", "4",
               "--ignore-eos", "--no-warmup", "--max-model-len", "64"])
    captured = capsys.readouterr()
    assert rc == 0
    assert len(captured.out.split()) == 4
    assert "tokens/s" in captured.err
    assert main(["generate", "--model", str(llama_dir), "--prompt-token-ids", "5", "--temperature", "-1",
                 "--no-warmup"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_error_mid_generate_aborts_cleanly(llm, monkeypatch):
    params = specjax.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = _prompts(14, [5, 9])
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    real_launch = llm.runner.launch
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(llm.runner, "launch", flaky)
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate(prompts, params)
    monkeypatch.setattr(llm.runner, "launch", real_launch)
    assert not llm.engine.has_unfinished
    assert llm.engine.scheduler.blocks.num_free == llm.engine_config.total_kv_blocks
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == before


def test_validate_prompt_is_the_check_generate_applies(llm):
    ids = _prompts(14, [5])[0]["prompt_token_ids"]
    assert llm.validate_prompt({"prompt_token_ids": ids}) == ids
    with pytest.raises(ValueError, match=r"^prompt\.prompt_token_ids has ids outside"):
        llm.validate_prompt({"prompt_token_ids": [5, 128]})
    # Callers with their own field names (specjax batch) name the value alone.
    with pytest.raises(ValueError, match=r"^body\.prompt has ids outside"):
        llm.validate_prompt({"prompt_token_ids": [5, 128]}, field="body.prompt", name_keys=False)
    with pytest.raises(ValueError, match="more than max_model_len"):
        llm.validate_prompt({"prompt_token_ids": list(range(4, 70))})


def test_warmup_warns_where_another_llm_like_it_would_pass_the_memory_map_limit(llm, monkeypatch, caplog):
    import logging

    from specjax import buckets, runner

    assert buckets.maps_warning((1000, 65530), (1400, 65530)) is None  # (400 more would fit)
    assert buckets.maps_warning((40000, 65530), (60000, 65530)) is not None  # (20000 more would not)
    assert buckets.maps_warning((40000, 65530), (50000, 65530)) is None  # (10000 more fit: 60000)
    assert buckets.maps_warning(None, (60000, 65530)) is None  # (unreadable: not Linux)
    used, limit = buckets.memory_maps()  # (this machine is Linux)
    assert 0 < used < limit
    readings = iter([(30000, 65530), (48000, 65530)])  # (the warmup's compiles took 18000 mappings)
    monkeypatch.setattr(runner, "memory_maps", lambda: next(readings))
    with caplog.at_level(logging.WARNING, logger="specjax.runner"):
        llm.warmup([{"prompt_token_ids": [5] * 5}])
    assert any("vm.max_map_count=65530" in r.getMessage() and "18000" in r.getMessage() for r in caplog.records)


def test_warmup_for_known_prompts_compiles_only_their_prefill_lengths(llama_dir):
    """``LLM.warmup(prompts)`` (what ``specjax generate`` runs) compiles decoding plus the query lengths these
    prompts prefill in, and generating them then compiles nothing."""
    kw = dict(warmup=False, max_model_len=128, max_num_seqs=1, max_prefill_chunk=16)
    uncut = specjax.LLM(llama_dir, mixed_step_padding=None, **kw)
    assert uncut.engine_config.length_buckets == (1, 4, 16)
    # Whole chunks: 7 tokens prefill in one step of 7 (bucket 16); 3 in bucket 4; 33 in 16 + 16 + 1 (16 and 1).
    assert sorted(t for _, t, _ in uncut.engine.buckets([7])) == [1, 16]
    assert sorted(t for _, t, _ in uncut.engine.buckets([3, 33])) == [1, 4, 16]
    assert sorted(t for _, t, _ in uncut.engine.buckets([33])) == [1, 16]
    assert sorted(t for _, t, _ in uncut.engine.buckets(None)) == [1, 4, 16]
    # Where chunks may be cut (the default), every shorter bucket too: 3 tokens need 1 and 4, 7 all three.
    llm = specjax.LLM(llama_dir, **kw)
    assert sorted(t for _, t, _ in llm.engine.buckets([3])) == [1, 4]
    assert sorted(t for _, t, _ in llm.engine.buckets([7])) == [1, 4, 16]
    prompts = _prompts(3, [3])
    llm.warmup(prompts)
    assert llm.num_compiles == 2
    with count_compiles() as counter:
        llm.generate(prompts, specjax.SamplingParams(temperature=0.0, max_tokens=6))
    assert counter.count == 0 and llm.num_compiles == 2
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        llm.warmup([prompts[0], {"prompt_token_ids": [10**9]}])


def _steps(config, arrivals: dict[int, list[tuple[str, int]]], num_steps: int,
           scheduler=None, drafting: bool = False) -> list[list[tuple[str, int]]]:
    """Each step's rows, (request id, tokens), from a bare scheduler (``scheduler``: its class): ``arrivals`` maps
    a step index to the requests (id, prompt length) added before it; every chunk that reaches its request's end
    samples token 7 (``drafting``: as the decoding rows of a speculative engine that verifies drafts)."""
    from specjax.scheduler import Request, Scheduler

    sched, steps = (scheduler or Scheduler)(config), []
    for i in range(num_steps):
        for rid, n in arrivals.get(i, ()):
            sched.add(Request(rid, [5] * n, specjax.SamplingParams(max_tokens=50), seed=0, seed_stream=0,
                              stop_ids=frozenset()))
        rows = sched.schedule(drafting=drafting)
        steps.append([(r.request.request_id, r.num_new) for r in rows])
        for r in rows:
            sched.commit(r, [7] if r.samples else [])
    return steps


def test_decoding_rows_and_prompt_chunks_take_turns_where_one_step_of_both_pads_more():
    from specjax.config import EngineConfig

    kw = dict(max_model_len=128, max_num_seqs=4, block_size=8, max_prefill_chunk=16)  # rows 1, 2, 4; query 1, 4, 16
    arrivals = {0: [("a", 4), ("b", 4)], 1: [("c", 40)]}  # c's prompt: chunks of 16, 16 and 8 (query bucket 16)
    # Mixed, a step of a, b and a chunk of c is 4 rows x 16 slots = 64; apart, 1 x 16 + 2 x 1 = 18: 46 more.
    mixed = [[("a", 4), ("b", 4)]] + [[("a", 1), ("b", 1), ("c", n)] for n in (16, 16, 8)] + [[("a", 1), ("b", 1),
                                                                                              ("c", 1)]]
    assert _steps(EngineConfig(**kw, mixed_step_padding=None), arrivals, 5) == mixed
    assert _steps(EngineConfig(**kw, mixed_step_padding=46), arrivals, 5) == mixed  # (at most 46 more: mixed)
    # Past it, turns: a chunk of c, then a and b (c's last chunk samples, so after it all three decode at once).
    turns = [[("a", 4), ("b", 4)], [("c", 16)], [("a", 1), ("b", 1)], [("c", 16)], [("a", 1), ("b", 1)], [("c", 8)],
             [("a", 1), ("b", 1), ("c", 1)]]
    assert _steps(EngineConfig(**kw, mixed_step_padding=45), arrivals, 7) == turns
    assert EngineConfig(**kw).mixed_step_padding == 16  # (the default takes turns here)
    # Decoding rows that would verify drafts take turns at any padding (a step with a prompt chunk verifies none),
    # except with None (always mix).
    assert _steps(EngineConfig(**kw, mixed_step_padding=46), arrivals, 7, drafting=True) == turns
    assert _steps(EngineConfig(**kw, mixed_step_padding=None), arrivals, 5, drafting=True) == mixed
    # With one row bucket of 4, mixing pads nothing (4 x 16 either way, and 4 x 1 more apart): mixed. (And c's
    # last 8 tokens are cut to 4 + 4: a step of 4 x 4 slots costs (16 + 16) / 4 per token, one of 4 x 16 (64 + 16)
    # / 8; see the next test.)
    one_bucket = mixed[:3] + [[("a", 1), ("b", 1), ("c", 4)]] * 2
    assert _steps(EngineConfig(**kw, batch_buckets=(4,)), arrivals, 5) == one_bucket
    # A chunk turn admits waiting requests with the decoding rows' budget too (17 tokens: without theirs, 15).
    budget = dict(kw, max_num_batched_tokens=17)
    got = _steps(EngineConfig(**budget), {0: [("a", 4), ("b", 4)], 1: [("c", 40)]}, 3)
    assert got[1:] == [[("c", 16)], [("a", 1), ("b", 1)]]
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="mixed_step_padding"):
            EngineConfig(**kw, mixed_step_padding=bad)


def test_prompt_chunks_are_cut_to_the_query_bucket_that_costs_least_per_token():
    from specjax.config import EngineConfig, bucket_for

    kw = dict(max_model_len=256, max_num_seqs=4, block_size=8, max_prefill_chunk=64)  # query buckets 1, 4, 16, 64
    # One prompt of 20 tokens: in one chunk a step of 64 slots (cost 64 + 16 per step = 80, 4 per token); cut to
    # 16 it costs 16 + 16 = 32 for 16 tokens (2 per token); the 4 left are the next step's chunk.
    assert _steps(EngineConfig(**kw), {0: [("a", 20)]}, 3) == [[("a", 16)], [("a", 4)], [("a", 1)]]
    assert _steps(EngineConfig(**kw, mixed_step_padding=None), {0: [("a", 20)]}, 2) == [[("a", 20)], [("a", 1)]]
    # 5 tokens: whole, a step costs at least 16 slots (32 in all); cut, 32 for 4 of them and 32 for the last.
    assert _steps(EngineConfig(**kw), {0: [("a", 5)]}, 2) == [[("a", 5)], [("a", 1)]]
    # A prompt alone is cut the way that finishes it cheapest, not the next step: with chunks of up to 128, 100
    # tokens in one step of 128 slots cost 144; 64 of them (80 for 64 tokens, the cheaper step per token), then
    # 36 (at best 80 more), 160.
    assert _steps(EngineConfig(**dict(kw, max_prefill_chunk=128)), {0: [("a", 100)]}, 2) == [[("a", 100)], [("a", 1)]]
    # Prompts of 20, 60 and 10 tokens together: whole, 4 rows x 64 slots (272 / 90 per token); cut to 16, 4 x 16
    # (80 / 42); cut to 4, 4 x 4 (32 / 12).
    assert _steps(EngineConfig(**kw), {0: [("a", 20), ("b", 60), ("c", 10)]}, 1) == [[("a", 16), ("b", 16),
                                                                                   ("c", 10)]]
    # Many prompts: each computed in full, in fewer padded slots than with every chunk cap at the prefill chunk
    # (the scheduler before the cut, with the same turns).
    from specjax.scheduler import Scheduler

    class Uncut(Scheduler):
        def _chunk_cap(self, budget):
            return self.config.prefill_chunk

    lengths = [3, 70, 21, 9, 64, 17, 40, 5, 33, 66, 12, 50]
    arrivals = {0: [(f"r{i}", n) for i, n in enumerate(lengths)]}
    cfg = EngineConfig(**kw)
    padded = {}
    for name, scheduler in (("cut", None), ("uncut", Uncut)):
        steps = _steps(cfg, arrivals, 400, scheduler)
        assert steps[-1] == []  # (all finished)
        computed = {}
        for step in steps:
            for rid, n in step:
                computed[rid] = computed.get(rid, 0) + n
        assert all(computed[f"r{i}"] == n + 49 for i, n in enumerate(lengths))  # (the prompt, then 49 decoding)
        chunk_steps = [step for step in steps if any(n > 1 for _, n in step)]
        padded[name] = sum(bucket_for(len(step), cfg.row_buckets, "rows") *
                           bucket_for(max(n for _, n in step), cfg.length_buckets, "query") for step in chunk_steps)
    assert padded["cut"] < padded["uncut"]  # (544 and 800 slots when written)


def test_outputs_do_not_depend_on_whether_decoding_rows_and_chunks_mix(llama_dir, llm):
    prompts = _prompts(11, [5, 40, 3, 33])
    params = [specjax.SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
              specjax.SamplingParams(temperature=0.9, top_p=0.9, max_tokens=14, seed=3, ignore_eos=True),
              specjax.SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
              specjax.SamplingParams(temperature=1.0, max_tokens=14, seed=4, ignore_eos=True)]
    assert llm.engine_config.mixed_step_padding == 16  # ("auto" on CPU)
    turns = llm.generate(prompts, params)
    mixed_llm = specjax.LLM(llama_dir, warmup=False, mixed_step_padding=None, **ENGINE_KW)
    mixed = mixed_llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in turns] == [o.outputs[0].token_ids for o in mixed]
    assert llm.get_metrics()["num_steps"] != mixed_llm.get_metrics()["num_steps"]  # (the steps did differ)
    # Prompts whose chunks are cut (None never cuts): 16 tokens beside three of 3 run as 4 + 12 (4 rows x 4 slots,
    # 32 for 13 tokens, against 4 x 16, 80 for 25).
    cut_prompts = _prompts(12, [16, 3, 3, 3])
    first = _steps(llm.engine_config, {0: [(str(i), len(p["prompt_token_ids"])) for i, p in enumerate(cut_prompts)]},
                   2)
    assert first == [[("0", 4), ("1", 3), ("2", 3), ("3", 3)], [("0", 12)]]
    cut, whole = llm.generate(cut_prompts, params), mixed_llm.generate(cut_prompts, params)
    assert [o.outputs[0].token_ids for o in cut] == [o.outputs[0].token_ids for o in whole]
    with pytest.raises(ValueError, match="mixed_step_padding"):
        specjax.LLM(llama_dir, warmup=False, mixed_step_padding="fast", **ENGINE_KW)
