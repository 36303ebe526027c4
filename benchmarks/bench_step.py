"""The one compiled step (issue 12): host overhead per step, speculative speed-ups, start-up.

Sections (one JSON under ``--out``; every ratio from systems run side by side, interleaved, medians):

a. Host overhead per step: the wall time of ``Engine.step`` minus the time spent inside the compiled
   executables it called (each call wrapped, its outputs waited for). Run with ``--json-only`` by the same
   script in a checkout of an older commit (``--before DIR``), so before/after come from one machine in
   one run. Batch 1 and 8, plain and draft_model K=4 on the shipped pair, greedy.
b. Speculative speed-up at batch 1, greedy, fixed K = 4 (``"adaptive": false``) and adaptive: the shipped
   pair (draft_model), the shipped target + its EAGLE-3 head, and synthetic acceptance 0.9 on a random
   ~30M-parameter Llama. Identical greedy tokens are checked.
c. Start-up of ``specjax generate --prompt "def parse_args(argv):"`` on the shipped stdlib pair (the default
   pair until SmolLM2 became it; ``bench_default.py`` times today's default) in a subprocess
   with an empty compilation cache (cold) and again with the cache it filled (warm): wall time to the
   first printed output and in all.

    python benchmarks/bench_step.py --out benchmarks/results/step.json --before /tmp/specjax-before
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger("bench_step")
REPO = Path(__file__).resolve().parents[1]


def _prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    # The checkout being measured (cwd: this one, or --before's) supplies the prompt builder, whose module
    # imports that checkout's specjax.
    sys.path.insert(0, str(Path.cwd() / "benchmarks"))
    from bench_builtin import token_prompts

    return token_prompts(tokenizer, n, length)


def host_overhead(reps: int, new_tokens: int) -> dict:
    """Per-step wall time and time inside compiled executables, for this checkout's engine."""
    import jax
    import numpy as np

    import specjax
    from specjax import buckets
    from specjax.config import SpeculativeConfig

    inside = {"s": 0.0}
    real_get = buckets.CompiledBuckets.get

    def timed_get(self, bucket):
        exe = real_get(self, bucket)

        def call(*args):
            start = time.perf_counter()
            out = jax.block_until_ready(exe(*args))
            inside["s"] += time.perf_counter() - start
            return out

        return call

    buckets.CompiledBuckets.get = timed_get
    out = {}
    fixed_k = {"method": "draft_model", "model": "builtin:draft", "num_speculative_tokens": 4}
    if "adaptive" in {f.name for f in dataclasses.fields(SpeculativeConfig)}:
        fixed_k["adaptive"] = False  # the same steps as the --before checkout, which has no controller
    configs = {"plain": None, "draft_model K=4": fixed_k}
    for name, spec in configs.items():
        llm = specjax.LLM("builtin:target", speculative_config=spec, max_model_len=160, max_num_seqs=8, seed=0)
        engine = llm.engine
        real_step = engine.step
        prompts = _prompts(llm.tokenizer, 8, 64)
        for batch in (1, 8):
            walls, insides = [], []

            def step():
                before = inside["s"]
                start = time.perf_counter()
                done = real_step()
                walls.append(time.perf_counter() - start)
                insides.append(inside["s"] - before)
                return done

            engine.step = step
            params = specjax.SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
            llm.generate([{"prompt_token_ids": p} for p in prompts[:batch]], params, use_tqdm=False)  # untimed
            walls.clear()
            insides.clear()
            for _ in range(reps):
                llm.generate([{"prompt_token_ids": p} for p in prompts[:batch]], params, use_tqdm=False)
            host = np.asarray(walls) - np.asarray(insides)
            out[f"{name} batch {batch}"] = {
                "steps": len(walls), "median_step_ms": 1e3 * statistics.median(walls),
                "median_host_ms": 1e3 * float(np.median(host)), "mean_host_ms": 1e3 * float(host.mean()),
            }
            engine.step = real_step
    buckets.CompiledBuckets.get = real_get
    return out


