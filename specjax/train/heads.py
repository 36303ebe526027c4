"""Train draft heads (EAGLE, EAGLE-3, MTP, Medusa) for a target: ``specjax train-head``.

The head is the engine's own module (:class:`models.heads.FusionHead`, its dense
attention path) and the target's features come from the engine's own forward
(:func:`models.llama.forward_features`), so what is trained is exactly what
drafts. Two corpora:

* ``--corpus stdlib`` (default): windows of the Python standard library's
  source tokenized by the target's tokenizer, drawn as a function of (seed,
  step); the target runs inside each step (features and teacher).
* ``--corpus generated``: text the target writes itself for varied prompts
  (prose, chat, code; :mod:`specjax.train.selfgen`, as the EAGLE authors
  regenerate their data), generated once into ``--data`` with each position's
  hidden state, fused-layer features and argmax, so training never runs the
  target again. Rows are drawn as a function of (seed, step); the last
  ``--eval-rows`` rows are held out for evaluation.

Teacher: the target's distribution at the predicted position (its LM head on
its final hidden state); the head is distilled to it (KL(target || head)).
With ``--draft-vocab-size N`` the head's own LM head covers the N most frequent
target tokens of the training corpus (``d2t``); as in EAGLE-3 the teacher is
restricted to them and renormalised, and positions whose target argmax lies
outside them are not trained on.

* EAGLE: one step (entry ``p`` = token ``x_{p+1}``, feature ``h_p``) + a smooth-L1
  regression of the head's output to the target's next feature ``h_{p+1}``.
* MTP: one step, KL only.
* EAGLE-3: training-time test, ``--ttt-depth`` steps unrolled. At depth ``j``
  entry ``p`` takes the depth ``j-1`` output of entry ``p-1`` as its feature and
  attends to the true entries up to ``p-j`` plus its own chain (depths 1..j at
  positions ``p-j+1..p``): exactly the context it has when drafting token ``j+1``.
* Medusa: head ``i`` at ``p`` is distilled to the target's distribution at ``p+i+1``.

AdamW + warmup/cosine (:func:`specjax.train.lm.make_optimizer`); checkpoints
(params, optimizer state, step) with orbax ``CheckpointManager``, so a rerun of
the same command resumes and ends where an uninterrupted run ends. Every
``--eval-every`` steps: teacher-forced top-1 agreement of each draft depth with
the target on held-out data (a proxy for acceptance).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from models.heads import HEAD_LAYOUTS, HEAD_METHODS, FusionHead, HeadConfig, combine_hidden_states, head_embed, \
    head_draft_logits, init_head_params, medusa_draft_logits, save_head, split_trainable
from models.llama import LlamaConfig, forward_features
from specjax.train.lm import TrainConfig, check_positive_ints, get_batch, make_optimizer

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- target features


def target_features(target_params, tokens: jax.Array, *, config: LlamaConfig, aux_layer_ids=()):
    """(logits [B, T, V], hidden [B, T, D], aux [B, T, A*D] or None) of the target on ``tokens [B, T]``.

    The engine's forward (:func:`models.llama.forward_features`) over a scratch paged cache of one
    ``T``-slot block per row.
    """
    from specjax.kv_cache import AttentionMetadata, KVCache

    b, t = tokens.shape
    cache = KVCache.allocate(num_layers=config.num_hidden_layers, num_blocks=b, block_size=t,
                             num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                             dtype=jax.tree.leaves(target_params)[0].dtype)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]
    md = AttentionMetadata(slot_mapping=rows * t + positions, block_tables=rows)
    logits, hidden, aux, _ = forward_features(target_params, tokens, positions, cache, md, config=config,
                                              aux_layer_ids=tuple(aux_layer_ids))
    return logits, hidden, aux


def teacher_logits(target_params, hidden: jax.Array, *, config: LlamaConfig, d2t: Optional[jax.Array]):
    """float32 target logits [B, T, V] of final-normed ``hidden``, or only the draft vocabulary's [B, T, Vd]."""
    from models.llama import lm_head_logits

    if d2t is None:
        return lm_head_logits(target_params, hidden, config=config)
    if config.tie_word_embeddings:
        w = jnp.take(target_params["embed_tokens"]["embedding"], d2t, axis=0)  # [Vd, D]
        return jnp.einsum("btd,vd->btv", hidden, w.astype(hidden.dtype), preferred_element_type=jnp.float32)
    w = jnp.take(target_params["lm_head"]["kernel"], d2t, axis=1)  # [D, Vd]
    return jnp.einsum("btd,dv->btv", hidden, w.astype(hidden.dtype), preferred_element_type=jnp.float32)


