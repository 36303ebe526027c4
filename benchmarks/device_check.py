"""One accelerator check in one process: kernels vs references, plain-decode bandwidth, speculative speed-up.

Run by ``benchmarks/device_check.sh`` on a lent GPU (an H200: one run must finish in under 8 minutes,
models random, nothing downloaded). Parts, in priority order; each is timed, guarded, and the JSON
is rewritten after each one so a run cut short still reports what it measured:

  (a) kernels   every Pallas kernel vs its reference at real shapes (rejection sampler: V = 32000 and
                151936 against the float64 numpy reference of tests/test_rejection_kernels.py and the
                batched XLA path; paged decode attention against the XLA path), plus kernel vs XLA
                timings (median of repeated calls after warmup).
  (b) plain     greedy decoding of a random ~1.2B Llama (Llama-3.2-1B shapes) in bf16 at batch 1/8/64:
                tokens/s, and the fraction of HBM bandwidth reached = (weight bytes + KV bytes read per
                step) / step time / peak (4.8 TB/s on an H200).
  (c) spec      speculative decoding with K = 4 at synthetic per-position acceptance 0.8 (a_i = 0.8^i),
                batch 1/8/32: placeholder drafts (the engine's ceiling) and a random small draft model
                (its drafting cost included, acceptance still synthetic), speed-up over (b)'s plain runs.
  (d) compiles  backend compiles during every timed run after warmup (specjax.buckets.count_compiles).

Time per output token of a row = (T(n2 tokens) - T(n1 tokens)) / (n2 - n1), so prefill and per-request
overheads cancel; decode tokens/s = batch / that (for plain decoding it is the step time).
(b)-(d) use only the public ``specjax.LLM`` API. ``--tiny`` shrinks everything for a CPU smoke run
(kernels then run in Pallas interpret mode; its numbers say nothing about any accelerator).

    python benchmarks/device_check.py --out $OUT/device_check.json [--tiny] [--budget-s 420]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform as host_platform
import statistics
import struct
import sys
import tempfile
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

logger = logging.getLogger("device_check")
PEAK_HBM_BYTES_PER_S = {"gpu": 4.8e12}  # H200 datasheet; the ratio is reported only on a GPU

# Llama-3.2-1B shapes (1.24B parameters, tied embeddings); the tiny config is for CPU smoke runs.
TARGET_1B = dict(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, ffn=8192, vocab=128256, tied=True)
DRAFT_1B = dict(hidden=512, layers=2, heads=8, kv_heads=2, head_dim=64, ffn=2048, vocab=128256, tied=True)
TARGET_TINY = dict(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=512, vocab=4096, tied=True)
DRAFT_TINY = dict(hidden=128, layers=1, heads=2, kv_heads=1, head_dim=64, ffn=256, vocab=4096, tied=True)


# ----------------------------------------------------------------------------- random checkpoints


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Minimal safetensors writer (bf16 as raw 16-bit words): no torch, no extra package."""
    header, offset, blobs = {}, 0, []
    for name, arr in tensors.items():
        raw = np.ascontiguousarray(arr).view(np.uint16).tobytes() if arr.dtype.itemsize == 2 else arr.tobytes()
        dtype = "BF16" if arr.dtype.itemsize == 2 else "F32"
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for raw in blobs:
            f.write(raw)


