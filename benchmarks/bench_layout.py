"""Which weight layout decodes faster in the engine on CPU: the checkpoint layout or ``models.cpu_layout``'s.

Sets ``SPECJAX_WEIGHT_LAYOUT`` to ``cpu`` and to ``checkpoint`` and builds the same system twice in one
process; the two (and plain decoding where speculation is measured) generate the same prompts in interleaved
rounds after an untimed run; medians of ``--reps`` rounds. Models: the shipped target (7.5M, 29 MiB; plain
and draft_model K = 4 with the shipped draft, greedy), a random 30M Llama (116 MiB; plain) and SmolLM2-135M
(513 MiB; plain). ``SPECJAX_WEIGHT_LAYOUT=auto`` (``specjax.backends.use_cpu_weight_layout``) rests on these
rows. A row times SmolLM2 with ``dtype="bfloat16"`` weights against float32, both in the CPU layout (the
panel kernel reads bfloat16 weights and accumulates in float32), and counts how many greedy tokens agree. The
last rows time the shipped models (bfloat16 checkpoints) in the CPU layout with their panels in bfloat16 (what
the layout does for weights that are all bfloat16 values: same products, half the bytes) against the same
panels in float32 (``models.cpu_layout.NARROW_EXACT_BFLOAT16`` off): plain, draft_model K = 4 and EAGLE-3 K = 4.
``--only-blocks`` times SmolLM2 in the CPU layout with its GGUF file's Q4_1 / Q8_0 blocks as quantized panels (what
the engine runs) against float32 panels of the same dequantized weights (``models.cpu_layout.KEEP_GGUF_BLOCKS``
off): plain and with its EAGLE-3 head at K = 4; the tokens must be the same.

    python benchmarks/bench_layout.py --out benchmarks/results/layout.json
    python benchmarks/bench_layout.py --only-blocks --out benchmarks/results/layout_blocks.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax

import specjax
from bench_builtin import machine_info, token_prompts
from models import cpu_layout

REPO = Path(__file__).resolve().parents[1]
logger = logging.getLogger("bench_layout")


def model_path(name: str) -> str:
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import make_tiny_checkpoint, smollm2_gguf

    if name == "random30m":
        return str(make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "m", vocab_size=8192, hidden_size=512,
                                        intermediate_size=1536, num_layers=7, num_heads=8, num_kv_heads=4, seed=0))
    if name == "smollm2":
        return str(smollm2_gguf())
    return name


LAYOUTS = {"cpu": ("cpu", "float32"), "checkpoint": ("checkpoint", "float32")}
"""Variant name -> (SPECJAX_WEIGHT_LAYOUT, LLM dtype[, narrow exact-bfloat16 panels]); the first is timed against
the second."""
DTYPES = {"bfloat16": ("cpu", "bfloat16"), "float32": ("cpu", "float32")}
PANELS = {"bf16 panels": ("cpu", "float32", True), "f32 panels": ("cpu", "float32", False)}
BLOCKS = {"GGUF blocks": ("cpu", "float32", True, True), "f32 panels": ("cpu", "float32", True, False)}
"""(..., narrow exact-bfloat16 panels, keep GGUF blocks)"""


def run(name: str, spec: dict | None, new_tokens: int, reps: int, variants: dict = LAYOUTS) -> dict:
    kw = dict(max_model_len=64 + new_tokens + 8, max_num_seqs=1, seed=0, query_buckets=(1, 64), max_prefill_chunk=64)
    path = model_path(name)
    llms = {}
    for key, (layout, dtype, *flags) in variants.items():
        os.environ["SPECJAX_WEIGHT_LAYOUT"] = layout
        cpu_layout.NARROW_EXACT_BFLOAT16, cpu_layout.KEEP_GGUF_BLOCKS = (*flags, True, True)[:2]
        llms[key] = specjax.LLM(path, speculative_config=spec, dtype=dtype, **kw)
        assert llms[key].runner.cpu_weight_layout == (layout == "cpu")
    os.environ.pop("SPECJAX_WEIGHT_LAYOUT")
    cpu_layout.NARROW_EXACT_BFLOAT16 = cpu_layout.KEEP_GGUF_BLOCKS = True
    first, second = variants
    tok = llms[first].tokenizer
    prompts = token_prompts(tok, 2, 64) if tok is not None else [[5 + (i * 7 + j) % 500 for j in range(64)]
                                                                  for i in range(2)]
    params = specjax.SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    times = {k: [] for k in llms}
    ids = {}
    for llm in llms.values():  # untimed
        llm.generate([{"prompt_token_ids": p} for p in prompts[:1]], params, use_tqdm=False)
    for _ in range(reps):
        for k, llm in llms.items():
            start = time.perf_counter()
            ids[k] = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids
                      for p in prompts]
            times[k].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    weights = llms[second].runner.params[0]
    pairs = [(a, b) for x, y in zip(ids[first], ids[second]) for a, b in zip(x, y)]
    row = {"model": name, "speculation": spec, "weight_mib": sum(x.nbytes for x in jax.tree.leaves(weights)) / 2**20,
           "variants": {k: {"layout": v[0], "dtype": v[1], "narrow_exact_bfloat16": v[2] if len(v) > 2 else True,
                            "keep_gguf_blocks": v[3] if len(v) > 3 else True} for k, v in variants.items()},
           "tok_s": {k: len(prompts) * new_tokens / v for k, v in med.items()},
           "time_ratio": med[first] / med[second], "same_tokens": ids[first] == ids[second],
           "token_agreement": sum(a == b for a, b in pairs) / len(pairs), "times": times}
    logger.info("%s %s: %s / %s time %.3f", name, spec and spec["method"], first, second, row["time_ratio"])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/layout.json"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--only-panels", action="store_true", help="only the bfloat16 / float32 panel rows")
    ap.add_argument("--only-blocks", action="store_true", help="only SmolLM2's GGUF-block / float32 panel rows")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    draft = {"method": "draft_model", "model": "builtin:draft", "num_speculative_tokens": 4, "adaptive": False}
    eagle3 = {"method": "eagle3", "model": "builtin:eagle3", "num_speculative_tokens": 4, "adaptive": False}
    systems = [("builtin:target", None, LAYOUTS), ("builtin:target", draft, LAYOUTS), ("random30m", None, LAYOUTS),
               ("smollm2", None, LAYOUTS), ("smollm2", None, DTYPES), ("builtin:target", None, PANELS),
               ("builtin:target", draft, PANELS), ("builtin:target", eagle3, PANELS)]
    smol_eagle3 = {"method": "eagle3", "model": "builtin:smollm2_eagle3", "num_speculative_tokens": 4,
                   "adaptive": False}
    blocks = [("smollm2", None, BLOCKS), ("smollm2", smol_eagle3, BLOCKS)]
    if args.only_panels:
        systems = systems[-3:]
    elif args.only_blocks:
        systems = blocks
    else:
        systems += blocks
    rows = [run(name, spec, args.new_tokens, args.reps, variants) for name, spec, variants in systems]
    out = {"date": time.strftime("%Y-%m-%d"), "machine": machine_info(), "command": " ".join(["python"] + sys.argv),
           "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    for r in rows:
        first, second = r["variants"]
        print(f"| {r['model']} | {r['speculation'] and r['speculation']['method'] or 'plain'} | {first} / {second} | "
              f"{r['tok_s'][first]:.1f} / {r['tok_s'][second]:.1f} | {r['time_ratio']:.3f} | "
              f"{r['same_tokens']} ({r['token_agreement']:.3f}) |")


if __name__ == "__main__":
    main()
