"""Lossless rejection sampling for speculative decoding: the public front end.

``rejection_sample`` verifies K draft tokens per row against the target's K+1
logits rows and returns the committed tokens, left-aligned, ``-1`` after them.

Methods
  standard   token-wise speculative sampling (Leviathan et al. 2023; Chen et al. 2023):
             accept x_i iff q(x_i) > 0 and u q(x_i) < p(x_i); on the first rejection
             draw from normalize(max(p - q, 0)) (p if that has no mass); all
             accepted: draw the bonus from p at position n.
  block      block verification (Sun et al., "Block Verification Accelerates
             Speculative Decoding", ICLR 2025): the draft block is verified
             jointly; lossless, and never accepts fewer tokens in expectation.
  synthetic  benchmarking without a real draft: accept position i iff u < c_i,
             with c_i the conditional rates of the given unconditional rates.

Greedy rows (temperature 0) are verified by target argmax on the raw logits in
every method (block verification reduces to exactly this at temperature 0), and
ignore top_k / top_p.

Randomness: each row has its own key (``fold_in(key, row)`` for a single key,
or the given ``[B]`` keys). The row key is split once into
``(k_accept, k_sample)``: ``uniform(k_accept, [K])`` are the acceptance draws
(u_i, or block's eta_{i+1}) and ``row_exponentials(k_sample, [V])`` the Exp(1)
noise of the row's single categorical draw (recovered or bonus token; one draw
per row suffices because only one is ever made). A row's output depends only on
its own key and inputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.rejection import (
    METHODS,
    greedy_verify_reference,
    rejection_sample_kernel,
    rejection_sample_reference,
    standard_verify_xla,
)
from specjax.sample import prng
from specjax.sample.transforms import row_exponentials

__all__ = [
    "rejection_sample",
    "rejection_sample_with_counts",
    "rejection_sample_jit",
    "row_keys",
    "draw_rejection_noise",
    "conditional_acceptance_rates",
    "default_use_kernel",
]


def default_use_kernel() -> bool:
    """Pallas kernel where :mod:`specjax.backends` says it is the fast path; the jnp path elsewhere."""
    from specjax.backends import use_pallas_sampler

    return use_pallas_sampler()


def row_keys(key, batch: int) -> jax.Array:
    """Typed PRNG keys ``[B]``: a single key (typed ``[]`` or raw uint32 ``[2]``) gives
    ``fold_in(key, row)``; per-row keys (typed ``[B]`` or raw uint32 ``[B, 2]``) pass through."""
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.dtype != jnp.uint32 or key.ndim not in (1, 2):
            raise ValueError(f"key must be a PRNG key, [B] keys, or raw uint32 [2] / [B, 2]; got "
                             f"{key.dtype} {key.shape}")
        key = jax.random.wrap_key_data(key)
    if key.ndim == 0:
        return prng.fold_in(key, jnp.arange(batch, dtype=jnp.uint32))
    if key.shape != (batch,):
        raise ValueError(f"key: per-row keys must have batch size {batch}, got shape {key.shape}")
    return key


def draw_rejection_noise(keys: jax.Array, num_positions: int, vocab: int,
                         need_exponentials: jax.Array | bool = True) -> tuple[jax.Array, jax.Array]:
    """Acceptance uniforms ``[B, K]`` and Exp(1) noise ``[B, V]`` from per-row keys ``[B]``.

    ``need_exponentials`` (traced bool ok) skips the ``[B, V]`` draw when no row samples
    (all greedy); the values of sampling rows never depend on it.
    """
    k_accept, k_sample = prng.split2(keys)  # [B] each
    uniforms = prng.uniform(k_accept, (num_positions,))  # [B, K]
    shape = (keys.shape[0], vocab)
    exps = jax.lax.cond(
        jnp.asarray(need_exponentials),
        lambda: row_exponentials(k_sample, (vocab,)),
        lambda: jnp.ones(shape, jnp.float32),
    )  # [B, V]
    return uniforms, exps


def conditional_acceptance_rates(rates) -> np.ndarray:
    """Unconditional rates a_i = P(accept >= i) -> conditional c_1 = a_1, c_i = a_i / a_{i-1} (0 if a_{i-1} = 0)."""
    a = np.asarray(rates, np.float64)
    prev = np.concatenate([[1.0], a[:-1]])
    c = np.divide(a, prev, out=np.zeros_like(a), where=prev > 0)
    return np.clip(c, 0.0, 1.0).astype(np.float32)


@functools.partial(jax.jit, static_argnames=("method", "use_kernel", "interpret", "kernel_platform"))
def rejection_sample_jit(
    draft_token_ids: jax.Array,  # int32 [B, K]
    num_draft_tokens: jax.Array,  # int32 [B]
    target_logits: jax.Array,  # float [B, K+1, V]
    draft_probs: jax.Array | None,  # float [B, K, V] or None
    temperature: jax.Array,  # float [B]; <= 0 = greedy
    top_k: jax.Array | None,  # int32 [B] or None
    top_p: jax.Array | None,  # float [B] or None
    keys: jax.Array,  # typed PRNG keys [B] (e.g. transforms.request_keys)
    conditional_rates: jax.Array | None = None,  # float32 [K], method="synthetic"
    *,
    method: str = "standard",
    use_kernel: bool = False,
    interpret: bool = False,
    kernel_platform: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Jit-friendly core for use inside an engine step: no value validation, arrays only.

    Returns (output ids int32 [B, K+1], accepted draft count int32 [B]). Row keys
    must already be per row; synthetic rates already conditional
    (:func:`conditional_acceptance_rates`). ``use_kernel``: the V-tiled Pallas kernel
    (:func:`pallas_kernels.rejection.rejection_sample_kernel`), with the kernel bodies
    of ``kernel_platform`` ("tpu" / "gpu"; None: :func:`specjax.backends.sampler_kernel_platform`).
    """
    b, k = draft_token_ids.shape
    vocab = target_logits.shape[-1]
    temperature = temperature.astype(jnp.float32)
    any_random = jnp.any(temperature > 0)
    uniforms, exps = draw_rejection_noise(keys, k, vocab, any_random)
    args = (draft_token_ids, num_draft_tokens, target_logits, draft_probs, temperature, top_k, top_p,
            uniforms, exps, conditional_rates)
    if use_kernel:
        if kernel_platform is None:
            from specjax.backends import sampler_kernel_platform

            kernel_platform = sampler_kernel_platform()
        kernel = functools.partial(rejection_sample_kernel, method=method, interpret=interpret,
                                   platform=kernel_platform)
        if method == "synthetic":
            return kernel(*args)
        # All-greedy batches: one argmax pass instead of the kernel's softmax statistics; same outputs.
        return jax.lax.cond(any_random, lambda: kernel(*args),
                            lambda: greedy_verify_reference(draft_token_ids, num_draft_tokens, target_logits))
    if method == "synthetic":
        return rejection_sample_reference(*args, method=method)
    # Token-wise verification has a batched XLA path with the reference's exact arithmetic.
    def full():
        if method == "standard":
            return standard_verify_xla(*args[:-1])
        return rejection_sample_reference(*args, method=method)

    # All-greedy batches skip the softmax/residual work (an argmax pass instead); same outputs.
    return jax.lax.cond(
        any_random,
        full,
        lambda: greedy_verify_reference(draft_token_ids, num_draft_tokens, target_logits),
    )


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _validate(draft, num, logits, draft_probs, temperature, top_k, top_p, method, rates):
    """Host-side checks; value checks are skipped for traced arguments."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if draft.ndim != 2:
        raise ValueError(f"draft_token_ids must be 2-D [B, K], got shape {draft.shape}")
    if not jnp.issubdtype(draft.dtype, jnp.integer):
        raise ValueError(f"draft_token_ids must be integers, got {draft.dtype}")
    b, k = draft.shape
    if logits.ndim != 3:
        raise ValueError(f"target_logits must be 3-D [B, K+1, V], got shape {logits.shape}")
    if logits.shape[0] != b:
        raise ValueError(f"target_logits batch {logits.shape[0]} != draft_token_ids batch {b}")
    if logits.shape[1] != k + 1:
        raise ValueError(f"target_logits must have K+1 = {k + 1} positions, got {logits.shape[1]}")
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"target_logits must be floating point, got {logits.dtype}")
    v = logits.shape[2]
    if v < 1:
        raise ValueError("target_logits must have a non-empty vocabulary axis")
    if num.shape != (b,) or not jnp.issubdtype(num.dtype, jnp.integer):
        raise ValueError(f"num_draft_tokens must be integer [B] = [{b}], got {num.dtype} {num.shape}")
    if draft_probs is not None and draft_probs.shape != (b, k, v):
        raise ValueError(f"draft_probs must be [B, K, V] = {(b, k, v)}, got {draft_probs.shape}")
    if temperature.shape != (b,):
        raise ValueError(f"temperature must be [B] = [{b}], got shape {temperature.shape}")
    if top_k is not None and (top_k.shape != (b,) or not jnp.issubdtype(top_k.dtype, jnp.integer)):
        raise ValueError(f"top_k must be integer [B] = [{b}], got {top_k.dtype} {top_k.shape}")
    if top_p is not None and top_p.shape != (b,):
        raise ValueError(f"top_p must be [B] = [{b}], got shape {top_p.shape}")
    if method == "synthetic":
        if rates is None:
            raise ValueError("synthetic_acceptance_rates is required for method='synthetic'")
        r = np.asarray(rates, np.float64)
        if r.shape != (k,):
            raise ValueError(f"synthetic_acceptance_rates must have shape [K] = [{k}], got {r.shape}")
        if not np.all(np.isfinite(r)) or np.any(r < 0) or np.any(r > 1):
            raise ValueError("synthetic_acceptance_rates must lie in [0, 1]")
        if np.any(np.diff(r) > 0):
            raise ValueError("synthetic_acceptance_rates must be non-increasing")
    if _is_concrete(num):
        n = np.asarray(num)
        if np.any(n < 0) or np.any(n > k):
            raise ValueError(f"num_draft_tokens must lie in [0, K] = [0, {k}], got {n.tolist()}")
        if _is_concrete(draft) and k > 0:
            d = np.asarray(draft)
            used = np.arange(k)[None, :] < n[:, None]
            if np.any(used & ((d < 0) | (d >= v))):
                raise ValueError(f"draft_token_ids must lie in [0, V) = [0, {v}) in each row's first "
                                 "num_draft_tokens entries")
    if _is_concrete(temperature):
        t = np.asarray(temperature, np.float64)
        if np.any(np.isnan(t)) or np.any(t < 0):
            raise ValueError("temperature must be >= 0 (0 = greedy)")
    if top_k is not None and _is_concrete(top_k) and np.any(np.asarray(top_k) < 0):
        raise ValueError("top_k must be >= 0 (0 = off)")
    if top_p is not None and _is_concrete(top_p):
        p = np.asarray(top_p, np.float64)
        if np.any(np.isnan(p)) or np.any(p <= 0) or np.any(p > 1):
            raise ValueError("top_p must lie in (0, 1] (1 = off)")


def rejection_sample_with_counts(
    draft_token_ids,  # int32 [B, K]
    num_draft_tokens,  # int32 [B]
    target_logits,  # float [B, K+1, V]
    draft_probs=None,  # float [B, K, V] or None
    *,
    temperature,  # float [B]
    top_k=None,  # int32 [B] or None
    top_p=None,  # float [B] or None
    key,
    method: str = "standard",
    synthetic_acceptance_rates=None,  # float [K]
    use_kernel: bool | None = None,
    interpret: bool = False,
    kernel_platform: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Like :func:`rejection_sample`, also returning the accepted draft count ``int32 [B]``.

    Tokens emitted by row b = num_accepted[b] + 1.
    """
    as_array = lambda x: x if isinstance(x, jax.Array) else jnp.asarray(x)  # noqa: E731
    draft = as_array(draft_token_ids)
    num = as_array(num_draft_tokens)
    logits = as_array(target_logits)
    probs = None if draft_probs is None else as_array(draft_probs)
    temp = as_array(temperature)
    if temp.ndim == 0:
        temp = jnp.broadcast_to(temp, (draft.shape[0],) if draft.ndim else ())
    tk = None if top_k is None else as_array(top_k)
    tp = None if top_p is None else as_array(top_p)
    _validate(draft, num, logits, probs, temp, tk, tp, method, synthetic_acceptance_rates)
    b, k = draft.shape
    keys = row_keys(key, b)
    rates = None
    if method == "synthetic":
        rates = jnp.asarray(conditional_acceptance_rates(synthetic_acceptance_rates))
    if use_kernel is None:
        use_kernel = default_use_kernel()
    if kernel_platform is not None and kernel_platform not in ("tpu", "gpu"):
        raise ValueError(f"kernel_platform must be 'tpu', 'gpu' or None, got {kernel_platform!r}")
    return rejection_sample_jit(
        draft.astype(jnp.int32), num.astype(jnp.int32), logits, probs, temp.astype(jnp.float32),
        None if tk is None else tk.astype(jnp.int32), None if tp is None else tp.astype(jnp.float32),
        keys, rates, method=method, use_kernel=bool(use_kernel), interpret=bool(interpret),
        kernel_platform=kernel_platform)