# --------------------------------------------------------------------------- head forward (dense, TTT)


def fusion_train_forward(head_params, target_params, next_tokens, feats, *, config: HeadConfig, depth: int):
    """Head hidden [depth, B, T, D] for entries ``p`` = (``next_tokens[:, p]``, ``feats[:, p]``).

    Depth 0 is the plain causal pass; depth ``j`` is the training-time-test step described in the module
    docstring. ``feats`` are target features [B, T, F] (before fc_aux). Runs :class:`FusionHead`'s dense path.
    """
    b, t = next_tokens.shape
    head = FusionHead(config)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    embeds = head_embed(head_params, target_params, next_tokens, config=config)  # [B, T, D]
    feat = combine_hidden_states(head_params, feats, config=config)
    qpos = jnp.arange(t)[:, None]
    kpos = jnp.arange(t)[None, :]
    keys = values = None
    outs = []
    for j in range(depth):
        # True entries up to p - j, then the chain: depth i at position p - j + i.
        mask = jnp.concatenate([kpos <= qpos - j] + [kpos == qpos - j + i for i in range(1, j + 1)], axis=1)
        x, k, v = head.apply({"params": head_params}, embeds, feat, positions, keys, values, mask,
                             method=FusionHead.dense)
        keys = k if keys is None else jnp.concatenate([keys, k], axis=1)
        values = v if values is None else jnp.concatenate([values, v], axis=1)
        outs.append(x)
        feat = jnp.pad(x[:, :-1], ((0, 0), (1, 0), (0, 0)))  # entry p's next feature: this depth's output at p - 1
    return jnp.stack(outs)


def _kl(t_logits, s_logits):  # [..., V] x2 -> [...]
    t_logp = jax.nn.log_softmax(t_logits, axis=-1)
    return jnp.sum(jnp.exp(t_logp) * (t_logp - jax.nn.log_softmax(s_logits, axis=-1)), axis=-1)


def _features(target_params, batch, *, config: HeadConfig, target_config: LlamaConfig):
    """(hidden [B, T+1, D], aux or None, top1 [B, T+1], mask [B, T+1]) of a batch: stored, or run now."""
    if "hidden" in batch:
        aux = batch.get("aux")
        return (batch["hidden"].astype(jnp.float32), None if aux is None else aux.astype(jnp.float32),
                batch["top1"], batch["mask"])
    logits, hidden, aux = target_features(target_params, batch["tokens"], config=target_config,
                                          aux_layer_ids=config.aux_layer_ids)
    top1 = jnp.argmax(logits, -1).astype(jnp.int32)
    return (jax.lax.stop_gradient(hidden), None if aux is None else jax.lax.stop_gradient(aux), top1,
            jnp.ones(top1.shape, bool))


