"""The one compiled step: one executable call and one device-to-host fetch per engine step, for every method;
host buffers that grow with new tokens only; the proposer registry."""

import jax
import numpy as np
import pytest
from jax._src.array import ArrayImpl

import specjax
from models.heads import HeadConfig, init_head_params, save_head
from models.loading import load_hf_model
from specjax.buckets import count_compiles
from specjax.spec_decode import proposer as proposer_module
from tiny_models import make_tiny_checkpoint

KW = dict(max_model_len=64, max_num_seqs=2, block_size=8, max_prefill_chunk=16, query_buckets=(1, 16))


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("target"), family="llama", num_kv_heads=2, num_layers=2,
                                vocab_size=32, eos_token_id=None, seed=0)


@pytest.fixture(scope="module")
def head_dir(target_dir, tmp_path_factory):
    config, _ = load_hf_model(target_dir)
    h = HeadConfig.for_target("eagle", config)
    return save_head(tmp_path_factory.mktemp("eagle"), h, init_head_params(h, jax.random.key(1)), dtype="float32")


class _Fetches:
    """Counts every conversion of a jax.Array to host values, at each place one can happen from Python.

    The array's own conversion methods (``__array__`` / ``_value``, which ``jax.device_get`` goes through, and
    ``tolist``, ``item``, ``int()``, ``float()``, ``bool()``, ``index``) and numpy's ``asarray`` / ``array``, which
    on CPU read a jax.Array through the buffer protocol without calling any of its methods. One conversion may
    pass through two of these (``device_get`` calls ``__array__``, which reads ``_value``); only the outermost
    counts.
    """

    def __init__(self, monkeypatch):
        self.count = 0
        self._depth = 0

        def counted(fn):
            def wrapper(*args, **kwargs):
                outer = self._depth == 0
                self._depth += 1
                try:
                    return fn(*args, **kwargs)
                finally:
                    self._depth -= 1
                    self.count += outer
            return wrapper

        for name in ("__array__", "tolist", "item", "__int__", "__float__", "__bool__", "__index__"):
            monkeypatch.setattr(ArrayImpl, name, counted(getattr(ArrayImpl, name)))
        value = ArrayImpl.__dict__["_value"]
        monkeypatch.setattr(ArrayImpl, "_value", property(counted(value.fget)))
        for name in ("asarray", "array"):
            original = getattr(np, name)

            def numpy_conversion(x, *args, _original=original, **kwargs):
                if isinstance(x, jax.Array):
                    return counted(_original)(x, *args, **kwargs)
                return _original(x, *args, **kwargs)

            monkeypatch.setattr(np, name, numpy_conversion)


