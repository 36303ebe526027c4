"""Train draft heads (EAGLE, EAGLE-3, MTP, Medusa) for a target: ``specjax train-head``.

Data: windows of the target's own training corpus (the stdlib split, tokenized
by the target's tokenizer), drawn as a function of (seed, step) so a resumed
run sees the same batches. The target runs once per batch (dense causal
attention, :class:`specjax.train.lm.TrainModel`) and hands the head its
features (final-normed hidden states, or EAGLE-3's aux layers) and its
distribution; the head is distilled to it (KL(target || head)).

* EAGLE: one step (entry ``p`` = token ``x_{p+1}``, feature ``h_p``) + a smooth-L1
  regression of the head's output to the target's next feature ``h_{p+1}``
  (what chained drafting feeds back in its place).
* MTP: one step, KL only (DeepSeek-V3 trains its MTP module one step deep).
* EAGLE-3: training-time test, ``--ttt-depth`` steps unrolled. At depth ``j``
  entry ``p`` takes the depth ``j-1`` output of entry ``p-1`` as its feature and
  attends to the true entries up to ``p-j`` plus its own chain (depths 1..j at
  positions ``p-j+1..p``): exactly the context it has when drafting token ``j+1``.
* Medusa: head ``i`` at ``p`` is distilled to the target's distribution at ``p+i+1``.

AdamW + warmup/cosine (:func:`specjax.train.lm.make_optimizer`); checkpoints
(params, optimizer state, step) with orbax ``CheckpointManager``, so a rerun of
the same command resumes and ends where an uninterrupted run ends. Every
``--eval-every`` steps: teacher-forced top-1 agreement of each draft depth with
the target on held-out windows (a proxy for acceptance, printed on the bar).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from models.heads import HEAD_METHODS, HeadConfig, combine_hidden_states, head_hidden_to_logits, init_head_params, \
    medusa_hidden, save_head
from models.llama import MLP, LlamaConfig, RMSNorm, _OutProj, _Proj, apply_rope, lm_head_logits, rope_inv_freq
from specjax.train.lm import TrainConfig, TrainModel, get_batch, load_streams, make_optimizer

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- target features


def target_features(target_params, tokens: jax.Array, *, config: LlamaConfig, aux_layer_ids=()):
    """(logits [B, T, V], hidden [B, T, D], aux [B, T, A*D] or None) of the target on ``tokens [B, T]``."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    logits, state = TrainModel(config, tuple(aux_layer_ids)).apply(
        {"params": target_params}, tokens, positions, mutable=["intermediates"]
    )
    inter = state["intermediates"]
    aux = jnp.concatenate([inter[f"aux_{i}"][0] for i in aux_layer_ids], axis=-1) if aux_layer_ids else None
    return logits, inter["hidden"][0], aux


# --------------------------------------------------------------------------- dense head forward


def _norm(params, x, eps):
    return RMSNorm(eps).apply({"params": params}, x)


def _fc_input(head_params, embeds, feats, config: HeadConfig):
    """The decoder layer's input of a fusion head: fc([embed; feature]) (MTP normalises both first)."""
    if config.method == "mtp":
        embeds = _norm(head_params["enorm"], embeds, config.rms_norm_eps)
        feats = _norm(head_params["hnorm"], feats, config.rms_norm_eps)
    return jnp.concatenate([embeds, feats.astype(embeds.dtype)], -1) @ head_params["fc"]["kernel"]  # [B, T, D]