def make_random_llama(path: Path, cfg: dict, seed: int, max_positions: int) -> tuple[Path, int]:
    """A random Llama checkpoint (bf16 safetensors + config.json), weights drawn on the default device
    with std 1/sqrt(fan_in). Returns (path, parameter count)."""
    path.mkdir(parents=True, exist_ok=True)
    d, f, v = cfg["hidden"], cfg["ffn"], cfg["vocab"]
    h, g, e = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    key = jax.random.key(seed)
    count = 0

    def w(shape, fan_in, scale=1.0):
        nonlocal key, count
        key, sub = jax.random.split(key)
        count += int(np.prod(shape))
        x = jax.random.normal(sub, shape, jnp.float32) * (scale / np.sqrt(fan_in))
        return np.asarray(x.astype(jnp.bfloat16))

    ones = lambda n: np.asarray(jnp.ones((n,), jnp.bfloat16))  # noqa: E731
    tensors = {"model.embed_tokens.weight": w((v, d), 1.0, 0.5)}
    for i in range(cfg["layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": w((h * e, d), d), p + "self_attn.k_proj.weight": w((g * e, d), d),
            p + "self_attn.v_proj.weight": w((g * e, d), d), p + "self_attn.o_proj.weight": w((d, h * e), h * e),
            p + "mlp.gate_proj.weight": w((f, d), d), p + "mlp.up_proj.weight": w((f, d), d),
            p + "mlp.down_proj.weight": w((d, f), f),
            p + "input_layernorm.weight": ones(d), p + "post_attention_layernorm.weight": ones(d),
        }
        count += 2 * d
    tensors["model.norm.weight"] = ones(d)
    count += d
    if not cfg["tied"]:
        tensors["lm_head.weight"] = w((v, d), d)
    _write_safetensors(path / "model.safetensors", tensors)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d, "intermediate_size": f,
        "num_hidden_layers": cfg["layers"], "num_attention_heads": h, "num_key_value_heads": g, "head_dim": e,
        "vocab_size": v, "max_position_embeddings": max_positions, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": cfg["tied"], "hidden_act": "silu", "torch_dtype": "bfloat16",
        "bos_token_id": None, "eos_token_id": None,
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path, count


# ----------------------------------------------------------------------------- helpers


def median_ms(fn, *args, reps: int) -> float:
    jax.block_until_ready(fn(*args))  # warmup (compile)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


class Report:
    """The one JSON, rewritten after every part."""

    def __init__(self, out: Path, data: dict):
        self.out, self.data = out, data

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.out)

    def part(self, name: str, fn, deadline: float) -> None:
        if time.perf_counter() > deadline:
            self.data["parts"][name] = {"skipped": "time budget spent"}
            self.save()
            return
        start = time.perf_counter()
        try:
            self.data["parts"][name] = fn()
        except Exception as exc:  # a part that fails is reported, the next ones still run
            logger.exception("part %s failed", name)
            self.data["parts"][name] = {"error": f"{type(exc).__name__}: {exc}",
                                        "traceback": traceback.format_exc()[-3000:]}
        self.data["seconds"][name] = round(time.perf_counter() - start, 2)
        self.save()


# ----------------------------------------------------------------------------- (a) kernels


def check_rejection_kernel(args) -> dict:
    from pallas_kernels.rejection import rejection_sample_kernel, standard_verify_xla
    from test_rejection_kernels import make_inputs, numpy_reference

    interpret = jax.default_backend() == "cpu"
    rows = []
    ok = True
    vocabs = (4096,) if args.tiny else (32000, 151936)
    for v in vocabs:
        for method, with_q in (("standard", False), ("standard", True), ("block", True), ("block", False)):
            b, k = (2, 4) if args.tiny else (8, 4)
            inputs = make_inputs(b, k, v, jnp.bfloat16, with_q, False, seed=v % 97, temps=(1.0, 0.7, 0.0)) + (None,)
            out, num = rejection_sample_kernel(*inputs, method=method, interpret=interpret, platform="gpu")
            ref_out, ref_num, amb = numpy_reference(inputs, method)
            agree = np.all(np.asarray(out)[~amb] == ref_out[~amb]) and np.all(np.asarray(num)[~amb] == ref_num[~amb])
            row = {"kernel": "rejection", "V": v, "B": b, "K": k, "method": method, "draft_probs": with_q,
                   "rows_checked": int((~amb).sum()), "rows_near_threshold": int(amb.sum()), "match_numpy": bool(agree)}
            if method == "standard":
                xo, _ = standard_verify_xla(*inputs[:-1])
                row["match_xla_path"] = bool(np.all(np.asarray(xo)[~amb] == np.asarray(out)[~amb]))
                agree = agree and row["match_xla_path"]
            ok = ok and bool(agree)
            rows.append(row)
    return {"ok": ok, "checks": rows, "interpret": interpret}


def time_rejection_kernel(args) -> dict:
    """Kernel vs batched XLA path inside rejection_sample_jit (random rows), V = 151936, K = 4."""
    from specjax.sample.rejection import rejection_sample_jit
    from test_rejection_kernels import make_inputs

    timings = []
    if jax.default_backend() != "cpu":
        v, k = 151936, 4
        for b in (1, 8, 32, 64):
            for with_q in (False, True):
                inputs = make_inputs(b, k, v, jnp.bfloat16, with_q, False, seed=b, temps=(1.0,))
                keys = jax.random.split(jax.random.key(0), b)
                call = lambda use_kernel: jax.jit(lambda *a: rejection_sample_jit(  # noqa: E731
                    *a, method="standard", use_kernel=use_kernel, kernel_platform="gpu"))
                a = inputs[:7] + (keys,)
                kernel_ms = median_ms(call(True), *a, reps=args.reps_kernel)
                xla_ms = median_ms(call(False), *a, reps=args.reps_kernel)
                timings.append({"B": b, "K": k, "V": v, "draft_probs": with_q, "kernel_ms": round(kernel_ms, 4),
                                "xla_ms": round(xla_ms, 4), "kernel_over_xla": round(kernel_ms / xla_ms, 3)})
    return {"timings": timings, "note": None if timings else "no timings in interpret mode"}


