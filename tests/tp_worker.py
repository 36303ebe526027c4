"""Run by test_sharding.py in a subprocess with 8 forced host devices (XLA_FLAGS must be set before jax loads).

Prints one JSON object: greedy outputs per (tp, dp, method), the shardings of
params and caches, and the compile count of a steady-state generate.
"""

import json
import os
import sys
import tempfile

# A collective waits for all 8 devices' threads; on a 2-core machine running other tests beside it one thread
# missed XLA's default 40 s rendezvous timeout once (2026-12-05), aborting the process: give it 10 minutes.
os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8"
                           " --xla_cpu_collective_call_terminate_timeout_seconds=600")

import jax  # noqa: E402

import specjax  # noqa: E402
from specjax.buckets import count_compiles  # noqa: E402


def spec_str(array) -> str:
    return str(tuple(array.sharding.spec))


def main(model_dir: str) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    prompts = [{"prompt_token_ids": [1, 5, 9, 13, 2, 7]}, {"prompt_token_ids": [3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 4, 5]}]
    sp = specjax.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    from models.heads import HeadConfig, init_head_params, save_head
    from models.loading import load_hf_model

    # An EAGLE-3 head (random; replicated under any tp) reading the target's aux layers through sharded verify.
    head = HeadConfig.for_target("eagle3", load_hf_model(model_dir)[0])
    head_dir = save_head(tempfile.mkdtemp(), head, init_head_params(head, jax.random.key(0)), dtype="float32")
    # Fixed K (adaptive off): the plan, not the controller, is under test, and one K keeps compiles few.
    specs = {
        "plain": None,
        "eagle3": {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": 2, "adaptive": False},
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False},
        "draft_model": {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 2, "adaptive": False},
        "draft_model_tp1": {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 2,
                            "draft_tensor_parallel_size": 1, "adaptive": False},
    }
    out = {"outputs": {}, "shardings": {}, "steady_compiles": {}}
    # Which methods run at each (tp, dp): every method at tp 1 and 2; the replicate fallback (tp 4 > 2 KV
    # heads) and dp 2 with the methods whose device state they shard differently. Host drafts (ngram) are
    # placed like any input, so dp adds nothing for them. Compiles dominate this worker's time.
    runs = {(1, 1): ["plain", "eagle3", "ngram", "draft_model"],
            (2, 1): ["plain", "eagle3", "ngram", "draft_model", "draft_model_tp1"],
            (4, 1): ["plain"], (2, 2): ["plain", "draft_model"]}
    warmed = {"plain", "eagle3", "draft_model"}  # at tp 2: then a steady-state generate must compile nothing
    for (tp, dp), names in runs.items():
        for name in names:
            spec = specs[name]
            llm = specjax.LLM(
                model_dir, tensor_parallel_size=tp, data_parallel_size=dp, max_num_seqs=2, max_model_len=64,
                query_buckets=(1, 16), speculative_config=spec, warmup=(tp, dp) == (2, 1) and name in warmed,
            )
            with count_compiles() as c:
                res = llm.generate(prompts, sp, use_tqdm=False)
            key = f"tp{tp}_dp{dp}_{name}"
            out["outputs"][key] = [r.outputs[0].token_ids for r in res]
            if (tp, dp) == (2, 1) and name in warmed:
                out["steady_compiles"][key] = c.count
            if (tp, dp) == (2, 1):
                target_params, proposer_params = llm.runner.params
                layer = target_params["layers_0"]
                sh = {
                    "q_proj": spec_str(layer["self_attn"]["q_proj"]["kernel"]),
                    "k_proj": spec_str(layer["self_attn"]["k_proj"]["kernel"]),
                    "o_proj": spec_str(layer["self_attn"]["o_proj"]["kernel"]),
                    "gate_proj": spec_str(layer["mlp"]["gate_proj"]["kernel"]),
                    "down_proj": spec_str(layer["mlp"]["down_proj"]["kernel"]),
                    "embed": spec_str(target_params["embed_tokens"]["embedding"]),
                    "norm": spec_str(target_params["norm"]["scale"]),
                    "kv_cache": spec_str(llm.runner.state.target_kv.k[0]),
                    "num_devices": len(llm.runner.state.target_kv.k[0].sharding.device_set),
                }
                if name.startswith("draft_model"):
                    dl = proposer_params[0]["layers_0"]
                    attn = dl["self_attn"]  # a large replicated draft on CPU devices would run in the derived CPU layout
                    sh["draft_q_proj"] = (f"cpu layout {spec_str(attn['qkv_proj']['kernel_t'])}" if "qkv_proj" in attn
                                          else spec_str(attn["q_proj"]["kernel"]))
                    sh["draft_kv_cache"] = spec_str(llm.runner.state.proposer.kv.k[0])
                out["shardings"][key] = sh
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