def _qkv(lp, x, positions, c: LlamaConfig):
    normed = _norm(lp["input_layernorm"], x, c.rms_norm_eps)
    attn = lp["self_attn"]
    q = _Proj(c.num_attention_heads, c.head_dim, False).apply({"params": attn["q_proj"]}, normed)  # [B, T, H, E]
    k = _Proj(c.num_key_value_heads, c.head_dim, False).apply({"params": attn["k_proj"]}, normed)  # [B, T, G, E]
    v = _Proj(c.num_key_value_heads, c.head_dim, False).apply({"params": attn["v_proj"]}, normed)  # [B, T, G, E]
    inv_freq = rope_inv_freq(c)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def _attend(q, k, v, mask, c: LlamaConfig):
    """q [B, T, H, E] over k, v [B, S, G, E] where ``mask [T, S]``."""
    b, t, h, e = q.shape
    g = c.num_key_value_heads
    qg = q.reshape(b, t, g, h // g, e)  # [B, T, G, R, E]
    scores = jnp.einsum("btgre,bsge->bgrts", qg, k, preferred_element_type=jnp.float32) * e**-0.5
    scores = jnp.where(mask[None, None, None], scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bgrts,bsge->btgre", probs, v).reshape(b, t, h, e)  # [B, T, H, E]


def fusion_train_forward(head_params, target_params, next_tokens, feats, *, config: HeadConfig, depth: int):
    """Head hidden [depth, B, T, D] for entries ``p`` = (``next_tokens[:, p]``, ``feats[:, p]``).

    Depth 0 is the plain causal pass; depth ``j`` is the training-time-test step described in the module
    docstring. ``feats`` are target features [B, T, F] (before fc_aux).
    """
    c = config.layer_config
    lp = head_params["layer"]
    b, t = next_tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    embeds = jnp.take(target_params["embed_tokens"]["embedding"], next_tokens, axis=0)  # [B, T, D]
    feat = combine_hidden_states(head_params, feats, config=config)
    qpos = jnp.arange(t)[:, None]
    kpos = jnp.arange(t)[None, :]
    keys, values, outs = [], [], []
    for j in range(depth):
        x = _fc_input(head_params, embeds, feat, config)
        q, k, v = _qkv(lp, x, positions, c)
        keys.append(k)
        values.append(v)
        # True entries up to p - j, then the chain: depth i at position p - j + i.
        mask = jnp.concatenate([kpos <= qpos - j] + [kpos == qpos - j + i for i in range(1, j + 1)], axis=1)
        attn = _attend(q, jnp.concatenate(keys, 1), jnp.concatenate(values, 1), mask, c)
        x = x + _OutProj(c.hidden_size, False).apply({"params": lp["self_attn"]["o_proj"]}, attn)
        x = x + MLP(c).apply({"params": lp["mlp"]}, _norm(lp["post_attention_layernorm"], x, c.rms_norm_eps))
        outs.append(x)
        feat = jnp.pad(x[:, :-1], ((0, 0), (1, 0), (0, 0)))  # entry p's next feature: this depth's output at p - 1
    return jnp.stack(outs)


def _kl(t_logits, s_logits):  # [..., V] x2 -> [...]
    t_logp = jax.nn.log_softmax(t_logits, axis=-1)
    return jnp.sum(jnp.exp(t_logp) * (t_logp - jax.nn.log_softmax(s_logits, axis=-1)), axis=-1)


def head_losses(head_params, target_params, batch, *, config: HeadConfig, target_config: LlamaConfig, depth: int):
    """(loss, metrics) on ``batch [B, T+1]``; metrics include top-1 agreement per draft depth."""
    t_logits, hidden, aux = target_features(target_params, batch, config=target_config,
                                            aux_layer_ids=config.aux_layer_ids)
    t_logits, hidden = jax.lax.stop_gradient(t_logits), jax.lax.stop_gradient(hidden)
    t = batch.shape[1] - 1
    metrics = {}
    if config.method == "medusa":
        hid = medusa_hidden(head_params, hidden[:, :t].reshape(-1, hidden.shape[-1]), config=config)  # [B*T, N, D]
        hid = hid.reshape(batch.shape[0], t, config.num_medusa_heads, -1)
        loss = 0.0
        for i in range(config.num_medusa_heads):
            # Head i at p predicts x_{p+i+2}: the target's distribution at p+i+1 (valid for p+i+1 <= T).
            n = t - i
            s_logits = lm_head_logits(target_params, hid[:, :n, i], config=target_config)  # [B, n, V]
            teacher = t_logits[:, i + 1 : i + 1 + n]
            loss = loss + jnp.mean(_kl(teacher, s_logits))
            metrics[f"agree_{i + 1}"] = jnp.mean(jnp.argmax(s_logits, -1) == jnp.argmax(teacher, -1))
        return loss / config.num_medusa_heads, metrics
    feats = jax.lax.stop_gradient(aux if config.method == "eagle3" else hidden)[:, :t]
    outs = fusion_train_forward(head_params, target_params, batch[:, 1:], feats, config=config, depth=depth)
    teacher = t_logits[:, 1:]  # [B, T, V]: entry p predicts x_{p+2}, the target's distribution at p + 1
    loss = 0.0
    for j in range(depth):
        s_logits = head_hidden_to_logits(head_params, target_params, outs[j], config=config,
                                         target_config=target_config)
        valid = (jnp.arange(t) >= j)[None, :]  # entries whose chain starts at a real position
        loss = loss + jnp.sum(_kl(teacher, s_logits) * valid) / (jnp.sum(valid) * batch.shape[0])
        agree = (jnp.argmax(s_logits, -1) == jnp.argmax(teacher, -1)) & valid
        metrics[f"agree_{j + 1}"] = jnp.sum(agree) / (jnp.sum(valid) * batch.shape[0])
    loss = loss / depth
    if config.method == "eagle":
        diff = outs[0][:, : t - 1] - hidden[:, 1:t]
        reg = jnp.mean(jnp.where(jnp.abs(diff) < 1.0, 0.5 * diff**2, jnp.abs(diff) - 0.5))  # smooth L1
        metrics["reg"] = reg
        loss = loss + reg
    return loss, metrics


# --------------------------------------------------------------------------- training loop


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadTrainConfig:
    """What ``specjax train-head`` trains (the optimizer/data settings are a :class:`TrainConfig`)."""

    method: str
    ttt_depth: int = 3
    """EAGLE-3 only: training-time-test steps unrolled."""
    num_medusa_heads: int = 4
    eval_every: int = 100
    eval_batches: int = 4

    def __post_init__(self) -> None:
        if self.method not in HEAD_METHODS:
            raise ValueError(f"method must be one of {list(HEAD_METHODS)}, got {self.method!r}")
        for name in ("ttt_depth", "num_medusa_heads", "eval_every", "eval_batches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")

    @property
    def depth(self) -> int:
        return self.ttt_depth if self.method == "eagle3" else 1

    def head_config(self, target: LlamaConfig) -> HeadConfig:
        kw = {"num_medusa_heads": self.num_medusa_heads} if self.method == "medusa" else {}
        return HeadConfig.for_target(self.method, target, **kw)


def _manager(work: Path, keep: int = 2):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(work.absolute() / "checkpoints", options=ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True))


def save_state(mngr, step: int, state: Mapping[str, Any]) -> None:
    import orbax.checkpoint as ocp

    mngr.save(step, args=ocp.args.StandardSave(dict(state)))
    mngr.wait_until_finished()


def restore_state(mngr, like: Mapping[str, Any]) -> tuple[dict, int]:
    """The latest checkpoint (restored into the structure of ``like``) and its step, or (like, 0)."""
    import orbax.checkpoint as ocp

    step = mngr.latest_step()
    if step is None:
        return dict(like), 0
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, dict(like))
    state = mngr.restore(step, args=ocp.args.StandardRestore(abstract))
    logger.info("resumed from orbax checkpoint step %d", step)
    return state, int(step)


