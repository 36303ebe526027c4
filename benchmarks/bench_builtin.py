"""The shipped model pair (builtin:target + builtin:draft): quality, speed vs plain, head to head with transformers.

Prompts are windows of held-out stdlib code (files the pair never trained on;
``specjax/train/corpus.py``), cut to exactly --prompt-len tokens of the shipped
tokenizer and passed as token ids to both systems; every run generates
--new-tokens tokens with ignore_eos (transformers: ``eos_token_id=None``), so
every system generates the same number of tokens.

Sections (all in one process, one run; JSON under ``--out``):

a. Quality: held-out perplexity of target and draft (``specjax.train.lm.evaluate``,
   the shipped bf16 files in fp32 compute); greedy acceptance rate, mean
   acceptance length and acceptance by draft position for draft_model, ngram and
   suffix at each K in --ks, over --quality-prompts prompts (batch 8); the by-position
   plot is written next to the JSON.
b. Speed vs plain decoding in specjax: batch 1 (the first --speed-prompts prompts
   one generate call at a time) and batch 8 (the same prompts in one call),
   greedy and temperature 0.8 (seeded per prompt). Every LLM is built and
   compiled up front (compile time reported apart); then, per setting, one
   untimed warmup run per system and --reps timed rounds in which every system
   runs once, in turn (interleaved, so load on a shared machine hits all alike).
   Figures are medians over rounds.
c. Head to head with transformers (CPU torch, float32, the same two checkpoints),
   batch 1 greedy, in the same interleaved rounds: ``generate`` plain,
   ``assistant_model=draft`` (transformers' default assistant schedule, and a
   constant K matching specjax's), ``prompt_lookup_num_tokens=K``. Outputs are
   compared token for token with specjax's plain decoding. At batch 8, plain
   batched ``generate`` (all prompts have the same length, so no padding is
   needed) and assisted generation, which transformers does not batch, run per
   prompt sequentially (aggregate tokens/s).
d. The pair's one-command run, ``specjax generate --model builtin:target
   --speculative-config <draft_model K=4> --compare-plain --prompt "def parse_args(argv):"``
   (the README's first command until SmolLM2 became the default), in a subprocess: wall time, peak
   RSS (``/usr/bin/time -v`` when present, else ``getrusage(RUSAGE_CHILDREN)``), the compile time it prints.

    python benchmarks/bench_builtin.py --out benchmarks/results/builtin.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

_USER_ENV = dict(os.environ)  # the default run (section d) gets the environment a user would have
# torch's OpenMP threads spin-wait by default; in a process whose XLA:CPU threads also run, that made
# transformers' 2-thread generate ~60x slower on this machine (measured before writing this line). Passive
# waiting removes the contention; it only helps transformers. Set before anything imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402

import specjax  # noqa: E402
from bench_batch import heldout_prompts  # noqa: E402
from specjax import builtin  # noqa: E402

logger = logging.getLogger("bench_builtin")
REPO = Path(__file__).resolve().parents[1]
DEFAULT_PROMPT = "def parse_args(argv):"


# --------------------------------------------------------------------------- setup


def machine_info() -> dict:
    import jax

    info = {
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "nice": os.nice(0),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "loadavg_start": os.getloadavg(),
    }
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        model = re.search(r"^model name\s*:\s*(.*)$", cpuinfo, re.M)
        info["cpu_model"] = model.group(1) if model else None
        mem = re.search(r"^MemTotal:\s*(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
        info["mem_gib"] = round(int(mem.group(1)) / 2**20, 1) if mem else None
    except OSError:
        pass
    return info


def token_prompts(tokenizer, n: int, prompt_len: int) -> list[list[int]]:
    """``n`` held-out windows of exactly ``prompt_len`` tokens (windows that tokenize shorter are skipped)."""
    chars = prompt_len * 6  # stdlib code averages well under 6 chars per token with this tokenizer
    for factor in (2, 4, 8):
        out = []
        for text in heldout_prompts(n * factor, chars):
            ids = tokenizer.encode(text).ids
            if len(ids) >= prompt_len:
                out.append(ids[:prompt_len])
            if len(out) == n:
                return out
    raise SystemExit(f"found only {len(out)} held-out windows of {prompt_len} tokens")


# --------------------------------------------------------------------------- specjax systems


def build_llms(args) -> dict:
    """name -> (LLM, spec config or None, compile seconds). Plain first."""
    configs = [("plain", None)]
    for method in ("draft_model", "ngram", "suffix"):
        for k in args.ks:
            spec = {"method": method, "num_speculative_tokens": k}
            if method == "draft_model":
                spec["model"] = "builtin:draft"
            elif method == "ngram":
                spec.update(prompt_lookup_min=2, prompt_lookup_max=5)
            configs.append((f"{method} K={k}", spec))
    for k in args.probabilistic_ks:
        # The draft samples its proposals from its own distribution (its probabilities go to the verifier).
        configs.append((f"draft_model K={k} probabilistic", {"method": "draft_model", "num_speculative_tokens": k,
                                                              "model": "builtin:draft",
                                                              "draft_sample_method": "probabilistic"}))
    llms = {}
    for name, spec in configs:
        start = time.perf_counter()
        # A draft model catches up one or two tokens per step; host proposers feed the target 1 or K+1.
        queries = (1, 2, args.prompt_len) if spec and spec["method"] == "draft_model" else (1, args.prompt_len)
        llm = specjax.LLM(
            "builtin:target", speculative_config=spec, max_model_len=args.prompt_len + args.new_tokens + 16,
            max_num_seqs=8, max_prefill_chunk=args.prompt_len, batch_buckets=(1, 8), query_buckets=queries,
            seed=0, warmup=True,
        )
        m = llm.get_metrics()
        llms[name] = {"llm": llm, "spec": spec, "init_s": time.perf_counter() - start,
                      "compile_s": m["compile_seconds"], "num_compiles": m["num_compiles"]}
        logger.info("%s: %d executables compiled in %.1fs", name, m["num_compiles"], m["compile_seconds"])
    return llms


_COUNTERS = ("num_steps", "num_generated_tokens", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
             "num_compiles")


def _snapshot(llm) -> dict:
    m = llm.get_metrics()
    snap = {k: m.get(k, 0) for k in _COUNTERS}
    snap["accepted_per_position"] = np.asarray(m.get("accepted_per_position", []), np.int64)
    return snap


def _add(acc: dict, before: dict, after: dict) -> None:
    for k in _COUNTERS:
        acc[k] = acc.get(k, 0) + after[k] - before[k]
    app = after["accepted_per_position"] - before["accepted_per_position"]
    acc["accepted_per_position"] = acc.get("accepted_per_position", np.zeros_like(app)) + app


def acceptance_summary(acc: dict) -> dict:
    drafts, drafted = acc.get("num_drafts", 0), acc.get("num_draft_tokens", 0)
    app = acc.get("accepted_per_position", np.zeros(0, np.int64))
    return {
        "num_drafts": int(drafts),
        "num_draft_tokens": int(drafted),
        "num_accepted_tokens": int(acc.get("num_accepted_tokens", 0)),
        "acceptance_rate": acc["num_accepted_tokens"] / drafted if drafted else None,
        "mean_acceptance_length": 1 + acc["num_accepted_tokens"] / drafts if drafts else None,
        "accepted_per_position": [int(x) for x in app],
        # Fraction of drafts whose i-th token was accepted (so 0 also when a host proposer drafted fewer).
        "acceptance_by_position": [float(x) / drafts for x in app] if drafts else [],
        "tokens_per_step": acc["num_generated_tokens"] / acc["num_steps"] if acc.get("num_steps") else None,
        "compiles_during_timing": int(acc.get("num_compiles", 0)),
    }


def reset_suffix_cache(llm) -> None:
    """Give the LLM's engine a fresh suffix proposer with the same settings (empty global tree)."""
    from specjax.spec_decode.suffix import SuffixProposer

    c = llm.speculative_config
    llm.engine.proposer.drafter = SuffixProposer(
        num_speculative_tokens=c.num_speculative_tokens, max_tree_depth=c.suffix_decoding_max_tree_depth,
        max_cached_requests=c.suffix_decoding_max_cached_requests,
        max_spec_factor=c.suffix_decoding_max_spec_factor, min_token_prob=c.suffix_decoding_min_token_prob,
    )