def head_losses(trainable, target_params, batch, *, config: HeadConfig, target_config: LlamaConfig, depth: int,
                buffers: Optional[Mapping[str, Any]] = None):
    """(loss, metrics) on a batch; metrics include top-1 agreement per draft depth.

    ``batch``: {"tokens": [B, T+1]} (the target runs here), or generated data with "hidden", "aux",
    "top1" (the target's argmax, -1 where unknown) and "mask" (positions whose teacher counts), all
    [B, T+1, ...]. ``buffers``: the head's integer buffers (d2t), not trained.
    """
    params = {**trainable, **(buffers or {})}
    d2t = params.get("d2t")
    hidden, aux, top1, mask = _features(target_params, batch, config=config, target_config=target_config)
    tokens = batch["tokens"]
    t = tokens.shape[1] - 1
    if d2t is not None:  # EAGLE-3: only positions whose target argmax the draft vocabulary can express
        in_vocab = jnp.zeros((config.vocab_size,), bool).at[d2t].set(True)
        mask = mask & (top1 >= 0) & in_vocab[jnp.maximum(top1, 0)]
    metrics = {}
    teacher = teacher_logits(target_params, hidden[:, 1:], config=target_config, d2t=d2t)  # [B, T, Vd]: x_{q+2}

    def distill(s_logits, first, n, valid=None):
        """Head logits [B, n, Vd] vs the target's distributions at positions first+1 .. first+n."""
        t_logits = teacher[:, first:first + n]
        m = mask[:, first + 1:first + 1 + n]
        m = m if valid is None else m & valid
        denom = jnp.maximum(jnp.sum(m), 1)
        agree = jnp.argmax(s_logits, -1) == jnp.argmax(t_logits, -1)
        return jnp.sum(_kl(t_logits, s_logits) * m) / denom, jnp.sum(agree & m) / denom

    if config.method == "medusa":
        b = tokens.shape[0]
        flat = hidden[:, :t].reshape(-1, hidden.shape[-1])  # [B*T, D]
        logits = medusa_draft_logits(params, target_params, flat, config=config, target_config=target_config)
        logits = logits.reshape(b, t, config.num_medusa_heads, -1)  # [B, T, N, Vd]
        loss = 0.0
        for i in range(config.num_medusa_heads):
            # Head i at p predicts x_{p+i+2}: the target's distribution at p+i+1 (valid for p+i+1 <= T).
            kl, agree = distill(logits[:, : t - i, i], i, t - i)
            loss = loss + kl
            metrics[f"agree_{i + 1}"] = agree
        return loss / config.num_medusa_heads, metrics
    feats = (aux if config.method == "eagle3" else hidden)[:, :t]
    outs = fusion_train_forward(params, target_params, tokens[:, 1:], feats, config=config, depth=depth)
    loss = 0.0
    for j in range(depth):
        s_logits = head_draft_logits(params, target_params, outs[j], config=config, target_config=target_config)
        # Entry p predicts x_{p+2}: the target's distribution at p + 1; depth j needs p >= j (a real chain start).
        kl, agree = distill(s_logits, 0, t, (jnp.arange(t) >= j)[None, :])
        loss = loss + kl
        metrics[f"agree_{j + 1}"] = agree
    loss = loss / depth
    if config.method == "eagle":
        diff = outs[0][:, : t - 1] - hidden[:, 1:t]
        m = mask[:, 1:t, None]
        reg = jnp.sum(jnp.where(jnp.abs(diff) < 1.0, 0.5 * diff**2, jnp.abs(diff) - 0.5) * m) / jnp.maximum(
            jnp.sum(m) * diff.shape[-1], 1)  # smooth L1
        metrics["reg"] = reg
        loss = loss + reg
    return loss, metrics


# --------------------------------------------------------------------------- data


def draft_vocab(counts: np.ndarray, size: int) -> np.ndarray:
    """The ``size`` most frequent ids (ties: lower id first), sorted: a draft vocabulary's d2t (absolute ids)."""
    if not 1 <= size <= len(counts):
        raise ValueError(f"draft_vocab_size must be in [1, {len(counts)}], got {size}")
    order = np.lexsort((np.arange(len(counts)), -counts))  # by count descending, then id
    return np.sort(order[:size]).astype(np.int32)


