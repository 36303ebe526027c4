"""Tensor/data parallel plan: partition specs by hand-written expectation, and tp/dp runs on 8 forced CPU devices."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from models.llama import LlamaConfig, init_params
from specjax.config import EngineConfig
from specjax.parallel.sharding import ShardingPlan, kv_partition_spec, make_mesh, param_partition_specs
from tiny_models import make_tiny_checkpoint


def _config(**kw) -> LlamaConfig:
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, attention_bias=True)
    base.update(kw)
    return LlamaConfig(**base)


def _specs(config: LlamaConfig, tp: int):
    params = init_params(config, jax.random.key(0), dtype=jnp.float32)
    return param_partition_specs(params, config, tp=tp)


def test_gqa_plan_tp2_matches_the_megatron_layout():
    s = _specs(_config(), tp=2)
    attn, mlp = s["layers_0"]["self_attn"], s["layers_0"]["mlp"]
    assert attn["q_proj"]["kernel"] == P(None, "tp", None)
    assert attn["q_proj"]["bias"] == P("tp", None)
    assert attn["k_proj"]["kernel"] == P(None, "tp", None)
    assert attn["v_proj"]["bias"] == P("tp", None)
    assert attn["o_proj"]["kernel"] == P("tp", None, None)
    assert mlp["gate_proj"]["kernel"] == P(None, "tp")
    assert mlp["up_proj"]["kernel"] == P(None, "tp")
    assert mlp["down_proj"]["kernel"] == P("tp", None)
    assert s["embed_tokens"]["embedding"] == P("tp", None)
    assert s["lm_head"]["kernel"] == P(None, "tp")
    assert s["norm"]["scale"] == P()
    assert s["layers_0"]["input_layernorm"]["scale"] == P()
    assert kv_partition_spec(_config(), tp=2) == P(None, "tp", None)


def test_mqa_replicates_kv_heads_and_keeps_q_split(caplog):
    cfg = _config(num_key_value_heads=1)
    with caplog.at_level("WARNING"):
        s = _specs(cfg, tp=2)
    attn = s["layers_0"]["self_attn"]
    assert attn["q_proj"]["kernel"] == P(None, "tp", None)
    assert attn["k_proj"]["kernel"] == P(None, None, None)
    assert attn["v_proj"]["kernel"] == P(None, None, None)
    assert kv_partition_spec(cfg, tp=2) == P(None, None, None)
    assert "kv heads" in caplog.text


def test_tp1_replicates_everything():
    s = _specs(_config(), tp=1)
    assert all(all(a is None for a in spec) for spec in jax.tree.leaves(s, is_leaf=lambda x: isinstance(x, P)))


def test_unknown_parameter_is_an_error():
    cfg = _config()
    params = init_params(cfg, jax.random.key(0), dtype=jnp.float32)
    params["layers_0"]["mystery"] = {"kernel": jnp.zeros((2, 2))}
    with pytest.raises(ValueError, match="layers_0/mystery/kernel"):
        param_partition_specs(params, cfg, tp=2)


def test_parallel_sizes_are_validated():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        make_mesh(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="needs 64 devices"):
        make_mesh(tensor_parallel_size=64)
    with pytest.raises(ValueError, match="tp=3"):
        ShardingPlan(mesh=make_mesh(), tp=3)
    with pytest.raises(ValueError, match="data_parallel_size"):
        EngineConfig(data_parallel_size=0)
    with pytest.raises(ValueError, match="multiples of data_parallel_size=2"):
        EngineConfig(max_num_seqs=4, batch_buckets=(1, 4), data_parallel_size=2)
    assert EngineConfig(max_num_seqs=6, data_parallel_size=2).row_buckets == (2, 4, 6)


def test_llm_rejects_bad_parallel_layout(tmp_path):
    import specjax

    d = make_tiny_checkpoint(tmp_path / "m", "llama", num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="tensor_parallel_size=16"):
        specjax.LLM(d, tensor_parallel_size=16, warmup=False)
    with pytest.raises(ValueError, match="draft_tensor_parallel_size"):
        specjax.LLM(d, speculative_config={"method": "draft_model", "model": d, "num_speculative_tokens": 2,
                                            "draft_tensor_parallel_size": 3}, max_model_len=64, warmup=False)


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    d = make_tiny_checkpoint(tmp_path_factory.mktemp("tp") / "m", "llama", num_heads=4, num_kv_heads=2)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    tests_dir = Path(__file__).parent
    env["PYTHONPATH"] = os.pathsep.join([str(tests_dir.parent), str(tests_dir), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(tests_dir / "tp_worker.py"), str(d)], env=env, capture_output=True,
                          text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_tp_and_dp_give_identical_greedy_outputs(tp_run):
    outputs = tp_run["outputs"]
    # tp 1 and 2: plain / eagle3 / ngram / draft_model (tp 2 also with the draft whole on each device);
    # tp 4 (> 2 KV heads: the replicate fallback) plain; dp 2 (with tp 2) plain / draft_model.
    assert len(outputs) == 12
    reference = outputs["tp1_dp1_plain"]
    assert all(len(o) == 12 for o in reference)
    for key, out in outputs.items():
        assert out == reference, key


def test_shardings_follow_the_plan(tp_run):
    sh = tp_run["shardings"]
    expected = {
        "q_proj": "(None, 'tp', None)", "k_proj": "(None, 'tp', None)", "o_proj": "('tp', None, None)",
        "gate_proj": "(None, 'tp')", "down_proj": "('tp', None)", "embed": "('tp', None)", "norm": "()",
        "kv_cache": "(None, 'tp', None)", "num_devices": 2,
    }
    for key in ("tp2_dp1_plain", "tp2_dp1_eagle3", "tp2_dp1_ngram", "tp2_dp1_draft_model",
                "tp2_dp1_draft_model_tp1"):
        assert {k: sh[key][k] for k in expected} == expected, key
    # The draft gets the same plan: split with the target by default, whole on every device at draft tp 1.
    assert sh["tp2_dp1_draft_model"]["draft_q_proj"] == "(None, 'tp', None)"
    assert sh["tp2_dp1_draft_model"]["draft_kv_cache"] == "(None, 'tp', None)"
    # Whole on every device (several devices keep the checkpoint layout; specjax.backends.use_cpu_weight_layout).
    assert sh["tp2_dp1_draft_model_tp1"]["draft_q_proj"] == "(None, None, None)"
    assert sh["tp2_dp1_draft_model_tp1"]["draft_kv_cache"] == "(None, None, None)"


def test_sharded_steady_state_compiles_nothing(tp_run):
    assert tp_run["steady_compiles"] == {"tp2_dp1_plain": 0, "tp2_dp1_eagle3": 0, "tp2_dp1_draft_model": 0}
