"""The jnp / XLA rejection samplers: the per-row reference and the batched XLA paths.

:func:`rejection_sample_reference` runs :func:`_verify_row` (the whole
vocabulary row at once) under ``vmap``; :func:`standard_verify_xla` is the
batched token-wise path with the same arithmetic (what CPU runs);
:func:`greedy_verify_reference` is the all-greedy fast path. All randomness
(acceptance uniforms, Exp(1) noise) is drawn by the caller and passed in.
The Pallas kernel (:mod:`pallas_kernels.rejection`) is a separate, V-tiled
implementation of the same maths, tested against these and against numpy.

Top-k / top-p need a sort: when they are active the logits are shaped with
:func:`pallas_kernels.sampling_ops.transform_logits` (temperature -> top-k ->
top-p) first, and the rows then see temperature 1.

Layout: every per-row vector is a column (positions on the sublane axis),
``[K+1, 1]``, so it broadcasts against the ``[K+1, V]`` logits row.

Letters: b rows, k draft positions (K+1 target positions), v vocabulary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.sampling_ops import apply_temperature, argmax_last, sample_with_exponentials, transform_logits

METHODS = ("standard", "synthetic", "block")

# Exp(1) noise from jax.random.exponential is exactly 0 with probability 2**-23 per
# element (-log1p(-u) at u == 0). In the race p(x) / E_x that makes a score of
# inf (or nan when p(x) == 0, and argmax picks nan), i.e. an arbitrary, possibly
# masked, token. 0 stands for E in [0, ~2**-23), so clamp it to that interval's middle.
MIN_EXPONENTIAL = 2.0**-24

_F32_MAX = float(jnp.finfo(jnp.float32).max)
_BIG_POS = 1 << 30  # larger than any position index


# ----------------------------------------------------------------------------
# Per-row math of the reference.
# ----------------------------------------------------------------------------


def _masked_row_sum(mask: jax.Array, x: jax.Array) -> jax.Array:
    """Sum over the position axis of ``x`` where ``mask``: selects one row of ``x`` without a gather."""
    return jnp.sum(jnp.where(mask, x, jnp.zeros_like(x)), axis=0, keepdims=True)


def _verify_row(
    draft,  # int32 [K+1, 1]; entry K (and entries >= n) are padding
    num_draft,  # int32 [1, 1]
    logits,  # float [K+1, V], NaN-free (see _prepare)
    draft_probs,  # float32 [K, V] or None (None: q is one-hot on the draft token)
    temperature,  # float32 [1, 1]; <= 0 means greedy
    uniforms,  # float32 [K+1, 1]; standard/synthetic: u_i at position i; block: eta_i at position i >= 1
    exponentials,  # float32 [1, V], > 0
    rates,  # float32 [K+1, 1] conditional synthetic rates (0 at K) or None
    *,
    method: str,
):
    """Verify one row. Returns (output ids int32 [K+1, 1], number of accepted drafts int32 [1, 1])."""
    num_pos, vocab = logits.shape
    pos = jax.lax.broadcasted_iota(jnp.int32, (num_pos, 1), 0)  # [K+1, 1]
    vocab_iota = jax.lax.broadcasted_iota(jnp.int32, (num_pos, vocab), 1)  # [K+1, V]
    n = num_draft
    is_greedy = temperature <= 0.0  # [1, 1]
    valid = pos < n  # [K+1, 1] positions holding a draft to verify

    x = logits.astype(jnp.float32)  # [K+1, V]
    greedy_ids = argmax_last(x)[:, None]  # [K+1, 1], raw logits

    # Target probabilities p at every position; a fully masked position gets p = 0
    # (so nothing there is accepted and the draw falls back to token 0, in range).
    s = jnp.minimum(apply_temperature(x, temperature.reshape(1)), _F32_MAX)  # [K+1, V]
    m = jnp.max(s, axis=1, keepdims=True)  # [K+1, 1]
    e = jnp.exp(s - jnp.where(m > -jnp.inf, m, 0.0))  # [K+1, V]
    z = jnp.sum(e, axis=1, keepdims=True)  # [K+1, 1]
    p = e / jnp.where(z > 0, z, 1.0)  # [K+1, V]

    draft_onehot = vocab_iota == draft  # [K+1, V]; row K and padding -1 match nothing
    if draft_probs is None:
        q = draft_onehot.astype(jnp.float32)  # [K+1, V]
    else:
        q = jnp.concatenate([draft_probs.astype(jnp.float32), jnp.zeros((1, vocab), jnp.float32)], axis=0)
        q = jnp.where(q > 0, q, 0.0)  # also maps NaN to 0
    p_draft = jnp.sum(jnp.where(draft_onehot, p, 0.0), axis=1, keepdims=True)  # [K+1, 1] p_i(x_{i+1})
    q_draft = jnp.sum(jnp.where(draft_onehot, q, 0.0), axis=1, keepdims=True)  # [K+1, 1] q_i(x_{i+1})

    # Greedy acceptance: the draft equals the target argmax.
    accept_greedy = draft == greedy_ids  # [K+1, 1]

    if method == "block":
        # Block verification (Sun et al., ICLR 2025). P_i in position space, P_0 = 1.
        def body(i, carry):
            p_prev, p_vec = carry  # [1, 1], [K+1, 1]
            at = pos == i - 1
            pd = _masked_row_sum(at, p_draft)  # [1, 1]
            qd = _masked_row_sum(at, q_draft)  # [1, 1]
            # q(x) == 0 cannot occur for a draft sampled from q; treat it as "cannot accept"
            # like the token-wise rule (also avoids 0 * inf).
            new = jnp.where(qd > 0, jnp.minimum(1.0, (p_prev * pd) / jnp.where(qd > 0, qd, 1.0)), 0.0)
            return new, jnp.where(pos == i, new, p_vec)

        p_init = jnp.ones((1, 1), jnp.float32)
        _, big_p = jax.lax.fori_loop(1, num_pos, body, (p_init, jnp.where(pos == 0, 1.0, 0.0)))  # [K+1, 1]
        residual = jnp.maximum(big_p * p - q, 0.0)  # [K+1, V]
        z_res = jnp.sum(residual, axis=1, keepdims=True)  # [K+1, 1]
        denom = z_res + (1.0 - big_p)
        weight = jnp.where(denom > 0, z_res / jnp.where(denom > 0, denom, 1.0), 1.0)  # h_i, i < g
        h = jnp.where(pos < n, weight, big_p)  # [K+1, 1]; h_g = P_g
        # tau = the LARGEST i in 1..g with eta_i < h_i (strict: eta is on a grid in [0, 1),
        # and h = 0 must never accept). Earlier failures do not stop the scan.
        hit = (pos >= 1) & (pos <= n) & (uniforms < h)
        tau = jnp.max(jnp.where(hit, pos, 0), axis=0, keepdims=True)  # [1, 1]
        first_fail_greedy = jnp.min(jnp.where(accept_greedy & valid, _BIG_POS, pos), axis=0, keepdims=True)
        num_acc = jnp.where(is_greedy, first_fail_greedy, tau)  # [1, 1]
        at = pos == num_acc
        p_a = _masked_row_sum(at, p)  # [1, V]
        q_a = _masked_row_sum(at, q)  # [1, V]
        scale = _masked_row_sum(at, big_p)  # [1, 1] P_tau
        r = jnp.where(num_acc < n, jnp.maximum(scale * p_a - q_a, 0.0), p_a)  # [1, V]
    else:
        if method == "synthetic":
            accept = uniforms < rates  # [K+1, 1], any row kind
        else:
            # Accept x iff q(x) > 0 and u q(x) < p(x): p(x) == 0 is never accepted.
            accept_random = (q_draft > 0) & (uniforms * q_draft < p_draft)
            accept = jnp.where(is_greedy, accept_greedy, accept_random)
        # First position that is not an accepted draft; lies in [0, n].
        num_acc = jnp.min(jnp.where(accept & valid, _BIG_POS, pos), axis=0, keepdims=True)  # [1, 1]
        at = pos == num_acc
        p_a = _masked_row_sum(at, p)  # [1, V]
        q_a = _masked_row_sum(at, q)  # [1, V]
        r = jnp.where(num_acc < n, jnp.maximum(p_a - q_a, 0.0), p_a)  # [1, V] recovered or bonus
    # A residual with no mass (p <= q to rounding) falls back to p itself.
    r = jnp.where(jnp.sum(r, axis=1, keepdims=True) > 0, r, p_a)
    sampled = sample_with_exponentials(r, exponentials, logits=False).reshape(1, 1)  # [1, 1]
    greedy_tok = _masked_row_sum(at, greedy_ids)  # [1, 1]
    token = jnp.where(is_greedy, greedy_tok, sampled)
    out = jnp.where(pos < num_acc, draft, jnp.where(pos == num_acc, token, -1)).astype(jnp.int32)
    return out, num_acc.astype(jnp.int32)


# ----------------------------------------------------------------------------
# Input preparation (plain jnp).
# ----------------------------------------------------------------------------


def _check_shapes(draft_token_ids, num_draft_tokens, target_logits, draft_probs, temperature,
                  top_k, top_p, uniforms, exponentials, conditional_rates, method):
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if draft_token_ids.ndim != 2:
        raise ValueError(f"draft_token_ids must be [B, K], got shape {draft_token_ids.shape}")
    b, k = draft_token_ids.shape
    if target_logits.ndim != 3 or target_logits.shape[:2] != (b, k + 1):
        raise ValueError(f"target_logits must be [B, K+1, V] = [{b}, {k + 1}, V], got {target_logits.shape}")
    v = target_logits.shape[2]
    if draft_probs is not None and draft_probs.shape != (b, k, v):
        raise ValueError(f"draft_probs must be [B, K, V] = {(b, k, v)}, got {draft_probs.shape}")
    for name, arr, shape in (("num_draft_tokens", num_draft_tokens, (b,)), ("temperature", temperature, (b,)),
                             ("top_k", top_k, (b,)), ("top_p", top_p, (b,)), ("uniforms", uniforms, (b, k)),
                             ("exponentials", exponentials, (b, v))):
        if arr is not None and arr.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {arr.shape}")
    if method == "synthetic" and (conditional_rates is None or conditional_rates.shape != (k,)):
        raise ValueError("method='synthetic' needs conditional_rates of shape [K]")


def _prepare(draft_token_ids, num_draft_tokens, target_logits, temperature, top_k, top_p,
             uniforms, exponentials, conditional_rates, method):
    """Column-shape the per-row inputs and apply the sort-based transforms, if any, in jnp."""
    b, k = draft_token_ids.shape
    temperature = temperature.astype(jnp.float32)
    logits = target_logits
    if jnp.issubdtype(logits.dtype, jnp.floating):
        # NaN would win argmax and poison the softmax; treat it as "impossible".
        logits = jnp.where(jnp.isnan(logits), jnp.asarray(-jnp.inf, logits.dtype), logits)
    if top_k is not None or top_p is not None:
        random_row = (temperature > 0)[:, None, None]
        shaped = transform_logits(logits, temperature, top_k, top_p)  # [B, K+1, V] f32
        logits = jnp.where(random_row, shaped, logits.astype(jnp.float32))  # greedy rows keep raw logits
        temperature = jnp.where(temperature > 0, 1.0, 0.0).astype(jnp.float32)  # already applied
    draft = jnp.concatenate([draft_token_ids.astype(jnp.int32), jnp.full((b, 1), -1, jnp.int32)], axis=1)
    pad = jnp.ones((b, 1), jnp.float32)
    u = uniforms.astype(jnp.float32)
    # Block's eta_i belongs to position i >= 1; the token-wise u_i to position i < K.
    u = jnp.concatenate([pad, u] if method == "block" else [u, pad], axis=1)
    rates = None
    if method == "synthetic":
        rates = jnp.concatenate([conditional_rates.astype(jnp.float32), jnp.zeros((1,), jnp.float32)])[:, None]
    exps = jnp.maximum(exponentials.astype(jnp.float32), MIN_EXPONENTIAL)
    return (
        draft[:, :, None],  # [B, K+1, 1]
        num_draft_tokens.astype(jnp.int32).reshape(b, 1, 1),  # [B, 1, 1]
        logits,  # [B, K+1, V]
        temperature.reshape(b, 1, 1),  # [B, 1, 1]
        u[:, :, None],  # [B, K+1, 1]
        exps[:, None, :],  # [B, 1, V]
        rates,  # [K+1, 1] or None
    )


def greedy_verify_reference(
    draft_token_ids: jax.Array,  # int32 [B, K]
    num_draft_tokens: jax.Array,  # int32 [B]
    target_logits: jax.Array,  # float [B, K+1, V]
) -> tuple[jax.Array, jax.Array]:
    """All-greedy fast path: one argmax pass, same outputs as the full path for greedy rows."""
    b, k = draft_token_ids.shape
    logits = jnp.where(jnp.isnan(target_logits), jnp.asarray(-jnp.inf, target_logits.dtype), target_logits)
    greedy = argmax_last(logits)  # [B, K+1]
    pos = jnp.arange(k + 1, dtype=jnp.int32)[None, :]  # [1, K+1]
    draft = jnp.concatenate([draft_token_ids.astype(jnp.int32), jnp.full((b, 1), -1, jnp.int32)], axis=1)
    ok = (draft == greedy) & (pos < num_draft_tokens[:, None])
    num_acc = jnp.min(jnp.where(ok, k + 1, pos), axis=1)  # [B] first position not accepted
    out = jnp.where(pos <= num_acc[:, None], greedy, -1)  # accepted drafts equal the argmax
    return out, num_acc


@functools.partial(jax.jit, static_argnames=("method",))
def rejection_sample_reference(
    draft_token_ids: jax.Array,  # int32 [B, K]
    num_draft_tokens: jax.Array,  # int32 [B]
    target_logits: jax.Array,  # float [B, K+1, V]
    draft_probs: jax.Array | None,  # float [B, K, V] or None
    temperature: jax.Array,  # float [B]
    top_k: jax.Array | None,  # int32 [B] or None
    top_p: jax.Array | None,  # float [B] or None
    uniforms: jax.Array,  # float32 [B, K]
    exponentials: jax.Array,  # float32 [B, V]
    conditional_rates: jax.Array | None = None,  # float32 [K]
    *,
    method: str = "standard",
) -> tuple[jax.Array, jax.Array]:
    """Pure-jnp reference of :func:`pallas_kernels.rejection.rejection_sample_kernel` (same arguments, minus the
    kernel's tuning knobs): every row verified by :func:`_verify_row` over its whole vocabulary row."""
    _check_shapes(draft_token_ids, num_draft_tokens, target_logits, draft_probs, temperature, top_k, top_p,
                  uniforms, exponentials, conditional_rates, method)
    draft, n, logits, temp, u, exps, rates = _prepare(
        draft_token_ids, num_draft_tokens, target_logits, temperature, top_k, top_p, uniforms, exponentials,
        conditional_rates, method)
    row = functools.partial(_verify_row, method=method)
    in_axes = (0, 0, 0, None if draft_probs is None else 0, 0, 0, 0, None)
    out, num = jax.vmap(row, in_axes=in_axes)(draft, n, logits, draft_probs, temp, u, exps, rates)
    return out[:, :, 0], num[:, 0, 0]


# ----------------------------------------------------------------------------
# Batched XLA path for method="standard": what the engine runs off-TPU.
# ----------------------------------------------------------------------------


def _take_position(x: jax.Array, index: jax.Array) -> jax.Array:
    """Row ``index[b]`` of ``x [B, K+1, ...]`` along the position axis: ``[B, 1, ...]``."""
    idx = index.reshape((x.shape[0], 1) + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, jnp.broadcast_to(idx, (x.shape[0], 1) + x.shape[2:]), axis=1)


@jax.jit
def standard_verify_xla(
    draft_token_ids: jax.Array,  # int32 [B, K]
    num_draft_tokens: jax.Array,  # int32 [B]
    target_logits: jax.Array,  # float [B, K+1, V]
    draft_probs: jax.Array | None,  # float [B, K, V] or None
    temperature: jax.Array,  # float [B]
    top_k: jax.Array | None,  # int32 [B] or None
    top_p: jax.Array | None,  # float [B] or None
    uniforms: jax.Array,  # float32 [B, K]
    exponentials: jax.Array,  # float32 [B, V]
) -> tuple[jax.Array, jax.Array]:
    """Token-wise verification with the same arithmetic as :func:`rejection_sample_reference`, batched.

    The per-row reference materializes p, q, one-hot masks and residuals for all
    K+1 positions (about a dozen passes over [B, K+1, V]); acceptance only needs
    p and q at the draft tokens, and the residual only at the first rejected
    position. This path gathers those instead: two passes for the softmax
    normalizers, two for the greedy argmax, then [B, V] work for one row.
    Each selected value is computed by the same float ops as the reference's, so
    outputs match it exactly (tested).
    """
    draft, n, logits, temp, u, exps, _ = _prepare(
        draft_token_ids, num_draft_tokens, target_logits, temperature, top_k, top_p, uniforms, exponentials,
        None, "standard")
    b, kp1, vocab = logits.shape
    pos = jnp.arange(kp1, dtype=jnp.int32)[None, :, None]  # [1, K+1, 1]
    is_greedy = temp <= 0.0  # [B, 1, 1]
    x = logits.astype(jnp.float32)  # [B, K+1, V]
    greedy_ids = argmax_last(x)[..., None]  # [B, K+1, 1]
    s = jnp.minimum(apply_temperature(x, temp.reshape(b)), _F32_MAX)  # [B, K+1, V]
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(m > -jnp.inf, m, 0.0)  # [B, K+1, 1]
    z = jnp.sum(jnp.exp(s - m), axis=-1, keepdims=True)
    z = jnp.where(z > 0, z, 1.0)  # [B, K+1, 1]
    has_draft = (draft >= 0) & (draft < vocab)  # [B, K+1, 1]; position K and padding hold -1
    safe_draft = jnp.clip(draft, 0, vocab - 1)
    p_draft = jnp.where(has_draft, jnp.exp(jnp.take_along_axis(s, safe_draft, axis=-1) - m) / z, 0.0)
    if draft_probs is None:
        q_draft = has_draft.astype(jnp.float32)
    else:
        q_all = jnp.concatenate([draft_probs.astype(jnp.float32), jnp.zeros((b, 1, vocab), jnp.float32)], axis=1)
        q_all = jnp.where(q_all > 0, q_all, 0.0)  # [B, K+1, V]; also maps NaN to 0
        q_draft = jnp.where(has_draft, jnp.take_along_axis(q_all, safe_draft, axis=-1), 0.0)
    accept = jnp.where(is_greedy, draft == greedy_ids, (q_draft > 0) & (u * q_draft < p_draft))
    num_acc = jnp.min(jnp.where(accept & (pos < n), _BIG_POS, pos), axis=1, keepdims=True)  # [B, 1, 1]
    p_a = jnp.exp(_take_position(s, num_acc) - _take_position(m, num_acc)) / _take_position(z, num_acc)  # [B, 1, V]
    if draft_probs is None:
        vocab_iota = jax.lax.broadcasted_iota(jnp.int32, (b, 1, vocab), 2)
        q_a = (vocab_iota == _take_position(draft, num_acc)).astype(jnp.float32)  # [B, 1, V]
    else:
        q_a = _take_position(q_all, num_acc)  # [B, 1, V]
    r = jnp.where(num_acc < n, jnp.maximum(p_a - q_a, 0.0), p_a)
    r = jnp.where(jnp.sum(r, axis=-1, keepdims=True) > 0, r, p_a)
    sampled = sample_with_exponentials(r, exps, logits=False)[..., None]  # [B, 1, 1]
    token = jnp.where(is_greedy, _take_position(greedy_ids, num_acc), sampled)
    out = jnp.where(pos < num_acc, draft, jnp.where(pos == num_acc, token, -1)).astype(jnp.int32)
    return out[:, :, 0], num_acc[:, 0, 0].astype(jnp.int32)