def sj_runner(entry: dict, prompts: list[list[int]], batch: int, params_for):
    """A callable timing one pass over ``prompts`` (``batch`` prompts per generate call); returns (s, token ids)."""
    llm = entry["llm"]
    suffix = entry["spec"] is not None and entry["spec"]["method"] == "suffix"

    def run(acc: dict | None):
        if suffix:
            # Suffix decoding keeps finished outputs in a global tree; rounds repeat the same prompts, so without
            # a reset every round after the first would draft from its own earlier answers. Each run starts empty.
            reset_suffix_cache(llm)
        before = _snapshot(llm)
        start = time.perf_counter()
        outs = []
        for i in range(0, len(prompts), batch):
            chunk = prompts[i: i + batch]
            outs += llm.generate([{"prompt_token_ids": p} for p in chunk],
                                 [params_for(i + j) for j in range(len(chunk))], use_tqdm=False)
        elapsed = time.perf_counter() - start
        if acc is not None:
            _add(acc, before, _snapshot(llm))
        return elapsed, [o.outputs[0].token_ids for o in outs]

    return run


# --------------------------------------------------------------------------- transformers systems


def hf_runners(args, prompts: list[list[int]]) -> tuple[dict, dict]:
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    load = {}
    models = {}
    for role, path in (("target", builtin.target_path()), ("draft", builtin.draft_path())):
        start = time.perf_counter()
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        # ignore_eos, as specjax's runs: never stop early, never mask EOS out of the argmax.
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        models[role] = model
        load[role] = time.perf_counter() - start
    target, draft = models["target"], models["draft"]
    n = args.new_tokens
    common = dict(do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)

    def gen(ids: list[list[int]], **kw) -> list[list[int]]:
        x = torch.tensor(ids)
        with torch.no_grad():
            out = target.generate(x, attention_mask=torch.ones_like(x), **common, **kw)
        return [row[len(ids[0]):].tolist() for row in out]

    def sequential(**kw):
        def run(acc):
            start = time.perf_counter()
            outs = [gen([p], **kw)[0] for p in prompts]
            return time.perf_counter() - start, outs
        return run

    def batched(acc):
        start = time.perf_counter()
        outs = gen(prompts)
        return time.perf_counter() - start, outs

    k = args.hf_k
    b1 = {
        "transformers plain": sequential(),
        "transformers assisted (default schedule)": sequential(assistant_model=draft),
        f"transformers assisted K={k} constant": sequential(assistant_model=draft, num_assistant_tokens=k,
                                                            num_assistant_tokens_schedule="constant",
                                                            assistant_confidence_threshold=0.0),
        f"transformers prompt lookup K={k}": sequential(prompt_lookup_num_tokens=k),
    }
    b8 = {"transformers plain batched": batched}
    info = {"torch": torch.__version__, "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(), "load_s": load}
    return {"b1": b1, "b8": b8}, info


# --------------------------------------------------------------------------- the runs


def interleaved(systems: dict, reps: int, tokens: int) -> dict:
    """One untimed warmup run each, then ``reps`` rounds in which every system runs once."""
    rows = {name: {"times": [], "acc": {}} for name in systems}
    for name, run in systems.items():
        _, rows[name]["token_ids"] = run(None)
    for r in range(reps):
        for name, run in systems.items():
            elapsed, ids = run(rows[name]["acc"])
            rows[name]["times"].append(elapsed)
            rows[name]["token_ids_last"] = ids
        logger.info("round %d/%d done", r + 1, reps)
    for name, row in rows.items():
        row["median_s"] = statistics.median(row["times"])
        row["tok_s"] = tokens / row["median_s"]
    return rows


def default_run(args) -> dict:
    """The stdlib pair's one-command run (the README's first command before SmolLM2 became the default) in a
    fresh process."""
    spec = json.dumps(builtin.STDLIB_SPEC)
    return generate_run(["--model", builtin.STDLIB_TARGET, "--speculative-config", spec, "--compare-plain",
                         "--prompt", DEFAULT_PROMPT, "--max-tokens", str(args.default_max_tokens)])


def generate_run(cli_args: list[str], env: dict | None = None) -> dict:
    """``specjax generate *cli_args`` in a fresh process: wall, peak RSS, and what it prints (compile time,
    acceptance, the speed-up over plain decoding when it compares)."""
    cmd = [sys.executable, "-m", "specjax.cli", "generate", *cli_args]
    time_bin = shutil.which("time") or ("/usr/bin/time" if os.path.exists("/usr/bin/time") else None)
    full = [time_bin, "-v", *cmd] if time_bin else cmd
    start = time.perf_counter()
    proc = subprocess.run(full, capture_output=True, text=True, timeout=900, cwd=REPO, env=env or _USER_ENV)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"specjax generate failed ({proc.returncode}): {proc.stderr[-3000:]}")
    err = proc.stderr
    out = {"command": shlex.join(["specjax", *cmd[3:]]), "wall_s": wall, "stdout": proc.stdout}
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", err)
    if rss:
        out["peak_rss_mib"] = int(rss.group(1)) / 1024
        out["rss_source"] = "/usr/bin/time -v"
    else:
        out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        out["rss_source"] = "getrusage(RUSAGE_CHILDREN), the largest child so far"
    m = re.search(r"(\d+) tokens in ([\d.]+)s \(([\d.]+) tokens/s\); compiles: (\d+) \(([\d.]+)s\)", err)
    if m:
        out.update(tokens=int(m.group(1)), generate_s=float(m.group(2)), tok_s=float(m.group(3)),
                   num_compiles=int(m.group(4)), compile_s=float(m.group(5)))
    m = re.search(r"acceptance rate ([\d.]+), mean acceptance length ([\d.]+), accepted per position (\[[^\]]*\])", err)
    if m:
        out.update(acceptance_rate=float(m.group(1)), mean_acceptance_length=float(m.group(2)),
                   accepted_per_position=json.loads(m.group(3)))
    m = re.search(r"took ([\d.]+)s: speculative speedup ([\d.]+)x", err)
    if m:
        out.update(plain_generate_s=float(m.group(1)), printed_speedup=float(m.group(2)))
    out["stderr_tail"] = "\n".join(line for line in err.splitlines() if line.startswith("[specjax]"))
    return out


