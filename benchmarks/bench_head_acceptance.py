"""Held-out acceptance of a draft head through the engine: greedy, fixed K, vs the same head untrained.

Prompts are the held-out side of :func:`specjax.train.selfgen.build_prompts` (topics no training prompt
used), rendered with the target's chat template as ``train-head --corpus generated`` renders them, or
(``--prompts stdlib``) the first 200 characters of the stdlib split's held-out files. Three
runs on the same engine settings: plain decoding, the head, and the head with its weights re-drawn at
random (same config, same d2t): a floor that shows what training bought. Greedy outputs must equal
plain decoding's (checked). Wall times are recorded, not compared (this is an acceptance benchmark).

    python benchmarks/bench_head_acceptance.py --target /path/to/smollm2 --head specjax/builtin/smollm2_eagle3 \\
        --num-prompts 12 --max-tokens 64 --k 4 --out benchmarks/results/head_acceptance.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import jax
import numpy as np

import specjax
from models.cpu_layout import is_cpu_layout
from models.heads import head_to_cpu_layout, init_head_params, load_head
from specjax.builtin import resolve_model
from specjax.train import selfgen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--head", required=True)
    p.add_argument("--prompts", default="generated", choices=["generated", "stdlib"],
                   help="held-out prompts: selfgen's (prose/chat/code) or the stdlib split's files")
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--out", default=None, help="append the result to this JSON file (a list)")
    args = p.parse_args()

    target = resolve_model(args.target)
    head = resolve_model(args.head)
    if args.prompts == "stdlib":  # the built-in target's held-out files, as tests/test_heads.py takes them
        from specjax.train import corpus

        _, files = corpus.split_files()
        files = [f for f in files if not f.startswith("encodings/")] or files
        held = [selfgen.Prompt("code", corpus.read_text(f)[:200]) for f in files]
    else:
        _, held = selfgen.build_prompts()
    ids = [x for x in selfgen.encode_prompts(target, held, args.max_prompt_tokens) if x][: args.num_prompts]
    prompts = [{"prompt_token_ids": x} for x in ids]
    params = specjax.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=False)
    kw = dict(max_model_len=args.max_prompt_tokens + args.max_tokens + 16, max_num_seqs=args.max_num_seqs,
              warmup=False)  # compile only the buckets these prompts use
    hc, _ = load_head(head)
    spec = {"method": hc.method, "model": head, "num_speculative_tokens": args.k, "adaptive": False}

    def timed(llm):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        return [o.outputs[0].token_ids for o in outs], time.perf_counter() - t0

    plain_ids, plain_s = timed(specjax.LLM(target, **kw))
    llm = specjax.LLM(target, speculative_config=spec, **kw)
    head_ids, head_s = timed(llm)
    trained = llm.get_metrics()
    assert head_ids == plain_ids, "speculative greedy output differs from plain decoding"
    # The same engine and executables with the head's float weights re-drawn at random (d2t kept).
    runner = llm.engine.runner
    target_params, head_params = runner.params
    fresh = init_head_params(hc, jax.random.key(0))
    fresh = {k: (head_params[k] if k == "d2t" else v) for k, v in fresh.items()}
    if is_cpu_layout(target_params):  # the engine runs the head in its target's layout
        fresh = head_to_cpu_layout(fresh, hc)
    runner.params = (target_params, jax.tree.map(
        lambda new, old: jax.device_put(np.asarray(new).astype(old.dtype), old.sharding), fresh, head_params))
    before = llm.get_metrics()
    again, _ = timed(llm)
    assert again == plain_ids
    after = llm.get_metrics()
    drafts = after["num_drafts"] - before["num_drafts"]
    untrained = 1 + (after["num_accepted_tokens"] - before["num_accepted_tokens"]) / max(drafts, 1)
    n_gen = sum(len(x) for x in plain_ids)
    res = {
        "date": datetime.date.today().isoformat(), "target": args.target, "head": args.head, "k": args.k,
        "num_prompts": len(prompts), "generated_tokens": n_gen, "greedy_equal_plain": True,
        "mean_acceptance_length": round(trained["mean_acceptance_length"], 3),
        "acceptance_rate": round(trained["acceptance_rate"], 4),
        "accepted_per_position": trained["accepted_per_position"], "num_drafts": trained["num_drafts"],
        "untrained_mean_acceptance_length": round(untrained, 3),
        "plain_wall_s": round(plain_s, 1), "head_wall_s": round(head_s, 1),
        "command": "python benchmarks/bench_head_acceptance.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "out"),
    }
    print(json.dumps(res, indent=2))
    if args.out:
        out = Path(args.out)
        prev = json.loads(out.read_text()) if out.is_file() else []
        out.write_text(json.dumps(prev + [res], indent=2) + "\n")


if __name__ == "__main__":
    main()
