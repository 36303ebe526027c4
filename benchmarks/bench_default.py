"""The default pair (``LLM()`` / ``specjax generate`` with no model): SmolLM2-135M-Instruct + its EAGLE-3 head.

What a newcomer's first runs cost and print, each in a fresh process (``bench_builtin.generate_run``: wall
time, peak RSS from ``/usr/bin/time -v``, the compile time, acceptance and speed-up the command prints):

a. Start-up: the README's first command (``specjax generate --chat --prompt ...``), once with an empty
   compilation cache (cold: every step executable compiles) and ``--warm-reps`` times with it filled (warm).
b. Outputs: ``--prompts`` chat prompts in one call (batch of them), greedy: the completions, acceptance by
   draft position and the speed-up over plain decoding of the same prompts, as the command prints them.

Speed across loads (batch 1 / 8, greedy / temperature 0.8, adaptive vs fixed K) is ``bench_adaptive.py
--model builtin:smollm2``.

    python benchmarks/bench_default.py --out benchmarks/results/default_pair.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench_builtin import generate_run, machine_info

logger = logging.getLogger("bench_default")

FIRST_PROMPT = "Explain in two sentences why the sky is blue."
PROMPTS = [
    FIRST_PROMPT,
    "Write a Python function that checks whether a string is a palindrome.",
    "Give me three tips for a job interview.",
    "What is the difference between a list and a tuple in Python?",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/default_pair.json"))
    ap.add_argument("--warm-reps", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    cache = Path(tempfile.mkdtemp(prefix="specjax-default-cache-"))
    env = dict(os.environ, SPECJAX_COMPILATION_CACHE=str(cache))
    first = ["--chat", "--prompt", FIRST_PROMPT, "--max-tokens", str(args.max_tokens)]
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_info(), "startup": []}
    try:
        for kind in ["cold"] + ["warm"] * args.warm_reps:
            run = generate_run(first, env)
            run["kind"] = kind
            result["startup"].append(run)
            logger.info("%s: wall %.1fs, peak RSS %.0f MiB, %s", kind, run["wall_s"], run["peak_rss_mib"],
                        run["stderr_tail"].replace("\n", " | "))
        many = ["--chat", "--max-tokens", str(args.max_tokens)]
        for p in PROMPTS[: args.prompts]:
            many += ["--prompt", p]
        result["outputs"] = generate_run(many, env)
        result["outputs"]["prompts"] = PROMPTS[: args.prompts]
        logger.info("outputs: %s", result["outputs"]["stderr_tail"].replace("\n", " | "))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    result["command"] = " ".join(["python"] + sys.argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("startup", "outputs")}, indent=1)[:6000])


if __name__ == "__main__":
    main()