def plot_acceptance(quality: dict, ks: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ks), figsize=(4.2 * len(ks), 3.4), sharey=True, squeeze=False)
    for ax, k in zip(axes[0], ks):
        for method, marker in (("draft_model", "o"), ("ngram", "s"), ("suffix", "^")):
            row = quality.get(f"{method} K={k}")
            if not row or not row["acceptance_by_position"]:
                continue
            ax.plot(range(1, k + 1), row["acceptance_by_position"], marker=marker,
                    label=f"{method} (MAL {row['mean_acceptance_length']:.2f})")
        ax.set_title(f"K = {k}")
        ax.set_xlabel("draft position")
        ax.set_xticks(range(1, k + 1))
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("fraction of drafts accepted at position")
    fig.suptitle("Shipped pair, held-out stdlib prompts, greedy: acceptance by draft position", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--quality-prompts", type=int, default=16)
    ap.add_argument("--speed-prompts", type=int, default=8, help="batch 8 runs these in one call")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--probabilistic-ks", type=int, nargs="*", default=[4],
                    help="extra draft_model rows with draft_sample_method=probabilistic")
    ap.add_argument("--hf-k", type=int, default=4, help="K of the transformers and specjax head-to-head rows")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--default-max-tokens", type=int, default=64)
    ap.add_argument("--skip", nargs="*", default=[], choices=["ppl", "default", "hf", "sampled"])
    ap.add_argument("--note", default="", help="free text stored in the JSON (e.g. what shared the CPU)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    t_start = time.perf_counter()
    results = {"date": time.strftime("%Y-%m-%d"), "machine": machine_info(), "note": args.note,
               "model": "shipped pair: builtin:target (7.5M) + builtin:draft (1M)",
               "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}

    # d. first, while this process has no other children (getrusage fallback is a max over children).
    if "default" not in args.skip:
        logger.info("d. default run")
        results["default_run"] = default_run(args)
        logger.info("default run: %s", {k: v for k, v in results["default_run"].items()
                                        if k not in ("stdout", "stderr_tail")})

    if "ppl" not in args.skip:
        logger.info("a. held-out perplexity")
        from models.loading import load_hf_model
        from specjax.train.lm import evaluate, load_streams

        start = time.perf_counter()
        _, heldout, _ = load_streams(builtin.target_path())
        res = evaluate(heldout, load_hf_model(builtin.target_path(), "float32"),
                       load_hf_model(builtin.draft_path(), "float32"))
        res["wall_s"] = time.perf_counter() - start
        results["perplexity"] = res
        logger.info("perplexity: %s", res)

    llms = build_llms(args)
    results["llms"] = {name: {k: e[k] for k in ("spec", "init_s", "compile_s", "num_compiles")}
                       for name, e in llms.items()}
    tokenizer = llms["plain"]["llm"].tokenizer
    prompts = token_prompts(tokenizer, max(args.quality_prompts, args.speed_prompts), args.prompt_len)
    results["prompts_preview"] = [tokenizer.decode(p)[:80] for p in prompts[:4]]
    n = args.new_tokens

    def greedy(_i):
        return specjax.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def sampled(i):
        return specjax.SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True, seed=1000 + i)

    # a. acceptance on the quality prompts, greedy, batch 8.
    logger.info("a. acceptance")
    qp = prompts[: args.quality_prompts]
    quality, plain_ids = {}, None
    for name, entry in llms.items():
        acc = {}
        _, ids = sj_runner(entry, qp, 8, greedy)(acc)
        if name == "plain":
            plain_ids = ids
            continue
        quality[name] = acceptance_summary(acc) | {"identical_to_plain": ids == plain_ids}
        logger.info("%s: %s", name, {k: v for k, v in quality[name].items() if k != "accepted_per_position"})
    results["quality"] = quality
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        plot_path = args.out.with_name(args.out.stem + "_acceptance_by_position.png")
        plot_acceptance(quality, args.ks, plot_path)
        results["plot"] = plot_path.name

    # b + c. speed, interleaved rounds.
    sp = prompts[: args.speed_prompts]
    hf, hf_info = ({"b1": {}, "b8": {}}, None) if "hf" in args.skip else hf_runners(args, sp)
    results["transformers"] = hf_info
    settings = [("greedy", 0.0, greedy)]
    if "sampled" not in args.skip:
        settings.append((f"temperature {args.temperature}", args.temperature, sampled))
    speed = []
    for label, temp, params_for in settings:
        for batch in (1, 8):
            systems = {name: sj_runner(e, sp, batch, params_for) for name, e in llms.items()}
            if temp == 0.0:
                systems.update(hf["b1"] if batch == 1 else hf["b8"])
            logger.info("b. %s batch %d: %d systems x %d rounds", label, batch, len(systems), args.reps)
            rows = interleaved(systems, args.reps, len(sp) * n)
            base = rows["plain"]
            hf_plain = rows.get("transformers plain") or rows.get("transformers plain batched")
            for name, row in rows.items():
                entry = {"setting": label, "temperature": temp, "batch": batch, "system": name,
                         "tok_s": row["tok_s"], "median_s": row["median_s"], "times": row["times"],
                         "speedup_vs_plain": row["tok_s"] / base["tok_s"]}
                if hf_plain is not None:
                    entry["ratio_vs_transformers_plain"] = row["tok_s"] / hf_plain["tok_s"]
                if name in llms:
                    entry.update(acceptance_summary(row["acc"]))
                if temp == 0.0:
                    # Greedy is deterministic: every system must give plain specjax decoding's tokens.
                    same = [a == b for a, b in zip(row["token_ids"], base["token_ids"])]
                    entry["rows_identical_to_specjax_plain"] = f"{sum(same)}/{len(same)}"
                    entry["stable_across_reps"] = row["token_ids_last"] == row["token_ids"]
                speed.append(entry)
                logger.info("%s", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in entry.items()
                                   if k not in ("times", "accepted_per_position", "acceptance_by_position")})
            results["speed"] = speed
    # Transformers' assisted generation does not batch: at batch 8 its aggregate tokens/s is that of the same
    # prompts run one at a time, i.e. the batch-1 rows' measurement (not re-run).
    b1 = {r["system"]: r for r in speed if r["setting"] == "greedy" and r["batch"] == 1}
    b8_plain = next((r for r in speed if r["setting"] == "greedy" and r["batch"] == 8 and r["system"] == "plain"), None)
    b8_hf = next((r for r in speed if r["system"] == "transformers plain batched"), None)
    for name, row in b1.items():
        if name.startswith("transformers") and name != "transformers plain" and b8_plain is not None:
            extra = {**row, "batch": 8, "system": name + " (one prompt at a time)", "from_batch1_run": True,
                     "speedup_vs_plain": row["tok_s"] / b8_plain["tok_s"]}
            if b8_hf is not None:
                extra["ratio_vs_transformers_plain"] = row["tok_s"] / b8_hf["tok_s"]
            speed.append(extra)
    assisted = b1.get("transformers assisted (default schedule)")
    if assisted is not None:
        for r in speed:
            if r["setting"] == "greedy":
                r["ratio_vs_transformers_assisted"] = r["tok_s"] / assisted["tok_s"]
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["total_wall_s"] = time.perf_counter() - t_start
    print(tables(results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        logger.info("wrote %s", args.out)


# --------------------------------------------------------------------------- tables


def _f(v, fmt="{:.2f}"):
    return "-" if v is None else fmt.format(v)


def tables(d: dict) -> str:
    """The markdown tables for benchmarks/README.md."""
    c, m = d["config"], d["machine"]
    lines = [f"{d['model']}; prompts of {c['prompt_len']} held-out tokens, {c['new_tokens']} new tokens, "
             f"ignore_eos; {d['date']}, {m['machine']} CPU ({m.get('cpu_model')}), {m['cpu_count']} cores, "
             f"jax {m['jax']}" + (f"; {d['note']}" if d.get("note") else "") + ".", ""]
    if "perplexity" in d:
        p = d["perplexity"]
        lines += ["| | held-out perplexity | top-1 accuracy |", "|---|---|---|",
                  f"| target | {p['target_ppl']:.2f} | {100 * p['target_top1_acc']:.1f}% |",
                  f"| draft | {p['draft_ppl']:.2f} | {100 * p['draft_top1_acc']:.1f}% |", "",
                  f"({p['heldout_tokens_scored']} held-out tokens; draft/target top-1 agreement "
                  f"{100 * p['draft_target_top1_agreement']:.1f}%.)", ""]
    if "quality" in d:
        lines += [f"Greedy acceptance, {c['quality_prompts']} prompts:", "",
                  "| method | K | acceptance rate | mean acceptance length | accepted fraction by position | "
                  "identical to plain |", "|---|---|---|---|---|---|"]
        for name, q in d["quality"].items():
            method, k = name.split(" K=")
            if " " in k:
                k, variant = k.split(" ", 1)
                method = f"{method} ({variant})"
            pos = " / ".join(f"{x:.2f}" for x in q["acceptance_by_position"])
            lines.append(f"| {method} | {k} | {_f(q['acceptance_rate'], '{:.3f}')} | "
                         f"{_f(q['mean_acceptance_length'])} | {pos} | {'yes' if q['identical_to_plain'] else 'NO'} |")
        lines.append("")
    if d.get("speed"):
        lines += [f"Speed, {c['speed_prompts']} prompts, median of {c['reps']} interleaved rounds:", "",
                  "| setting | batch | system | tok/s | vs specjax plain | vs transformers plain | "
                  "vs transformers assisted | mean acceptance length | rows identical to specjax plain |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in d["speed"]:
            lines.append(f"| {r['setting']} | {r['batch']} | {r['system']} | {r['tok_s']:.1f} | "
                         f"{r['speedup_vs_plain']:.2f}x | {_f(r.get('ratio_vs_transformers_plain'), '{:.2f}x')} | "
                         f"{_f(r.get('ratio_vs_transformers_assisted'), '{:.2f}x')} | "
                         f"{_f(r.get('mean_acceptance_length'))} | {r.get('rows_identical_to_specjax_plain', '-')} |")
        lines.append("")
    if "default_run" in d:
        r = d["default_run"]
        lines += ["| default run | wall s | peak RSS MiB | compiles (s) | tok/s | acceptance rate | "
                  "printed speedup |", "|---|---|---|---|---|---|---|",
                  f"| `{r['command']}` | {r['wall_s']:.1f} | {r['peak_rss_mib']:.0f} | "
                  f"{r.get('num_compiles', '-')} ({_f(r.get('compile_s'), '{:.1f}')}) | {_f(r.get('tok_s'), '{:.1f}')} | "
                  f"{_f(r.get('acceptance_rate'), '{:.3f}')} | {_f(r.get('printed_speedup'), '{:.2f}x')} |"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