class GeneratedData:
    """Rows of :mod:`specjax.train.selfgen` shards: training batches drawn from (seed, step), held-out tail."""

    def __init__(self, data_dir: Path, *, eval_rows: int):
        from specjax.train.selfgen import load_shards

        self.shards = load_shards(data_dir)
        self.rows_per_shard = self.shards["hidden"][0].shape[0]
        n = len(self.shards["length"])
        if not 0 < eval_rows < n:
            raise ValueError(f"eval_rows must be in [1, {n - 1}] ({n} generated rows), got {eval_rows}")
        self.train_rows, self.eval_rows = np.arange(n - eval_rows), np.arange(n - eval_rows, n)
        self.aux_layer_ids = tuple(json.loads((data_dir / "meta.json").read_text())["aux_layer_ids"])

    def mask(self, rows: np.ndarray) -> np.ndarray:
        """[R, S] bool: generated positions (the prompt is context only; nothing past the row's length)."""
        s = self.shards["tokens"].shape[1]
        pos = np.arange(s)[None, :]
        return (pos >= self.shards["prompt_len"][rows, None]) & (pos < self.shards["length"][rows, None])

    def token_counts(self, vocab_size: int) -> np.ndarray:
        rows = self.train_rows
        return np.bincount(self.shards["tokens"][rows][self.mask(rows)], minlength=vocab_size)[:vocab_size]

    def num_tokens(self, rows: np.ndarray) -> int:
        return int(self.mask(rows).sum())

    def batch(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        pick = lambda name: np.stack([self.shards[name][r // self.rows_per_shard][r % self.rows_per_shard]
                                      for r in rows])  # noqa: E731
        return {"tokens": self.shards["tokens"][rows], "hidden": pick("hidden"), "aux": pick("aux"),
                "top1": self.shards["top1"][rows], "mask": self.mask(rows)}

    def train_batch(self, cfg: TrainConfig, step: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng((cfg.seed, step))
        return self.batch(np.sort(rng.choice(self.train_rows, size=cfg.batch_size, replace=False)))

    def eval_batches(self, batch_size: int) -> list[dict[str, np.ndarray]]:
        return [self.batch(self.eval_rows[i:i + batch_size]) for i in range(0, len(self.eval_rows), batch_size)]


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
    layout: str = "specjax"
    draft_vocab_size: Optional[int] = None
    aux_layer_ids: Optional[tuple[int, ...]] = None
    """EAGLE-3: fused target layers (None: HeadConfig.for_target's low/mid/high)."""

    def __post_init__(self) -> None:
        if self.method not in HEAD_METHODS:
            raise ValueError(f"method must be one of {list(HEAD_METHODS)}, got {self.method!r}")
        check_positive_ints(self, ("ttt_depth", "num_medusa_heads", "eval_every", "eval_batches"))
        if self.layout not in HEAD_LAYOUTS:
            raise ValueError(f"layout must be one of {list(HEAD_LAYOUTS)}, got {self.layout!r}")

    @property
    def depth(self) -> int:
        return self.ttt_depth if self.method == "eagle3" else 1

    def head_config(self, target: LlamaConfig) -> HeadConfig:
        kw: dict[str, Any] = {"layout": self.layout, "draft_vocab_size": self.draft_vocab_size}
        if self.method == "medusa":
            kw["num_medusa_heads"] = self.num_medusa_heads
        if self.aux_layer_ids is not None:
            kw["aux_layer_ids"] = tuple(self.aux_layer_ids)
        config = HeadConfig.for_target(self.method, target, **kw)
        config.check_target(target)
        return config


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


def initial_params(config: HeadConfig, target_params, target_config: LlamaConfig, seed: int,
                   d2t: Optional[np.ndarray]) -> dict:
    """Random head params; a draft vocabulary gets ``d2t`` and starts from the target's LM head rows for it."""
    params = init_head_params(config, jax.random.key(seed))
    if d2t is None:
        return params
    d2t = jnp.asarray(d2t, jnp.int32)
    params["d2t"] = d2t
    if target_config.tie_word_embeddings:
        rows = jnp.take(target_params["embed_tokens"]["embedding"], d2t, axis=0).T  # [D, Vd]
    else:
        rows = jnp.take(target_params["lm_head"]["kernel"], d2t, axis=1)  # [D, Vd]
    rows = rows.astype(jnp.float32)
    if config.method == "medusa":
        for i in range(config.num_medusa_heads):
            params[f"lm_heads_{i}"] = {"kernel": rows}
    else:
        params["lm_head"] = {"kernel": rows}
    return params


def train_head(target: tuple[LlamaConfig, Any], hcfg: HeadTrainConfig, cfg: TrainConfig, train, heldout,
               work: Path, *, progress: bool = True, stop_after: int | None = None,
               d2t: Optional[np.ndarray] = None):
    """Train a head for ``target`` in ``work`` (resuming its orbax checkpoint); returns (HeadConfig, params, stats).

    ``train`` / ``heldout``: token streams (stdlib mode), or ``train`` a :class:`GeneratedData` (then
    ``heldout`` is ignored: its held-out rows are used). ``d2t``: the draft vocabulary (absolute target
    ids) when ``hcfg.draft_vocab_size`` is set. ``stop_after``: leave after this many steps of the schedule
    (checkpointed), as an interruption would; ``cfg.stop_at_step`` likewise cuts at an absolute step.
    """
    import optax
    from tqdm import tqdm

    t_config, t_params = target
    config = hcfg.head_config(t_config)
    if (d2t is None) != (config.draft_vocab_size is None) or (d2t is not None and len(d2t) != config.draft_vocab_size):
        raise ValueError(f"d2t must hold draft_vocab_size={config.draft_vocab_size} ids, got "
                         f"{None if d2t is None else len(d2t)}")
    generated = isinstance(train, GeneratedData)
    if generated and config.method == "eagle3" and tuple(train.aux_layer_ids) != config.aux_layer_ids:
        raise ValueError(f"aux_layer_ids {config.aux_layer_ids} differ from the generated data's "
                         f"{tuple(train.aux_layer_ids)}")
    tx, _ = make_optimizer(cfg)
    trainable, buffers = split_trainable(initial_params(config, t_params, t_config, cfg.seed, d2t))
    mngr = _manager(work)
    state, start = restore_state(mngr, {"params": trainable, "opt_state": tx.init(trainable)})
    trainable, opt_state = state["params"], state["opt_state"]
    loss_kw = dict(config=config, target_config=t_config, depth=hcfg.depth, buffers=buffers)

    # The target's params are an argument, not a closure: as constants XLA would fold them into the program.
    @jax.jit
    def step_fn(trainable, opt_state, batch, t_params):
        (loss, m), grads = jax.value_and_grad(head_losses, has_aux=True)(trainable, t_params, batch, **loss_kw)
        updates, opt_state = tx.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, {"loss": loss, **m}

    eval_fn = jax.jit(lambda p, b, t_params: head_losses(p, t_params, b, **loss_kw))

    def to_device(batch):
        return {k: jnp.asarray(v) for k, v in batch.items()}

    def next_batch(step):
        return train.train_batch(cfg, step) if generated else {"tokens": get_batch(train, cfg, step)}

    eval_set = (train.eval_batches(cfg.batch_size)[: hcfg.eval_batches] if generated else
                [{"tokens": get_batch(heldout, cfg, 10**6 + i)} for i in range(hcfg.eval_batches)])

    def evaluate(trainable) -> dict:
        ms = [eval_fn(trainable, to_device(b), t_params)[1] for b in eval_set]
        return {k: round(float(np.mean([m[k] for m in ms])), 4) for k in ms[0]}

    end = min(cfg.steps, cfg.stop_at_step) if cfg.stop_at_step else cfg.steps
    end = end if stop_after is None else min(end, start + stop_after)
    t0, history = time.time(), []
    bar = tqdm(range(start, end), initial=start, total=cfg.steps, desc=f"train-head {hcfg.method}",
               disable=not progress)
    m = {}
    for step in bar:
        trainable, opt_state, m = step_fn(trainable, opt_state, to_device(next_batch(step)), t_params)
        done = step + 1
        if done % cfg.log_every == 0:
            bar.set_postfix({k: f"{float(v):.3f}" for k, v in m.items()})
            if not progress:
                logger.info("step %d %s", done, {k: round(float(v), 4) for k, v in m.items()})
        if done % hcfg.eval_every == 0 or done == cfg.steps:
            ev = evaluate(trainable)
            history.append({"step": done, **ev})
            logger.info("step %d held-out %s", done, ev)
        if done % cfg.ckpt_every == 0 or done == end:
            save_state(mngr, done, {"params": trainable, "opt_state": opt_state})
    stats = {"method": hcfg.method, "steps_done": end, "steps_planned": cfg.steps,
             "wall_s_this_run": round(time.time() - t0, 1), "eval": history,
             "final_train": {k: float(v) for k, v in m.items()}}
    return config, {**trainable, **buffers}, stats


# --------------------------------------------------------------------------- CLI


def add_args(p: argparse.ArgumentParser) -> None:
    """``specjax train-head`` flags (specjax/cli.py mounts them; ``python -m specjax.train.heads`` too)."""
    p.add_argument("--method", required=True, choices=list(HEAD_METHODS))
    p.add_argument("--target", default="builtin:target", help="target model (its tokenizer reads the corpus)")
    p.add_argument("--work", required=True, help="orbax checkpoint directory (rerunning the same command resumes)")
    p.add_argument("--export", help="write the head directory here when done (a speculative_config model)")
    p.add_argument("--layout", default="specjax", choices=list(HEAD_LAYOUTS),
                   help="fusion-layer wiring: specjax's, or EAGLE-1 / EAGLE-3 as their authors publish them")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="own LM head over the N most frequent target tokens of the training corpus (d2t)")
    p.add_argument("--aux-layers", default=None, help="eagle3: comma-separated fused target layers")
    p.add_argument("--corpus", default="stdlib", choices=["stdlib", "generated"],
                   help="stdlib source windows, or text the target generates for varied prompts")
    p.add_argument("--data", default=None, help="generated corpus directory (default WORK/data)")
    p.add_argument("--gen-rows", type=int, default=960, help="generated corpus: rows (prompt + continuation)")
    p.add_argument("--gen-batch-size", type=int, default=48)
    p.add_argument("--gen-max-prompt-tokens", type=int, default=96)
    p.add_argument("--gen-max-new-tokens", type=int, default=256)
    p.add_argument("--eval-rows", type=int, default=48, help="generated corpus: held-out rows (the last ones)")
    p.add_argument("--ttt-depth", type=int, default=3, help="eagle3: training-time-test steps")
    p.add_argument("--num-medusa-heads", type=int, default=4)
    p.add_argument("--eval-every", type=int, default=100, help="held-out agreement every N steps")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--stop-at-step", type=int, default=0, help="> 0: stop after this step (a reproducible cut)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128, help="stdlib corpus: window length")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--ckpt-every", type=int, default=100)


def run(args: argparse.Namespace) -> int:
    """``specjax train-head`` (flags: :func:`add_args`; older parsers without the new flags get the defaults)."""
    from models.loading import load_hf_model, read_generation_eos
    from specjax.builtin import resolve_model
    from specjax.train.lm import load_streams

    opt = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    target_dir = resolve_model(args.target)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                      warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, seed=args.seed,
                      log_every=args.log_every, ckpt_every=args.ckpt_every, stop_at_step=opt("stop_at_step", 0))
    aux = opt("aux_layers")
    hcfg = HeadTrainConfig(method=args.method, ttt_depth=args.ttt_depth, num_medusa_heads=args.num_medusa_heads,
                           eval_every=args.eval_every, layout=opt("layout", "specjax"),
                           draft_vocab_size=opt("draft_vocab_size"),
                           aux_layer_ids=None if aux is None else tuple(int(i) for i in aux.split(",")))
    target = load_hf_model(target_dir, "float32")  # a bad --target fails here, naming the path
    head_config = hcfg.head_config(target[0])  # bad head settings fail before any data work
    work = Path(args.work)
    if opt("corpus", "stdlib") == "generated":
        from specjax.train import selfgen

        data_dir = Path(opt("data") or work / "data")
        gen = selfgen.GenConfig(num_rows=opt("gen_rows", 960), batch_size=opt("gen_batch_size", 48),
                                max_prompt_tokens=opt("gen_max_prompt_tokens", 96),
                                max_new_tokens=opt("gen_max_new_tokens", 256), seed=args.seed)
        feats = head_config.aux_layer_ids if args.method == "eagle3" else ()
        selfgen.generate_corpus(target, target_dir, data_dir, gen, aux_layer_ids=feats,
                                eos_ids=read_generation_eos(target_dir, target[0]),
                                prompts=selfgen.build_prompts()[0], progress=not args.no_progress)
        train, heldout = GeneratedData(data_dir, eval_rows=opt("eval_rows", 48)), None
        counts = train.token_counts(target[0].vocab_size)
        corpus_tokens = {"train": train.num_tokens(train.train_rows), "held_out": train.num_tokens(train.eval_rows)}
    else:
        if not (Path(target_dir) / "tokenizer.json").is_file():
            raise ValueError(f"--target {target_dir!r} has no tokenizer.json (train-head reads the corpus with it)")
        train, heldout, _ = load_streams(target_dir)
        counts = np.bincount(train, minlength=target[0].vocab_size)[: target[0].vocab_size]
        corpus_tokens = {"train": int(len(train)), "held_out": int(len(heldout))}
    d2t = None
    if hcfg.draft_vocab_size is not None:
        d2t = draft_vocab(counts, hcfg.draft_vocab_size)
        logger.info("draft vocabulary: %d ids cover %.2f%% of the training corpus tokens", len(d2t),
                    100.0 * counts[d2t].sum() / max(counts.sum(), 1))
    c0 = time.process_time()
    config, params, stats = train_head(target, hcfg, cfg, train, heldout, work, progress=not args.no_progress,
                                       d2t=d2t)
    stats.update(train_config=dataclasses.asdict(cfg), head=dataclasses.asdict(hcfg), corpus_tokens=corpus_tokens,
                 process_cpu_s=round(time.process_time() - c0, 1))
    if d2t is not None:
        stats["draft_vocab_coverage"] = round(float(counts[d2t].sum() / max(counts.sum(), 1)), 4)
    work.mkdir(parents=True, exist_ok=True)
    (work / "train_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    logger.info("done: %s", json.dumps({k: stats[k] for k in ("steps_done", "wall_s_this_run", "process_cpu_s")}))
    if args.export:
        save_head(args.export, config, params)
        logger.info("exported %s head to %s", args.method, args.export)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specjax.train.heads", description=__doc__.splitlines()[0])
    add_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every save step at INFO
    try:
        return run(args)
    except ValueError as exc:
        print(f"specjax train-head: error: {exc}")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