def check_attention_kernels(args) -> dict:
    from specjax.attention import paged_attention_xla, paged_decode_attention_gpu
    from test_attention_backends import make_batch

    interpret = jax.default_backend() == "cpu"
    rows, ok = [], True
    rng = np.random.default_rng(0)
    lengths = [37, 1, 150] if args.tiny else [700, 1, 2048, 1500, 33, 4000, 129, 2600]
    shapes = ((64, 8, 4, 16), (128, 8, 4, 32), (64, 2, 8, 16), (128, 1, 8, 32))
    for e, g, r, bs in shapes[:2] if args.tiny else shapes:
        q, kc, vc, pos, tables = make_batch(rng, t=1, g=g, r=r, e=e, block_size=bs, lengths=lengths,
                                            dtype=jnp.bfloat16)
        kw = dict(block_size=bs, scale=e**-0.5)
        ref = paged_attention_xla(q, kc, vc, pos, tables, **kw).astype(jnp.float32)
        out = paged_decode_attention_gpu(q, kc, vc, pos, tables, interpret=interpret, **kw).astype(jnp.float32)
        err = float(jnp.max(jnp.abs(out - ref)))
        rows.append({"kernel": "paged_decode_gpu", "head_dim": e, "G": g, "R": r, "block_size": bs,
                     "lengths": lengths, "max_abs_err_vs_xla": err, "ok": err < 3e-2})
        ok = ok and err < 3e-2
    return {"ok": ok, "checks": rows, "interpret": interpret, "not_run_here": "ragged_paged_tpu (TPU only)"}


def time_attention_kernels(args) -> dict:
    """Pallas paged decode vs the XLA path, Llama-3.2-1B attention shapes, context 2048."""
    from specjax.attention import paged_attention_xla, paged_decode_attention_gpu
    from test_attention_backends import make_batch

    rng = np.random.default_rng(1)
    timings = []
    if jax.default_backend() != "cpu":
        # Llama-3.2-1B attention (H 32, G 8, E 64), block 16, context 2048, bf16.
        for b in (1, 8, 64):
            q, kc, vc, pos, tables = make_batch(rng, t=1, g=8, r=4, e=64, block_size=16, lengths=[2048] * b,
                                                dtype=jnp.bfloat16)
            kw = dict(block_size=16, scale=0.125)
            pallas_ms = median_ms(jax.jit(lambda *a: paged_decode_attention_gpu(*a, **kw)), q, kc, vc, pos, tables,
                                  reps=args.reps_kernel)
            xla_ms = median_ms(jax.jit(lambda *a: paged_attention_xla(*a, **kw)), q, kc, vc, pos, tables,
                               reps=args.reps_kernel)
            kv_bytes = b * 2048 * 2 * 8 * 64 * 2
            timings.append({"B": b, "context": 2048, "pallas_ms": round(pallas_ms, 4), "xla_ms": round(xla_ms, 4),
                            "pallas_over_xla": round(pallas_ms / xla_ms, 3),
                            "pallas_kv_bytes_per_s": kv_bytes / (pallas_ms / 1e3)})
    return {"timings": timings, "note": None if timings else "no timings in interpret mode"}


# ----------------------------------------------------------------------------- (b)-(d) through specjax.LLM


def _prompts(batch, length, vocab, seed):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(0, vocab, length).tolist()} for _ in range(batch)]


def _timed_generate(llm, prompts, new_tokens, reps):
    """Median wall seconds of generate(max_tokens=new_tokens) and the compiles during the timed runs."""
    import specjax
    from specjax.buckets import count_compiles

    params = specjax.SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm the host paths for this batch
    times = []
    with count_compiles() as counter:
        for _ in range(reps):
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    return statistics.median(times), counter.count


def _decode_rate(llm, batch, args, cfg, seed):
    prompts = _prompts(batch, args.prompt_len, cfg["vocab"], seed)
    t1, c1 = _timed_generate(llm, prompts, args.short_tokens, args.reps)
    t2, c2 = _timed_generate(llm, prompts, args.long_tokens, args.reps)
    per_token_s = (t2 - t1) / (args.long_tokens - args.short_tokens)  # per output token of a row
    return {"batch": batch, "wall_s_short": t1, "wall_s_long": t2, "ms_per_token": 1e3 * per_token_s,
            "decode_tokens_per_s": batch / per_token_s, "end_to_end_tokens_per_s": batch * args.long_tokens / t2,
            "compiles_after_warmup": c1 + c2}


