"""Train the built-in target LM and distil the draft from it, in JAX with optax.

The models are :mod:`models.llama` decoders: training uses the same linen
submodules under the same names, so the trained pytree is exactly what
``models.llama.forward`` (paged KV) and the HF exporter consume. Only attention
differs: training attends densely and causally over the whole window instead
of going through the paged cache (see :func:`train_forward`).

Commands (all seeded; same command + same stdlib = same weights on one machine)::

    python -m specjax.train.lm tokenizer --out WORK/tokenizer
    python -m specjax.train.lm train   --role target --tokenizer WORK/tokenizer --work WORK/target --export DIR
    python -m specjax.train.lm distill --teacher DIR_TARGET --work WORK/draft --export DIR_DRAFT
    python -m specjax.train.lm eval    --target DIR_TARGET --draft DIR_DRAFT

``train``/``distill`` checkpoint every ``--ckpt-every`` steps into ``--work``
and resume from the newest checkpoint, so a killed run loses little.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.llama import MLP, Embed, LlamaConfig, LMHead, RMSNorm, _OutProj, _Proj, apply_rope, rope_inv_freq

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------- model sizes

# vocab 4096, tied embeddings: the embedding is a big share of a small model and
# the engine's draft/target must share the tokenizer anyway.
TARGET_SIZE = dict(hidden_size=320, intermediate_size=864, num_hidden_layers=5, num_attention_heads=5,
                   num_key_value_heads=5, head_dim=64)
DRAFT_SIZE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=64)


def model_config(size: Mapping[str, int], *, vocab_size: int, bos_id: int, eos_id: int,
                 max_position_embeddings: int = 2048) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=bos_id,
        eos_token_ids=(eos_id,),
        **size,
    )


# --------------------------------------------------------------------------- training forward


class _DenseAttention(nn.Module):
    """Same params as ``models.llama.Attention``; dense causal attention over the window."""

    config: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:  # [B, T, D], int32 [B, T]
        c = self.config
        h, g, e = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q = _Proj(h, e, c.attention_bias, name="q_proj")(x)  # [B, T, H, E]
        k = _Proj(g, e, c.attention_bias, name="k_proj")(x)  # [B, T, G, E]
        v = _Proj(g, e, c.attention_bias, name="v_proj")(x)  # [B, T, G, E]
        if c.qk_norm:
            q = RMSNorm(c.rms_norm_eps, name="q_norm")(q)
            k = RMSNorm(c.rms_norm_eps, name="k_norm")(k)
        inv_freq = rope_inv_freq(c)
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)
        b, t = x.shape[:2]
        r = h // g
        qg = q.reshape(b, t, g, r, e)  # [B, T, G, R, E]
        scores = jnp.einsum("btgre,bsge->bgrts", qg, k, preferred_element_type=jnp.float32) * e**-0.5  # [B, G, R, T, S]
        causal = positions[:, :, None] >= positions[:, None, :]  # [B, T, S]
        scores = jnp.where(causal[:, None, None], scores, -1e30)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # [B, G, R, T, S]
        attn = jnp.einsum("bgrts,bsge->btgre", probs, v).reshape(b, t, h, e)  # [B, T, H, E]
        return _OutProj(c.hidden_size, c.attention_out_bias, name="o_proj")(attn)  # [B, T, D]


class _DenseLayer(nn.Module):
    config: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:  # [B, T, D] -> [B, T, D]
        c = self.config
        x = x + _DenseAttention(c, name="self_attn")(RMSNorm(c.rms_norm_eps, name="input_layernorm")(x), positions)
        return x + MLP(c, name="mlp")(RMSNorm(c.rms_norm_eps, name="post_attention_layernorm")(x))


class TrainModel(nn.Module):
    """Param-for-param the layout of ``models.llama.Model`` (same module names), without a KV cache.

    Sows (when ``intermediates`` is mutable) the final-normed ``hidden`` and the residual stream after each
    of ``aux_layer_ids``: the features draft heads train on.
    """

    config: LlamaConfig
    aux_layer_ids: tuple[int, ...] = ()

    @nn.compact
    def __call__(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        c = self.config
        embed = Embed(c.vocab_size, c.hidden_size, name="embed_tokens")
        x = embed(tokens)  # [B, T, D]
        for i in range(c.num_hidden_layers):
            x = _DenseLayer(c, name=f"layers_{i}")(x, positions)
            if i in self.aux_layer_ids:
                self.sow("intermediates", f"aux_{i}", x)
        hidden = RMSNorm(c.rms_norm_eps, name="norm")(x)  # [B, T, D]
        self.sow("intermediates", "hidden", hidden)
        if c.tie_word_embeddings:
            return embed.attend(hidden)  # float32 [B, T, V]
        return LMHead(c.vocab_size, name="lm_head")(hidden)  # float32 [B, T, V]


def train_forward(params: Mapping[str, Any], tokens: jax.Array, *, config: LlamaConfig,
                  positions: Optional[jax.Array] = None) -> jax.Array:
    """float32 logits [B, T, V] of int32 ``tokens [B, T]`` (causal, positions 0..T-1 unless given)."""
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)  # [B, T]
    return TrainModel(config).apply({"params": params}, tokens, positions)


# --------------------------------------------------------------------------- configs


def check_positive_ints(config, names) -> None:
    """ValueError naming the first of ``names`` that is not a positive int on ``config``."""
    for name in names:
        v = getattr(config, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 3000
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 25
    ckpt_every: int = 200
    distill_alpha: float = 0.8
    """Distillation: loss = alpha * KL(teacher || student) + (1 - alpha) * CE."""
    max_minutes: float = 0.0
    """> 0: stop (checkpoint + export) after this much wall time, even mid-schedule."""
    stop_at_step: int = 0
    """> 0: stop (checkpoint + export) once this step is done, even mid-schedule: a reproducible cut."""

    def __post_init__(self) -> None:
        check_positive_ints(self, ("steps", "batch_size", "seq_len", "log_every", "ckpt_every"))
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps must be in [0, steps), got {self.warmup_steps}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if not self.grad_clip > 0:
            raise ValueError(f"grad_clip must be > 0, got {self.grad_clip}")
        if not 0 <= self.distill_alpha <= 1:
            raise ValueError(f"distill_alpha must be in [0, 1], got {self.distill_alpha}")
        if self.max_minutes < 0:
            raise ValueError(f"max_minutes must be >= 0, got {self.max_minutes}")
        if isinstance(self.stop_at_step, bool) or not isinstance(self.stop_at_step, int) or self.stop_at_step < 0:
            raise ValueError(f"stop_at_step must be an int >= 0, got {self.stop_at_step!r}")


def make_optimizer(cfg: TrainConfig):
    import optax

    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps, decay_steps=cfg.steps,
        end_value=cfg.lr * cfg.min_lr_ratio,
    )
    # No decay on norm scales (1-D): decaying them towards 0 only fights the normalisation.
    decay_mask = lambda p: jax.tree_util.tree_map(lambda x: x.ndim > 1, p)  # noqa: E731
    tx = optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=cfg.weight_decay, mask=decay_mask),
    )
    return tx, schedule


# --------------------------------------------------------------------------- data


def batch_starts(num_tokens: int, cfg: TrainConfig, step: int) -> np.ndarray:
    """Window starts for ``step``: a function of (seed, step) only, so resuming replays the same data."""
    rng = np.random.default_rng([cfg.seed, step])
    return rng.integers(0, num_tokens - cfg.seq_len - 1, size=cfg.batch_size)  # [B]


def get_batch(stream: np.ndarray, cfg: TrainConfig, step: int) -> np.ndarray:
    starts = batch_starts(len(stream), cfg, step)
    idx = starts[:, None] + np.arange(cfg.seq_len + 1)[None, :]  # [B, T+1]
    return stream[idx].astype(np.int32)  # [B, T+1]


def load_streams(tokenizer_dir: str) -> tuple[np.ndarray, np.ndarray, Any]:
    from tokenizers import Tokenizer

    from specjax.train import corpus

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    train_files, heldout_files = corpus.split_files()
    train = corpus.encode_files(tok, train_files)  # [N]
    heldout = corpus.encode_files(tok, heldout_files)  # [M]
    logger.info("token streams: train %d tokens (%d files), held-out %d tokens (%d files)",
                len(train), len(train_files), len(heldout), len(heldout_files))
    return train, heldout, tok


# --------------------------------------------------------------------------- losses / steps


def _ce(logits: jax.Array, targets: jax.Array) -> jax.Array:  # [B, T, V], [B, T] -> scalar mean nats
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def make_train_step(config: LlamaConfig, tx, *, teacher_config: Optional[LlamaConfig] = None, alpha: float = 0.0):
    """jitted (params, opt_state, batch [B, T+1] (, teacher_params)) -> (params, opt_state, metrics)."""
    import optax

    def loss_fn(params, batch, teacher_params):
        inputs, targets = batch[:, :-1], batch[:, 1:]  # [B, T] each
        logits = train_forward(params, inputs, config=config)  # [B, T, V]
        ce = _ce(logits, targets)
        if teacher_config is None:
            return ce, {"ce": ce}
        t_logits = jax.lax.stop_gradient(train_forward(teacher_params, inputs, config=teacher_config))  # [B, T, V]
        t_logp = jax.nn.log_softmax(t_logits, axis=-1)
        s_logp = jax.nn.log_softmax(logits, axis=-1)
        kl = jnp.mean(jnp.sum(jnp.exp(t_logp) * (t_logp - s_logp), axis=-1))  # KL(teacher || student)
        return alpha * kl + (1 - alpha) * ce, {"ce": ce, "kl": kl}

    @jax.jit
    def step(params, opt_state, batch, teacher_params=None):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, teacher_params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "grad_norm": optax.global_norm(grads), **aux}

    return step


# --------------------------------------------------------------------------- checkpoints


def _ckpt_path(work: Path) -> Path:
    return work / "checkpoint.msgpack"


def save_checkpoint(work: Path, params, opt_state, step: int) -> None:
    from flax import serialization

    work.mkdir(parents=True, exist_ok=True)
    blob = serialization.to_bytes({"params": params, "opt_state": opt_state, "step": step})
    tmp = work / "checkpoint.msgpack.tmp"
    tmp.write_bytes(blob)
    os.replace(tmp, _ckpt_path(work))  # atomic: a kill mid-write keeps the previous checkpoint


def load_checkpoint(work: Path, params, opt_state) -> tuple[Any, Any, int]:
    from flax import serialization

    path = _ckpt_path(work)
    if not path.is_file():
        return params, opt_state, 0
    state = serialization.from_bytes({"params": params, "opt_state": opt_state, "step": 0}, path.read_bytes())
    logger.info("resumed from %s at step %d", path, state["step"])
    return state["params"], state["opt_state"], int(state["step"])


# --------------------------------------------------------------------------- driver


def train_loop(config: LlamaConfig, cfg: TrainConfig, stream: np.ndarray, work: Path, *,
               teacher: Optional[tuple[LlamaConfig, Any]] = None) -> tuple[Any, dict]:
    """Train (or distil, with ``teacher=(config, params)``) and return (params, stats)."""
    from models.llama import init_params, num_params

    tx, schedule = make_optimizer(cfg)
    params = init_params(config, jax.random.key(cfg.seed))
    opt_state = tx.init(params)
    params, opt_state, start = load_checkpoint(work, params, opt_state)
    logger.info("model: %d params (%s), train config %s", num_params(params), config, cfg)
    step_fn = make_train_step(config, tx, teacher_config=None if teacher is None else teacher[0],
                              alpha=cfg.distill_alpha)
    t_params = None if teacher is None else teacher[1]
    t0, cpu0 = time.time(), time.process_time()
    tokens_seen = 0
    # stop_at_step: a reproducible cut (the schedule stays that of cfg.steps); resuming past it trains nothing.
    end = min(cfg.steps, cfg.stop_at_step) if cfg.stop_at_step else cfg.steps
    done = start
    for step in range(start, end):
        batch = jnp.asarray(get_batch(stream, cfg, step))
        params, opt_state, m = step_fn(params, opt_state, batch, t_params)
        tokens_seen += cfg.batch_size * cfg.seq_len
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.steps:
            m = {k: float(v) for k, v in m.items()}
            el = time.time() - t0
            logger.info("step %d/%d %s lr %.2e | %.0f tok/s wall, %.1f min", done, cfg.steps,
                        " ".join(f"{k} {v:.4f}" for k, v in m.items()), float(schedule(done)),
                        tokens_seen / max(el, 1e-9), el / 60)
            if not math.isfinite(m["loss"]):
                raise FloatingPointError(f"loss is {m['loss']} at step {done}")
        if done % cfg.ckpt_every == 0:
            save_checkpoint(work, params, opt_state, done)
        if cfg.max_minutes and time.time() - t0 > cfg.max_minutes * 60 and done < end:
            logger.warning("max_minutes=%s reached at step %d of %d: stopping early", cfg.max_minutes, done, cfg.steps)
            break
    stopped_early = done < cfg.steps
    if start < done:
        save_checkpoint(work, params, opt_state, done)
    stats = {"steps_done": done, "steps_planned": cfg.steps, "stopped_early": stopped_early,
             "wall_s_this_run": round(time.time() - t0, 1), "cpu_s_this_run": round(time.process_time() - cpu0, 1),
             "params": num_params(params)}
    return params, stats


# --------------------------------------------------------------------------- evaluation


def evaluate(stream: np.ndarray, target: tuple[LlamaConfig, Any], draft: Optional[tuple[LlamaConfig, Any]] = None,
             *, seq_len: int = 256, batch_size: int = 8) -> dict:
    """Held-out perplexity of target (and draft) and the draft's top-1 agreement with the target.

    The stream is cut into non-overlapping ``seq_len + 1``-token windows (the
    tail that does not fill a window is dropped); each window is scored from a
    fresh context, every position counts once.
    """
    n = (len(stream) - 1) // seq_len
    if n < 1:
        raise ValueError(f"stream of {len(stream)} tokens is shorter than seq_len + 1 = {seq_len + 1}")
    windows = np.stack([stream[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)]).astype(np.int32)  # [N, T+1]

    def make_scorer(cfg: LlamaConfig):
        @jax.jit
        def score(params, batch):  # [B, T+1] -> (per-row nll sum [B], argmax [B, T])
            logits = train_forward(params, batch[:, :-1], config=cfg)  # [B, T, V]
            logp = jax.nn.log_softmax(logits, axis=-1)
            nll = -jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1)[..., 0]  # [B, T]
            return jnp.sum(nll, axis=-1), jnp.argmax(logits, axis=-1)

        return score

    models = {"target": target} if draft is None else {"target": target, "draft": draft}
    scorers = {k: make_scorer(v[0]) for k, v in models.items()}
    nll = {k: 0.0 for k in models}
    agree = top1_t = top1_d = count = 0
    for i in range(0, n, batch_size):
        b = windows[i: i + batch_size]
        real = len(b)
        if real < batch_size:  # pad to one static shape; padded rows are dropped below
            b = np.concatenate([b, np.repeat(b[-1:], batch_size - real, axis=0)])
        am = {}
        for k, (_, params) in models.items():
            row_nll, am_k = scorers[k](params, jnp.asarray(b))
            nll[k] += float(np.asarray(row_nll)[:real].sum())
            am[k] = np.asarray(am_k)[:real]  # [real, T]
        gold = b[:real, 1:]
        count += gold.size
        top1_t += int((am["target"] == gold).sum())
        if draft is not None:
            agree += int((am["draft"] == am["target"]).sum())
            top1_d += int((am["draft"] == gold).sum())
    out = {"heldout_tokens_scored": count, "target_ppl": math.exp(nll["target"] / count),
           "target_top1_acc": top1_t / count}
    if draft is not None:
        out.update({"draft_ppl": math.exp(nll["draft"] / count), "draft_top1_acc": top1_d / count,
                    "draft_target_top1_agreement": agree / count})
    return out


# --------------------------------------------------------------------------- CLI


def _add_train_args(ap: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(d, f.name)), default=getattr(d, f.name))


def _train_config(args) -> TrainConfig:
    return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})


def _write_stats(work: Path, stats: dict) -> None:
    work.mkdir(parents=True, exist_ok=True)
    (work / "train_stats.json").write_text(json.dumps(stats, indent=2) + "\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m specjax.train.lm", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("tokenizer", help="train the stdlib BPE tokenizer")
    p.add_argument("--out", required=True)
    p.add_argument("--vocab-size", type=int, default=4096)
    p = sub.add_parser("train", help="train the target (or any size preset) from scratch with CE")
    p.add_argument("--role", choices=("target", "draft"), default="target", help="size preset")
    p.add_argument("--tokenizer", required=True, help="directory with tokenizer.json")
    p.add_argument("--work", required=True, help="checkpoint directory (resumed if present)")
    p.add_argument("--export", help="write the HF-format model directory here when done")
    _add_train_args(p)
    p = sub.add_parser("distill", help="train the draft on the target's soft labels (KL) + CE")
    p.add_argument("--teacher", required=True, help="exported target HF directory (has the tokenizer)")
    p.add_argument("--work", required=True)
    p.add_argument("--export")
    _add_train_args(p)
    p = sub.add_parser("eval", help="held-out perplexity and draft/target top-1 agreement")
    p.add_argument("--target", required=True)
    p.add_argument("--draft")
    p.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from specjax.train import corpus, export

    if args.cmd == "tokenizer":
        corpus.main(["--out", args.out, "--vocab-size", str(args.vocab_size)])
        return
    if args.cmd == "eval":
        from models.loading import load_hf_model

        _, heldout, _ = load_streams(args.target)
        target = load_hf_model(args.target, "float32")
        draft = load_hf_model(args.draft, "float32") if args.draft else None
        t0, c0 = time.time(), time.process_time()
        res = evaluate(heldout, target, draft, seq_len=args.seq_len)
        res.update(wall_s=round(time.time() - t0, 1), cpu_s=round(time.process_time() - c0, 1))
        logger.info("eval: %s", json.dumps(res))
        print(json.dumps(res, indent=2))
        return

    cfg = _train_config(args)
    work = Path(args.work)
    c0 = time.process_time()
    if args.cmd == "train":
        tok_dir = args.tokenizer
        train, heldout, tok = load_streams(tok_dir)
        size = TARGET_SIZE if args.role == "target" else DRAFT_SIZE
        config = model_config(size, vocab_size=tok.get_vocab_size(), bos_id=tok.token_to_id(corpus.BOS_TOKEN),
                              eos_id=tok.token_to_id(corpus.EOS_TOKEN))
        params, stats = train_loop(config, cfg, train, work)
        res = evaluate(heldout, (config, params), seq_len=cfg.seq_len)
    else:
        from models.loading import load_hf_model

        tok_dir = args.teacher
        train, heldout, tok = load_streams(tok_dir)
        t_config, t_params = load_hf_model(args.teacher, "float32")  # the shipped (bf16-rounded) target
        config = model_config(DRAFT_SIZE, vocab_size=t_config.vocab_size, bos_id=t_config.bos_token_id,
                              eos_id=t_config.eos_token_ids[0])
        params, stats = train_loop(config, cfg, train, work, teacher=(t_config, t_params))
        res = evaluate(heldout, (t_config, t_params), (config, params), seq_len=cfg.seq_len)
    stats.update({"heldout_fp32": res, "train_config": dataclasses.asdict(cfg),
                  "process_cpu_s": round(time.process_time() - c0, 1)})
    logger.info("done: %s", json.dumps(stats))
    _write_stats(work, stats)
    if args.export:
        export.export_hf(params, config, args.export, tokenizer_dir=tok_dir)


if __name__ == "__main__":
    main()
