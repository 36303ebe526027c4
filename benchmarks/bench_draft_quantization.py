"""A draft model's or head's weights in Q8_0 blocks (``speculative_config.quantization="q8_0"``) vs as shipped
(bfloat16 values), both against plain decoding of the same target, side by side.

For each method (at a fixed K, ``"adaptive": false``: the step's own cost, not the controller's choices) and
each temperature, three LLMs generate the same held-out prompts at batch 1, one ``generate`` call per prompt:
plain decoding, speculation with the draft as shipped (``float``) and with it quantized (``q8_0``). One untimed
round each, then ``--reps`` rounds, every other one in reverse order. Reported: speed-up over plain and
q8_0 / float (medians over rounds of each round's ratio), each system's acceptance; greedy outputs are
checked equal to plain decoding's.

    python benchmarks/bench_draft_quantization.py --out benchmarks/results/draft_quantization.json
    python benchmarks/bench_draft_quantization.py --model builtin:smollm2 --prompts selfgen \\
        --methods smollm2_eagle3=2 --prompt-len 96 --new-tokens 48 --num-prompts 2 --reps 5 \\
        --out benchmarks/results/draft_quantization_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import specjax
from bench_adaptive import METHODS, selfgen_prompts
from bench_builtin import token_prompts

logger = logging.getLogger("bench_draft_quantization")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/draft_quantization.json"))
    ap.add_argument("--model", default="builtin:target")
    ap.add_argument("--methods", nargs="+", default=["draft_model=4", "eagle3=2"], metavar="METHOD=K",
                    help="bench_adaptive's METHODS, each at a fixed K")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    ap.add_argument("--prompts", choices=["stdlib", "selfgen"], default="stdlib")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    kw = dict(max_model_len=args.prompt_len + args.new_tokens + 8, max_num_seqs=1, batch_buckets=[1],
              query_buckets=(1, args.prompt_len), max_prefill_chunk=args.prompt_len, seed=0)
    results = []
    for item in args.methods:
        method, _, k = item.partition("=")
        spec = {**METHODS[method], "num_speculative_tokens": int(k), "adaptive": False}
        llms = {"plain": specjax.LLM(args.model, **kw),  # "float": the draft's weights as stored (quantization None)
                "float": specjax.LLM(args.model, speculative_config={**spec, "quantization": None}, **kw),
                "q8_0": specjax.LLM(args.model, speculative_config={**spec, "quantization": "q8_0"}, **kw)}
        prompts = (token_prompts(llms["plain"].tokenizer, args.num_prompts, args.prompt_len) if args.prompts == "stdlib"
                   else selfgen_prompts(args.model, args.num_prompts, args.prompt_len))
        for temperature in args.temperatures:
            params = [specjax.SamplingParams(temperature=temperature, max_tokens=args.new_tokens, ignore_eos=True,
                                             seed=i) for i in range(len(prompts))]

            def run(name: str) -> tuple[float, list]:
                start, ids = time.perf_counter(), []
                for p, sp in zip(prompts, params):
                    outs = llms[name].generate([{"prompt_token_ids": p}], [sp], use_tqdm=False)
                    ids.append(outs[0].outputs[0].token_ids)
                return time.perf_counter() - start, ids

            names = list(llms)
            for name in names:  # untimed
                run(name)
            before = {name: llms[name].get_metrics() for name in names[1:]}
            times = {name: [] for name in names}
            for rep in range(args.reps):
                outputs = {}
                for name in names if rep % 2 == 0 else names[::-1]:
                    elapsed, outputs[name] = run(name)
                    times[name].append(elapsed)
                if temperature == 0.0 and any(outputs[n] != outputs["plain"] for n in names):
                    raise SystemExit(f"{method} greedy output differs from plain decoding's")
            ratio = lambda a, b: statistics.median(x / y for x, y in zip(times[a], times[b]))  # noqa: E731
            row = {"method": method, "k": int(k), "temperature": temperature,
                   "plain_tok_s": round(len(prompts) * args.new_tokens / statistics.median(times["plain"]), 1),
                   "speedup_float": round(ratio("plain", "float"), 3), "speedup_q8_0": round(ratio("plain", "q8_0"), 3),
                   "q8_0_over_float": round(ratio("float", "q8_0"), 3)}
            for name in names[1:]:
                a, b = before[name], llms[name].get_metrics()
                tried = b["num_draft_tokens"] - a["num_draft_tokens"]
                row[f"acceptance_{name}"] = round((b["num_accepted_tokens"] - a["num_accepted_tokens"]) / tried, 3)
            logger.info("%s", row)
            results.append(row)
        del llms
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "results": results,
                                    "command": " ".join(["python"] + sys.argv)}, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