def train_head(target: tuple[LlamaConfig, Any], hcfg: HeadTrainConfig, cfg: TrainConfig, train: np.ndarray,
               heldout: np.ndarray, work: Path, *, progress: bool = True, stop_after: int | None = None):
    """Train a head for ``target`` in ``work`` (resuming its orbax checkpoint); returns (HeadConfig, params, stats).

    ``stop_after``: leave after this many steps of the schedule (checkpointed), as an interruption would.
    """
    import optax
    from tqdm import tqdm

    t_config, t_params = target
    config = hcfg.head_config(t_config)
    tx, _ = make_optimizer(cfg)
    params = init_head_params(config, jax.random.key(cfg.seed))
    mngr = _manager(work)
    state, start = restore_state(mngr, {"params": params, "opt_state": tx.init(params)})
    params, opt_state = state["params"], state["opt_state"]
    loss_kw = dict(config=config, target_config=t_config, depth=hcfg.depth)

    @jax.jit
    def step_fn(params, opt_state, batch):
        (loss, m), grads = jax.value_and_grad(head_losses, has_aux=True)(params, t_params, batch, **loss_kw)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss, **m}

    eval_fn = jax.jit(lambda p, b: head_losses(p, t_params, b, **loss_kw))

    def evaluate(params) -> dict:
        ms = [eval_fn(params, jnp.asarray(get_batch(heldout, cfg, 10**6 + i)))[1] for i in range(hcfg.eval_batches)]
        return {k: round(float(np.mean([m[k] for m in ms])), 4) for k in ms[0]}

    end = cfg.steps if stop_after is None else min(cfg.steps, start + stop_after)
    t0, history = time.time(), []
    bar = tqdm(range(start, end), initial=start, total=cfg.steps, desc=f"train-head {hcfg.method}",
               disable=not progress)
    m = {}
    for step in bar:
        params, opt_state, m = step_fn(params, opt_state, jnp.asarray(get_batch(train, cfg, step)))
        done = step + 1
        if done % cfg.log_every == 0:
            bar.set_postfix({k: f"{float(v):.3f}" for k, v in m.items()})
        if done % hcfg.eval_every == 0 or done == cfg.steps:
            ev = evaluate(params)
            history.append({"step": done, **ev})
            logger.info("step %d held-out %s", done, ev)
        if done % cfg.ckpt_every == 0 or done == end:
            save_state(mngr, done, {"params": params, "opt_state": opt_state})
    stats = {"method": hcfg.method, "steps_done": end, "steps_planned": cfg.steps,
             "wall_s_this_run": round(time.time() - t0, 1), "eval": history,
             "final_train": {k: float(v) for k, v in m.items()}}
    return config, params, stats