def rejection_sample(
    draft_token_ids,  # int32 [B, K]; row b uses its first num_draft_tokens[b] entries
    num_draft_tokens,  # int32 [B], 0..K
    target_logits,  # float [B, K+1, V]; position i < n verifies draft i, position n is the bonus
    draft_probs=None,  # float [B, K, V] or None (deterministic drafts: q is one-hot)
    *,
    temperature,  # float [B]; 0 = greedy row
    top_k=None,  # int32 [B] or None; 0 = off
    top_p=None,  # float [B] or None; 1.0 = off
    key,  # PRNG key, or per-row keys [B] / raw uint32 [B, 2]
    method: str = "standard",  # "standard" | "synthetic" | "block"
    synthetic_acceptance_rates=None,  # float [K], method="synthetic"
    use_kernel: bool | None = None,  # None: specjax.backends.use_pallas_sampler()
    interpret: bool = False,  # run the Pallas kernel in interpret mode (tests on CPU)
    kernel_platform: str | None = None,  # kernel bodies "tpu" / "gpu"; None: from the backend
) -> jax.Array:
    """Verify draft tokens against the target and return committed ids ``int32 [B, K+1]``.

    Row b commits its accepted draft prefix plus one more token (recovered at the
    first rejection, or the bonus from position ``num_draft_tokens[b]``), left-aligned,
    then ``-1``. The output distribution equals the target's (lossless) given that
    ``draft_probs`` is the distribution the drafts were sampled from.

    Random rows shape the target logits with temperature -> top-k -> top-p
    (:func:`specjax.sample.transforms.transform_logits`). ``draft_probs`` are used
    as given: the caller must have applied the same transforms to the draft logits
    (and sampled the drafts from the result). ``draft_probs=None`` means the drafts
    are deterministic (ngram, greedy drafts): q is one-hot on the draft token.
    Greedy rows (temperature 0) accept while the draft equals the target argmax of the
    raw logits; they never see temperature, top-k or top-p.

    Methods: ``"standard"`` token-wise; ``"block"`` block verification (Sun et al.,
    "Block Verification Accelerates Speculative Decoding", ICLR 2025) with block
    length ``num_draft_tokens[b]``; ``"synthetic"`` accepts position i with the
    conditional probability implied by the non-increasing unconditional
    ``synthetic_acceptance_rates`` (benchmarking only: not lossless).

    ``key``: one key -> row keys ``fold_in(key, row)``; or per-row keys (typed ``[B]``
    or raw uint32 ``[B, 2]``), e.g. per-request keys. Same keys and inputs give the
    same output; a row's output depends only on its own key and inputs.

    Raises ValueError (outside jit) for malformed arguments. NaN logits count as
    -inf; output ids always lie in [0, V) or are -1.
    """
    out, _ = rejection_sample_with_counts(
        draft_token_ids, num_draft_tokens, target_logits, draft_probs, temperature=temperature, top_k=top_k,
        top_p=top_p, key=key, method=method, synthetic_acceptance_rates=synthetic_acceptance_rates,
        use_kernel=use_kernel, interpret=interpret, kernel_platform=kernel_platform)
    return out