def speedups(reps: int, new_tokens: int) -> dict:
    import tempfile as tf

    import specjax

    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import make_tiny_checkpoint

    rows = {}
    random_dir = make_tiny_checkpoint(Path(tf.mkdtemp()) / "llama30m", vocab_size=32000, hidden_size=512,
                                      intermediate_size=1376, num_layers=8, num_heads=8, seed=0)
    systems = {
        "shipped draft_model": ("builtin:target", {"method": "draft_model", "model": "builtin:draft"}),
        "shipped eagle3": ("builtin:target", {"method": "eagle3", "model": "builtin:eagle3"}),
        "random 30M synthetic 0.9": (str(random_dir), {"rejection_sample_method": "synthetic",
                                                        "synthetic_acceptance_rates": [0.9, 0.81, 0.729, 0.6561]}),
    }
    for name, (model, spec) in systems.items():
        kw = dict(max_model_len=64 + new_tokens + 8, max_num_seqs=1, seed=0)
        llms = {"plain": specjax.LLM(model, **kw),
                "K=4": specjax.LLM(model, speculative_config={**spec, "num_speculative_tokens": 4,
                                                              "adaptive": False}, **kw),
                "adaptive": specjax.LLM(model, speculative_config={**spec, "num_speculative_tokens": 4}, **kw)}
        tok = llms["plain"].tokenizer
        prompts = _prompts(tok, 4, 64) if tok is not None else [[5 + (i * 7 + j) % 500 for j in range(64)]
                                                                   for i in range(4)]
        params = specjax.SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        times = {k: [] for k in llms}
        ids = {}
        for k, llm in llms.items():  # untimed first run
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for _ in range(reps):
            for k, llm in llms.items():
                start = time.perf_counter()
                outs = []
                for p in prompts:  # batch 1: one request at a time
                    outs += llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
                times[k].append(time.perf_counter() - start)
                ids[k] = [o.outputs[0].token_ids for o in outs]
        same = all(ids[k] == ids["plain"] for k in ids) if "synthetic" not in name else None
        med = {k: statistics.median(v) for k, v in times.items()}
        rows[name] = {
            "plain_tok_s": len(prompts) * new_tokens / med["plain"],
            "speedup_K4": med["plain"] / med["K=4"], "speedup_adaptive": med["plain"] / med["adaptive"],
            "mean_acceptance_length_K4": llms["K=4"].get_metrics().get("mean_acceptance_length"),
            "identical_greedy_tokens": same, "times": times,
        }
        logger.info("%s: K=4 %.2fx, adaptive %.2fx", name, rows[name]["speedup_K4"], rows[name]["speedup_adaptive"])
    return rows


def startup(reps: int) -> dict:
    """Cold (empty cache) and warm runs of the README's default command, in subprocesses."""
    cache = Path(tempfile.mkdtemp(prefix="specjax-cache-"))
    from specjax import builtin

    cmd = [shutil.which("specjax") or "specjax", "generate", "--model", builtin.STDLIB_TARGET, "--speculative-config",
           json.dumps(builtin.STDLIB_SPEC), "--compare-plain", "--prompt", "def parse_args(argv):", "--max-tokens", "64"]
    out = {"command": " ".join(cmd), "runs": []}
    for kind in ["cold"] + ["warm"] * reps:
        if kind == "cold":
            shutil.rmtree(cache, ignore_errors=True)
        env = dict(os.environ, SPECJAX_COMPILATION_CACHE=str(cache), PYTHONUNBUFFERED="1")
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
        first = None
        for _line in proc.stdout:
            if first is None:
                first = time.perf_counter() - start
        proc.wait()
        total = time.perf_counter() - start
        out["runs"].append({"kind": kind, "first_output_s": first, "total_s": total, "rc": proc.returncode,
                            "stderr_tail": proc.stderr.read()[-400:]})
        logger.info("%s start: first output %.1fs, total %.1fs", kind, first or -1, total)
    shutil.rmtree(cache, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/step.json"))
    ap.add_argument("--before", type=Path, help="a checkout of the commit to compare host overhead with")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--sections", nargs="+", default=["overhead", "speedup", "startup"])
    ap.add_argument("--json-only", action="store_true", help="print section a's JSON for this checkout and exit")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.json_only:
        print(json.dumps(host_overhead(args.reps, args.new_tokens)))
        return
    result = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(["python"] + sys.argv)}
    if "overhead" in args.sections:
        result["host_overhead"] = {"after": host_overhead(args.reps, args.new_tokens)}
        if args.before is not None:
            proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_step.py"), "--json-only",
                                   "--reps", str(args.reps), "--new-tokens", str(args.new_tokens)],
                                  cwd=args.before, env=dict(os.environ, PYTHONPATH=str(args.before),
                                                            SPECJAX_COMPILATION_CACHE="0"),
                                  capture_output=True, text=True, check=True)
            result["host_overhead"]["before"] = json.loads(proc.stdout.strip().splitlines()[-1])
            result["host_overhead"]["before_commit"] = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=args.before, capture_output=True, text=True).stdout.strip()
    if "speedup" in args.sections:
        result["speedup"] = speedups(args.reps, args.new_tokens)
    if "startup" in args.sections:
        result["startup"] = startup(args.reps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "speedup"}, indent=1))
    for name, row in result.get("speedup", {}).items():
        print(f"{name}: K=4 {row['speedup_K4']:.2f}x, adaptive {row['speedup_adaptive']:.2f}x, "
              f"identical {row['identical_greedy_tokens']}")


if __name__ == "__main__":
    main()