# --------------------------------------------------------------------------- CLI


def run(args: argparse.Namespace) -> int:
    """``specjax train-head`` (flags in specjax/cli.py)."""
    from models.loading import load_hf_model
    from specjax.builtin import resolve_model

    target_dir = resolve_model(args.target)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                      warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, seed=args.seed,
                      log_every=args.log_every, ckpt_every=args.ckpt_every)
    hcfg = HeadTrainConfig(method=args.method, ttt_depth=args.ttt_depth, num_medusa_heads=args.num_medusa_heads,
                           eval_every=args.eval_every)
    target = load_hf_model(target_dir, "float32")  # a bad --target fails here, naming the path
    if not (Path(target_dir) / "tokenizer.json").is_file():
        raise ValueError(f"--target {target_dir!r} has no tokenizer.json (train-head reads the corpus with it)")
    train, heldout, _ = load_streams(target_dir)
    work = Path(args.work)
    c0 = time.process_time()
    config, params, stats = train_head(target, hcfg, cfg, train, heldout, work, progress=not args.no_progress)
    stats.update(train_config=dataclasses.asdict(cfg), head=dataclasses.asdict(hcfg),
                 process_cpu_s=round(time.process_time() - c0, 1))
    work.mkdir(parents=True, exist_ok=True)
    (work / "train_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    logger.info("done: %s", json.dumps({k: stats[k] for k in ("steps_done", "wall_s_this_run", "process_cpu_s")}))
    if args.export:
        save_head(args.export, config, params)
        logger.info("exported %s head to %s", args.method, args.export)
    return 0