def _llm(ckpt, batches, args, spec=None):
    import specjax

    start = time.perf_counter()
    llm = specjax.LLM(str(ckpt), dtype="bfloat16", max_model_len=args.prompt_len + args.long_tokens + 32,
                      max_num_seqs=max(batches), max_prefill_chunk=args.prompt_len, batch_buckets=sorted(batches),
                      speculative_config=spec, warmup=True)
    metrics = llm.get_metrics()
    return llm, {"init_s": time.perf_counter() - start, "warmup_compiles": metrics.get("num_compiles"),
                 "warmup_compile_s": metrics.get("compile_seconds")}


def run_plain(args, ckpts) -> dict:
    cfg, (ckpt, n_params) = args.target_cfg, ckpts["target"]
    batches = args.plain_batches
    llm, info = _llm(ckpt, sorted(set(batches) | set(args.spec_batches)), args)
    weight_bytes = 2 * n_params  # bf16; tied embeddings: the table is read once per step as the LM head
    rows = []
    for batch in sorted(set(batches) | set(args.spec_batches)):
        row = _decode_rate(llm, batch, args, cfg, seed=batch)
        row["step_ms"] = row["ms_per_token"]  # plain decoding: one token per row per step
        # KV read per decode step: each row reads its whole context (mean over the timed window).
        ctx = args.prompt_len + (args.short_tokens + args.long_tokens) / 2
        kv_bytes = batch * ctx * cfg["layers"] * 2 * cfg["kv_heads"] * cfg["head_dim"] * 2
        row["bytes_per_step"] = weight_bytes + kv_bytes
        peak = PEAK_HBM_BYTES_PER_S.get(jax.default_backend())
        row["hbm_fraction"] = (row["bytes_per_step"] / (row["step_ms"] / 1e3) / peak) if peak else None
        rows.append(row)
    del llm
    return {"params": n_params, "weight_bytes": weight_bytes, **info, "rows": rows}


SPEC_CONFIGS = {"placeholder": ("synthetic 0.8, placeholder drafts", None),
                "draft_model": ("synthetic 0.8, random draft model", "draft")}


def run_spec(args, ckpts, plain: dict, deadline: float, which: str) -> dict:
    k = 4
    rates = [0.8**i for i in range(1, k + 1)]
    configs = [SPEC_CONFIGS[which]]
    plain_rate = {r["batch"]: r["decode_tokens_per_s"] for r in plain.get("rows", [])}
    out = []
    for name, draft in configs:
        if time.perf_counter() > deadline:
            out.append({"config": name, "skipped": "time budget spent"})
            continue
        # adaptive=False: every step verifies K = 4 drafts (the speed-up of K = 4 itself, not the controller's).
        spec = {"rejection_sample_method": "synthetic", "synthetic_acceptance_rates": rates,
                "num_speculative_tokens": k, "adaptive": False}
        if draft:
            spec |= {"method": "draft_model", "model": str(ckpts["draft"][0])}
        try:
            llm, info = _llm(ckpts["target"][0], args.spec_batches, args, spec=spec)
        except Exception as exc:
            out.append({"config": name, "error": f"{type(exc).__name__}: {exc}",
                        "traceback": traceback.format_exc()[-2000:]})
            continue
        rows = []
        for batch in args.spec_batches:
            row = _decode_rate(llm, batch, args, args.target_cfg, seed=batch)
            metrics = llm.get_metrics()  # cumulative over this LLM's runs
            row["acceptance"] = {key: metrics[key] for key in metrics if "accept" in key}
            if batch in plain_rate:
                row["speedup_vs_plain"] = row["decode_tokens_per_s"] / plain_rate[batch]
            rows.append(row)
        out.append({"config": name, "spec": spec, **info, "rows": rows})
        del llm
    return {"K": k, "rates": rates, "configs": out}