def _spec(method, target_dir, head_dir):
    return {
        "plain": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
        "draft_model": {"method": "draft_model", "model": str(target_dir), "num_speculative_tokens": 3},
        "eagle": {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": 3},
        "synthetic": {"rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.5,
                      "num_speculative_tokens": 3},
    }[method]


@pytest.mark.parametrize("method", ["plain", "ngram", "draft_model", "eagle", "synthetic"])
def test_one_fetch_and_one_call_per_step(target_dir, head_dir, method, monkeypatch):
    llm = specjax.LLM(target_dir, speculative_config=_spec(method, target_dir, head_dir), **KW)
    prompts = [{"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}, {"prompt_token_ids": [9, 10, 11]}]
    params = [specjax.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              specjax.SamplingParams(temperature=0.9, max_tokens=12, ignore_eos=True, seed=1)]
    llm.generate(prompts, params, use_tqdm=False)  # the first real steps
    calls = {"n": 0}
    for executables in (llm.runner.executables, llm.runner.detached_executables):  # detached: syncing methods
        if executables is None:
            continue

        def get(bucket, _real=executables.get):
            calls["n"] += 1
            return _real(bucket)

        monkeypatch.setattr(executables, "get", get)
    fetches = _Fetches(monkeypatch)
    steps_before = llm.get_metrics()["num_steps"]
    with count_compiles() as compiles:
        outs = llm.generate(prompts, params, use_tqdm=False)
    steps = llm.get_metrics()["num_steps"] - steps_before
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert compiles.count == 0
    assert calls["n"] == steps  # one executable per step
    assert fetches.count == steps  # and exactly one device-to-host fetch
    if method != "plain":
        assert llm.get_metrics()["num_drafts"] > 0


def test_host_buffers_are_per_slot_and_filled_by_gather(target_dir):
    """Building a step reads the per-slot buffers; the requests' Python lists are not rebuilt per step."""
    llm = specjax.LLM(target_dir, warmup=False, **KW)
    table = llm.engine.scheduler.slots
    assert table.tokens.shape == (KW["max_num_seqs"], KW["max_model_len"])
    params = specjax.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    request = llm._make_request([4, 5, 6], params)
    llm.engine.add_request(request)
    llm.engine.step()  # prefill + first token
    slot = request.slot
    assert table.history(slot).tolist() == [4, 5, 6] + request.output_token_ids
    llm.engine.step()
    assert table.history(slot).tolist() == [4, 5, 6] + request.output_token_ids
    while llm.engine.has_unfinished:
        llm.engine.step()
    assert request.slot is None and table.num_free == KW["max_num_seqs"]


def test_registry_names_every_method_and_rejects_unknown():
    assert set(proposer_module._MODULES) == {"none", "ngram", "suffix", "draft_model", "eagle", "eagle3", "mtp",
                                             "medusa"}
    for name, module in proposer_module._MODULES.items():
        __import__(module)
        assert name in proposer_module._BUILDERS
    with pytest.raises(ValueError, match="no registered proposer"):
        proposer_module.build(proposer_module.BuildContext(
            spec=type("S", (), {"method": "hydra"})(), target_config=None, engine_config=None, tokenizer=None,
            dtype="float32", tensor_parallel_size=1, mesh=None))


def test_profile_mode_splits_phase_times_and_keeps_output(target_dir):
    spec = {"method": "draft_model", "model": str(target_dir), "num_speculative_tokens": 2}
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}]
    params = specjax.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    fused = specjax.LLM(target_dir, speculative_config=spec, warmup=False, **KW)
    profiled = specjax.LLM(target_dir, speculative_config=spec, warmup=False, profile=True, **KW)
    assert [o.outputs[0].token_ids for o in profiled.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in fused.generate(prompts, params)]
    m = profiled.get_metrics()
    assert m["draft_time_s"] > 0 and m["verify_time_s"] > 0 and m["sample_time_s"] > 0
    assert "draft_time_s" not in fused.get_metrics()
    assert np.isfinite(m["mean_step_s"]) and m["mean_step_s"] > 0


def test_packed_batch_round_trips_every_field_and_host_views_write_through():
    """The compiled step receives a StepBatch as three int32 arrays; unpacking (as inside the step) gives back
    each field with its dtype and values, and the engine's host buffers are views that fill those arrays."""
    from specjax.step import StepBatch, host_buffers, pack

    rng = np.random.default_rng(0)
    b, t, k, m = 3, 5, 2, 7
    fields = {}
    for name, a in vars(StepBatch.zeros(b, t, k, m)).items():
        if a.dtype == np.bool_:
            fields[name] = rng.random(a.shape) < 0.5
        elif a.dtype == np.float32:
            fields[name] = rng.normal(size=a.shape).astype(np.float32)
            fields[name].flat[0] = -np.inf  # bits survive: a banned bias
        elif a.dtype == np.uint32:
            fields[name] = rng.integers(0, 2**32, a.shape, dtype=np.uint64).astype(np.uint32)
        else:
            fields[name] = rng.integers(-1, 1000, a.shape).astype(np.int32)
    original = StepBatch(**fields)
    packed = pack(original)
    assert [x.dtype for x in jax.tree.leaves(packed)] == [np.int32] * 3
    unpacked = jax.jit(lambda p: p.unpack())(packed)
    for name, want in fields.items():
        got = np.asarray(getattr(unpacked, name))
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(got, want, err_msg=name)

    views, buffers = host_buffers(b, t, k, m)
    for name, want in fields.items():
        getattr(views, name)[...] = want
    for got, want in zip(jax.tree.leaves(buffers), jax.tree.leaves(packed)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("length,scalar_rows", [(1, 4), (1, 0), (8, 4)])
def test_slot_table_fills_a_step_as_each_request_and_chunk_define_it(length, scalar_rows, monkeypatch):
    """``SlotTable.fill`` (one gather of per-slot records, or row by row for a few decoding rows) writes each row
    as its request and chunk define it, field by field from a per-row reference, and leaves the rows past them
    padding."""
    from specjax import input_batch
    from specjax.input_batch import SlotTable
    from specjax.scheduler import Request
    from specjax.step import StepBatch, host_buffers

    monkeypatch.setattr(input_batch, "SCALAR_ROWS", scalar_rows)  # 0: the vectorized path for every step

    bs, blocks, max_len = 4, 6, 24
    table = SlotTable(3, max_len, bs, blocks)
    params = [specjax.SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, presence_penalty=0.5,
                                     frequency_penalty=0.25, repetition_penalty=1.3, min_tokens=2, logprobs=3,
                                     seed=11),
              specjax.SamplingParams(temperature=0.0, max_tokens=7)]
    requests = []
    for i, (p, prompt) in enumerate(zip(params, ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [7, 7, 8]))):
        r = Request(request_id=str(i), prompt_token_ids=prompt, params=p, seed=100 + i, seed_stream=i,
                    stop_ids=frozenset({2, 9}) if i == 0 else frozenset(), logit_bias=((4, 6), (1.5, -np.inf)))
        r.output_token_ids = [11, 12, 13] if i == 1 else []
        table.release(r)  # (no slot yet: a no-op)
        requests.append(r)
    table.assign(requests[1])
    table.assign(requests[0])  # slots in the order rows will not have
    for r, owned in zip(requests, ([10, 11, 12], [20, 21])):
        table.sync_blocks(r.slot, owned)
    history = [r.prompt_token_ids + r.output_token_ids for r in requests]
    # Row 0 prefills positions 5.. of its prompt (chunked at ``length``), row 1 decodes its last token (position 5).
    starts = np.array([5, len(history[1]) - 1])
    num_new = np.array([min(length, 4), 1])
    slots = np.array([r.slot for r in requests])
    outputs = np.array([len(r.output_token_ids) for r in requests])
    views, packed = host_buffers(3, length, 2, blocks)
    table.fill(views, packed, slots, starts, num_new, outputs)

    want = StepBatch.zeros(3, length, 2, blocks)
    for i, (r, hist, owned) in enumerate(zip(requests, history, ([10, 11, 12], [20, 21]))):
        p = r.params
        for j in range(num_new[i]):
            pos = starts[i] + j
            want.tokens[i, j], want.positions[i, j] = hist[pos], pos
            want.slot_mapping[i, j] = owned[pos // bs] * bs + pos % bs
        want.block_tables[i, : len(owned)] = owned
        want.last_index[i], want.slots[i] = num_new[i] - 1, r.slot
        end = starts[i] + num_new[i]
        want.prev_token[i] = hist[starts[i] - 1]
        want.next_token[i] = hist[end] if end < len(hist) else -1
        want.temperature[i], want.top_k[i], want.top_p[i] = p.temperature, p.top_k_or_off, p.top_p
        want.seed_streams[i], want.seeds[i], want.sample_indices[i] = i, 100 + i, outputs[i]
        want.min_p[i], want.presence_penalty[i] = p.min_p, p.presence_penalty
        want.frequency_penalty[i], want.repetition_penalty[i] = p.frequency_penalty, p.repetition_penalty
        want.bias_ids[i, :2], want.bias_values[i, :2] = (4, 6), (1.5, -np.inf)
        want.min_tokens[i] = p.min_tokens
        if p.min_tokens:
            want.stop_ids[i, :2] = (2, 9)
        want.prompt_len[i], want.reset[i] = len(r.prompt_token_ids), True
        want.num_logprobs[i] = -1 if p.logprobs is None else p.logprobs
    for name, expected in vars(want).items():
        np.testing.assert_array_equal(getattr(views, name), expected, err_msg=name)
    # A second step of the same rows: the slots are no longer fresh.
    table.fill(views, packed, slots, starts, num_new, outputs)
    assert not views.reset.any()


def test_steps_take_the_leaves_of_params_state_and_batch_and_donate_the_state(target_dir, head_dir):
    """A compiled step is called with positional arrays (parsing nested dicts of parameters cost ~40 us a call);
    the state it returns replaces the donated one, and a detached step leaves the proposer's state as it was."""
    llm = specjax.LLM(target_dir, speculative_config=_spec("draft_model", target_dir, head_dir), **KW)
    runner = llm.runner
    for executables, bucket, attached in ((runner.executables, (2, 1, 3), True),
                                          (runner.detached_executables, (2, 1, 0), False)):
        args_tree = jax.tree_util.treedef_children(executables.get(bucket).in_tree)[0]
        assert all(jax.tree_util.treedef_is_leaf(t) for t in jax.tree_util.treedef_children(args_tree))
        before = runner.state
        batch = runner.host_batch(bucket)
        batch.attached[:] = attached
        runner.run(batch)
        after = runner.state
        for name in ("target_kv", "proposer", "sampling"):
            old, new = jax.tree.leaves(getattr(before, name)), jax.tree.leaves(getattr(after, name))
            kept = name == "proposer" and not attached
            assert all((a is b) == kept and a.is_deleted() != kept for a, b in zip(old, new)), name
    assert jax.tree.structure(llm.runner.state) == jax.tree.structure(before)
    with pytest.raises(ValueError, match="state"):
        runner.state = runner.state.replace(proposer=None)
