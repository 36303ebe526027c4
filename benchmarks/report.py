"""Render the recorded benchmark JSON under benchmarks/results/ as markdown tables.

    python benchmarks/report.py            # prints the tables pasted into benchmarks/README.md
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def _load(name):
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def plain_vs_hf() -> str:
    d = _load("plain_vs_hf.json")
    if d is None:
        return ""
    c = d["config"]
    lines = [
        f"Random Llama, {d['params'] / 1e6:.1f}M params ({c['layers']} layers, hidden {c['hidden']}, vocab "
        f"{c['vocab']}), prompt {c['prompt_len']} tokens, {c['new_tokens']} new tokens, greedy, median of "
        f"{c['reps']}; {d['date']}, {d['machine']}. Warmup compiled {d['num_compiled_buckets']} buckets in "
        f"{d['compile_seconds']:.1f} s; compiles during timing: {d['compiles_during_timing']}.",
        "",
        "| batch | specjax tok/s | transformers tok/s | specjax / HF | greedy rows identical |",
        "|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        lines.append(f"| {r['batch']} | {r['specjax_tok_s']:.1f} | {r['hf_tok_s']:.1f} | {r['speedup']:.2f}x | "
                     f"{r['greedy_rows_identical_to_hf']} |")
    return "\n".join(lines)


def sampler_share(name: str = "sampler_share.json") -> str:
    d = _load(name)
    if d is None:
        return ""
    modes = list(d["modes"])
    lines = [
        f"The engine's fused step (random Llama, hidden 384, 6 layers; host drafts), {d['date']}, {d['machine']}: "
        "step ms, and in brackets the increase over the greedy step as a share of the mode's step.",
        "",
        "| V | B | K | " + " | ".join(modes) + " |",
        "|---|---|---|" + "---|" * len(modes),
    ]
    by = {}
    for r in d["rows"]:
        by.setdefault((r["vocab"], r["batch"], r["k"]), {})[r["mode"]] = r
    for (v, b, k), m in sorted(by.items()):
        cells = [f"{m[name]['step_ms']:.1f}" + ("" if name == "greedy" else f" ({100 * m[name]['sampler_share']:.0f}%)")
                 for name in modes]
        lines.append(f"| {v} | {b} | {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def spec() -> str:
    d = _load("spec.json")
    if d is None:
        return ""
    c = d["config"]
    lines = [
        f"Random ~33M Llama target (8 layers, hidden 512, vocab 8192), random 2-layer hidden-128 draft; prompt "
        f"{c['prompt_len']}, {c['new_tokens']} new tokens, greedy, median of {c['reps']}; {d['date']}, {d['machine']}.",
        "",
        "| method | K | batch | tok/s | speedup vs plain | mean acceptance length | ideal speedup | efficiency |"
        " identical to plain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        mal = f"{r['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in r else "1"
        ideal = f"{r['ideal_speedup']:.2f}x" if "ideal_speedup" in r else "-"
        eff = f"{r['efficiency']:.2f}" if "efficiency" in r else "-"
        same = {True: "yes", False: "NO"}.get(r.get("identical_to_plain"), "-")
        lines.append(f"| {r['method']} | {r['k']} | {r['batch']} | {r['tok_s']:.1f} | {r['speedup']:.2f}x | {mal} | "
                     f"{ideal} | {eff} | {same} |")
    return "\n".join(lines)


if __name__ == "__main__":
    for title, fn in (("Plain decoding vs transformers", plain_vs_hf), ("Sampler share of a verify step", sampler_share),
                      ("Speculative decoding", spec)):
        body = fn()
        if body:
            print(f"### {title}\n\n{body}\n")