# ----------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny models, interpret-mode kernels")
    ap.add_argument("--budget-s", type=float, default=420.0, help="start no part after this many seconds")
    ap.add_argument("--parts", nargs="+", default=["kernels", "plain", "spec"])
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    tiny = args.tiny
    args.target_cfg, args.draft_cfg = (TARGET_TINY, DRAFT_TINY) if tiny else (TARGET_1B, DRAFT_1B)
    args.plain_batches = [1, 2] if tiny else [1, 8, 64]
    args.spec_batches = [1, 2] if tiny else [1, 8, 32]
    args.prompt_len = 16 if tiny else 128
    args.short_tokens, args.long_tokens = (8, 24) if tiny else (32, 160)
    args.reps = 2 if tiny else 3
    args.reps_kernel = 3 if tiny else 20

    from specjax import backends

    devices = jax.devices()
    report = Report(args.out, {
        "label": ("CPU smoke run at tiny sizes (--tiny): shows the script works end to end; no number here "
                  "describes an accelerator") if tiny else f"device check on {devices[0].device_kind}",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": host_platform.node(), "jax": jax.__version__,
        "backend": jax.default_backend(), "devices": [d.device_kind for d in devices],
        "backends": backends.describe(), "tiny": tiny,
        "config": {"target": args.target_cfg, "draft": args.draft_cfg, "plain_batches": args.plain_batches,
                   "spec_batches": args.spec_batches, "prompt_len": args.prompt_len,
                   "tokens": [args.short_tokens, args.long_tokens], "reps": args.reps,
                   "peak_hbm_bytes_per_s": PEAK_HBM_BYTES_PER_S.get(jax.default_backend())},
        "parts": {}, "seconds": {},
    })
    report.save()
    # Priority order: correctness, then the targets (plain bandwidth, spec speed-up), then extras.
    if "kernels" in args.parts:
        report.part("rejection_kernel", lambda: check_rejection_kernel(args), deadline)
        report.part("attention_kernels", lambda: check_attention_kernels(args), deadline)
    ckpts = {}
    tmp = Path(tempfile.mkdtemp(prefix="specjax_device_check_"))
    max_pos = args.prompt_len + args.long_tokens + 64
    if {"plain", "spec"} & set(args.parts):
        report.part("checkpoints", lambda: {
            name: {"params": (ckpts.setdefault(name, make_random_llama(tmp / name, cfg, seed, max_pos)))[1]}
            for name, cfg, seed in (("target", args.target_cfg, 0), ("draft", args.draft_cfg, 1))}, deadline)
    attention = report.data["parts"].get("attention_kernels", {})
    if attention and not attention.get("ok") and backends.platform() == "gpu":
        # A Pallas attention kernel that failed its check must not take the model runs down with it.
        os.environ[backends.ATTENTION_ENV] = "xla"
        report.data["attention_fallback"] = "SPECJAX_ATTENTION_BACKEND=xla: the Pallas attention check failed"
    report.data["backends_for_model_runs"] = backends.describe()
    if "plain" in args.parts and "target" in ckpts:
        report.part("plain", lambda: run_plain(args, ckpts), deadline)
    plain = report.data["parts"].get("plain", {})
    plain = plain if "rows" in plain else {}
    if "spec" in args.parts and "target" in ckpts:
        report.part("spec_placeholder", lambda: run_spec(args, ckpts, plain, deadline, "placeholder"), deadline)
    if "kernels" in args.parts:
        report.part("rejection_kernel_timing", lambda: time_rejection_kernel(args), deadline)
        report.part("attention_kernel_timing", lambda: time_attention_kernels(args), deadline)
    if "spec" in args.parts and "target" in ckpts:
        report.part("spec_draft_model", lambda: run_spec(args, ckpts, plain, deadline, "draft_model"), deadline)
    if "plain" in args.parts and "target" in ckpts and backends.attention_backend(1) != backends.XLA:
        # The same plain runs with the XLA attention path, for the Pallas-vs-XLA choice at model level.
        def plain_xla():
            os.environ[backends.ATTENTION_ENV] = "xla"
            try:
                return run_plain(args, ckpts) | {"backends": backends.describe()}
            finally:
                os.environ.pop(backends.ATTENTION_ENV, None)

        report.part("plain_xla_attention", plain_xla, deadline)
    compiles = [r.get("compiles_after_warmup", 0) for part in ("plain",)
                for r in report.data["parts"].get(part, {}).get("rows", [])]
    compiles += [r.get("compiles_after_warmup", 0) for part in ("spec_placeholder", "spec_draft_model")
                 for c in report.data["parts"].get(part, {}).get("configs", []) for r in c.get("rows", [])]
    report.data["compiles_after_warmup_total"] = int(sum(compiles))
    # specjax turns JAX's persistent compilation cache on by default: a second run loads its executables.
    report.data["compilation_cache"] = {"SPECJAX_COMPILATION_CACHE": os.environ.get("SPECJAX_COMPILATION_CACHE"),
                                        "dir": jax.config.jax_compilation_cache_dir}
    report.data["seconds"]["total"] = round(time.perf_counter() - t_start, 2)
    report.save()
    logger.info("wrote %s in %.1fs", args.out, time.perf_counter() - t_start)


if __name__ == "__main__":
    main()
