"""The V-tiled Pallas rejection kernels (interpret mode on CPU) against an independent float64 numpy reference.

The reference below is written from the algorithms' definitions (token-wise
speculative sampling, block verification, synthetic acceptance) with numpy in
float64; it shares no code with the kernels or with the jnp reference. It takes
the same randomness (acceptance uniforms, Exp(1) noise), so outputs must agree
token for token, except where a decision lies within float32 rounding of its
threshold: the reference flags those rows ("ambiguous"), the tests skip them and
assert they are rare.

Both kernel bodies run: "gpu" (Triton-style loop over tiles) and "tpu" (grid over
tiles), at real vocabulary sizes (V = 32000 and 151936, B = 2, K = 4) and at
small V for edge cases (tile and split boundaries, ties, NaN, masked rows, K = 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.rejection import KernelBlocks, default_blocks, rejection_sample_kernel, standard_verify_xla
from specjax.sample.rejection import conditional_acceptance_rates, rejection_sample_with_counts

TOL = 1e-4  # relative margin under which a float32 decision may legitimately differ from float64


# ----------------------------------------------------------------------------- numpy float64 reference


def _softmax(s):
    m = np.max(s)
    if not np.isfinite(m):
        return np.zeros_like(s)
    e = np.exp(s - m)
    return e / e.sum()


def _shape_row(x, temp, top_k, top_p):
    """temperature -> top-k -> top-p on one position's logits (float64, -inf outside the support)."""
    s = x / temp
    v = s.shape[0]
    if top_k is not None and 0 < top_k < v:
        kth = np.sort(s)[::-1][top_k - 1]
        s = np.where(s >= kth, s, -np.inf)
    if top_p is not None and top_p < 1.0:
        desc = np.sort(s)[::-1]
        p = _softmax(desc)
        before = np.cumsum(p) - p
        kept = max(int(np.sum(before < top_p)), 1)
        s = np.where(s >= desc[kept - 1], s, -np.inf)
    return s


def _race(r, e):
    """argmax r / e (first index) and whether the top two scores are within TOL of each other."""
    score = r / np.maximum(e, 2.0**-24)
    i = int(np.argmax(score))
    top2 = np.partition(score, -2)[-2:] if score.size > 1 else np.array([-1.0, score[0]])
    close = top2[1] > 0 and (top2[1] - top2[0]) <= TOL * top2[1]
    return i, bool(close)


def _near(a, b):
    return abs(a - b) <= TOL * max(abs(a), abs(b), 1e-30)


def numpy_verify_row(draft, n, logits, q, temp, top_k, top_p, u, e, rates, method):
    """One row in float64. Returns (out [K+1] ids with -1 padding, num accepted, ambiguous)."""
    k = draft.shape[0]
    x = np.where(np.isnan(logits), -np.inf, logits.astype(np.float64))  # [K+1, V]
    greedy_ids = np.argmax(x, axis=1)  # first maximum; an all -inf row gives 0
    out = np.full(k + 1, -1, np.int64)
    ambiguous = False
    if temp <= 0:
        if method == "synthetic":
            a = next((i for i in range(n) if not u[i] < rates[i]), n)
            ambiguous |= any(_near(u[i], rates[i]) for i in range(min(a + 1, n)))
        else:  # greedy verification (block verification reduces to it at temperature 0)
            a = next((i for i in range(n) if draft[i] != greedy_ids[i]), n)
        out[:a] = draft[:a]
        out[a] = greedy_ids[a]
        return out, a, ambiguous
    p = np.stack([_softmax(_shape_row(x[i], temp, top_k, top_p)) for i in range(k + 1)])  # [K+1, V]
    if q is None:
        qq = np.zeros_like(p)
        for i in range(k):
            if 0 <= draft[i] < p.shape[1]:
                qq[i, draft[i]] = 1.0
    else:
        qq = np.concatenate([np.where(q > 0, q.astype(np.float64), 0.0), np.zeros((1, p.shape[1]))])
    pd = np.array([p[i, draft[i]] if i < k else 0.0 for i in range(k + 1)])
    qd = np.array([qq[i, draft[i]] if i < k else 0.0 for i in range(k + 1)])
    scale = 1.0
    if method == "block":
        big_p = np.ones(k + 1)
        for i in range(1, k + 1):
            big_p[i] = min(1.0, big_p[i - 1] * pd[i - 1] / qd[i - 1]) if qd[i - 1] > 0 else 0.0
        h = np.empty(k + 1)
        for i in range(k + 1):
            if i < n:
                z = np.maximum(big_p[i] * p[i] - qq[i], 0.0).sum()
                den = z + 1.0 - big_p[i]
                h[i] = z / den if den > 0 else 1.0
            else:
                h[i] = big_p[i]
        # eta_i = u[i - 1] for i = 1..n; tau = the largest i with eta_i < h_i.
        a = max([i for i in range(1, n + 1) if u[i - 1] < h[i]], default=0)
        ambiguous |= any(_near(u[i - 1], h[i]) for i in range(1, n + 1))
        scale = big_p[a]
    else:
        if method == "synthetic":
            accepted = [u[i] < rates[i] for i in range(n)]
            margins = [_near(u[i], rates[i]) for i in range(n)]
        else:
            accepted = [qd[i] > 0 and u[i] * qd[i] < pd[i] for i in range(n)]
            margins = [_near(u[i] * qd[i], pd[i]) for i in range(n)]
        a = next((i for i in range(n) if not accepted[i]), n)
        ambiguous |= any(margins[: min(a + 1, n)])
    r = np.maximum(scale * p[a] - qq[a], 0.0) if a < n else p[a]
    if r.sum() <= 0:
        r = p[a]
    token, close = _race(r, e)
    out[:a] = draft[:a]
    out[a] = token
    return out, a, ambiguous | close


def numpy_reference(args, method):
    draft, num, logits, q, temp, top_k, top_p, u, e, rates = (None if a is None else np.asarray(a, np.float64)
                                                               if a.dtype == jnp.bfloat16 else np.asarray(a)
                                                               for a in args)
    outs, nums, amb = [], [], []
    for b in range(draft.shape[0]):
        o, a, ambiguous = numpy_verify_row(
            draft[b], int(num[b]), logits[b], None if q is None else q[b], float(temp[b]),
            None if top_k is None else int(top_k[b]), None if top_p is None else float(top_p[b]), u[b], e[b],
            None if rates is None else rates, method)
        outs.append(o)
        nums.append(a)
        amb.append(ambiguous)
    return np.stack(outs), np.array(nums), np.array(amb)


# ----------------------------------------------------------------------------- inputs


def make_inputs(b, k, v, dtype, with_q, with_filters, seed, temps=(1.0, 0.6)):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(b, k + 1, v)) * 3.0
    logits[0, 0, : v // 4] = -np.inf  # zero-probability tokens
    logits[-1, -1, 1] = np.nan  # NaN counts as -inf
    q = None
    if with_q:
        q = rng.random((b, k, v)) ** 8  # peaked draft distributions
        q[:, :, 0] = 0.0
        q = (q / q.sum(-1, keepdims=True)).astype(np.float32)
    # Drafts: mostly the target's mode so acceptance, mid rejection and the bonus all occur.
    mode = np.argmax(np.nan_to_num(logits[:, :k], nan=-np.inf), -1)
    draft = np.where(rng.random((b, k)) < 0.75, mode, rng.integers(0, v, (b, k))).astype(np.int32)
    num = rng.integers(min(1, k), k + 1, b).astype(np.int32)
    num[-1] = k
    temp = np.asarray([temps[i % len(temps)] for i in range(b)], np.float32)
    top_k = rng.integers(0, 50, b).astype(np.int32) if with_filters else None
    top_p = rng.choice([0.6, 0.95, 1.0], b).astype(np.float32) if with_filters else None
    uniforms = rng.random((b, k), dtype=np.float32)
    exps = rng.exponential(size=(b, v)).astype(np.float32)
    return (jnp.asarray(draft), jnp.asarray(num), jnp.asarray(logits, dtype), None if q is None else jnp.asarray(q),
            jnp.asarray(temp), None if top_k is None else jnp.asarray(top_k),
            None if top_p is None else jnp.asarray(top_p), jnp.asarray(uniforms), jnp.asarray(exps))


def _rates(method, k):
    return jnp.asarray(conditional_acceptance_rates(np.linspace(0.9, 0.4, k))) if method == "synthetic" else None


def check_against_numpy(args, method, out, num, max_ambiguous_frac=0.5):
    ref_out, ref_num, amb = numpy_reference(args, method)
    out, num = np.asarray(out), np.asarray(num)
    for b in np.nonzero(~amb)[0]:
        np.testing.assert_array_equal(out[b], ref_out[b], err_msg=f"row {b}")
        assert num[b] == ref_num[b], f"row {b}"
    assert amb.mean() <= max_ambiguous_frac, "too many near-threshold rows for the test to mean anything"
    v = args[2].shape[2]
    assert np.all((out == -1) | ((out >= 0) & (out < v)))
    return int(amb.sum())


# ----------------------------------------------------------------------------- real vocabulary sizes

REAL = [
    # (V, platform, method, draft probs, logits dtype)
    (32000, "gpu", "standard", False, jnp.bfloat16),
    (32000, "tpu", "standard", True, jnp.float32),
    (32000, "gpu", "block", True, jnp.float32),
    (32000, "tpu", "synthetic", False, jnp.bfloat16),
    (151936, "gpu", "standard", True, jnp.bfloat16),
    (151936, "tpu", "standard", False, jnp.float32),
    (151936, "tpu", "block", True, jnp.bfloat16),
    (151936, "gpu", "block", False, jnp.float32),
]


@pytest.mark.parametrize("v,platform,method,with_q,dtype", REAL,
                         ids=[f"V{c[0]}-{c[1]}-{c[2]}-q{int(c[3])}-{jnp.dtype(c[4]).name}" for c in REAL])
def test_kernel_real_vocab_matches_numpy(v, platform, method, with_q, dtype):
    b, k = 2, 4
    rates = _rates(method, k)
    blocks = default_blocks(platform, b, k + 1, v)
    ambiguous = 0
    for seed in range(2):
        args = make_inputs(b, k, v, dtype, with_q, False, seed) + (rates,)
        out, num = rejection_sample_kernel(*args, method=method, interpret=True, blocks=blocks)
        ambiguous += check_against_numpy(args, method, out, num)
        if method == "standard":  # and the batched XLA path the engine runs off-accelerator
            xo, xn = standard_verify_xla(*args[:-1])
            ref_out, _, amb = numpy_reference(args, method)
            np.testing.assert_array_equal(np.asarray(xo)[~amb], np.asarray(out)[~amb])
    assert ambiguous <= 1


def test_kernel_real_vocab_greedy_rows():
    """All-greedy batch at V = 151936: the argmax pass alone, across many tiles and splits."""
    b, k, v = 2, 4, 151936
    args = make_inputs(b, k, v, jnp.bfloat16, False, False, 3, temps=(0.0,)) + (None,)
    logits = np.array(args[2].astype(jnp.float32))
    # The target's argmax sits in the last, partial tile for row 0's first position.
    logits[0, 0, -3] = 50.0
    args = args[:2] + (jnp.asarray(logits, jnp.bfloat16),) + args[3:]
    draft = np.array(args[0])
    draft[0, 0] = v - 3
    args = (jnp.asarray(draft),) + args[1:]
    for platform in ("gpu", "tpu"):
        out, num = rejection_sample_kernel(*args, method="standard", interpret=True, platform=platform)
        check_against_numpy(args, "standard", out, num, max_ambiguous_frac=0.0)
        assert int(num[0]) >= 1


# ----------------------------------------------------------------------------- small V: edges, every feature

SMALL_BLOCKS = {
    "gpu": KernelBlocks(platform="gpu", tile_v=64, race_tile_v=128, splits=3),
    "tpu": KernelBlocks(platform="tpu", tile_v=128, race_tile_v=128, splits=2),
}
SMALL = [
    # (B, K, V, method, draft probs, top-k/top-p)
    (4, 3, 517, "standard", False, True),
    (4, 4, 300, "standard", True, False),
    (4, 3, 517, "block", True, True),
    (4, 4, 300, "block", False, False),
    (4, 2, 300, "synthetic", True, False),
    (3, 0, 200, "standard", False, False),
    (3, 0, 200, "block", False, False),
]


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
@pytest.mark.parametrize("b,k,v,method,with_q,with_filters", SMALL,
                         ids=[f"{c[0]}x{c[1]}x{c[2]}-{c[3]}-q{int(c[4])}-f{int(c[5])}" for c in SMALL])
def test_kernel_small_vocab_matches_numpy(platform, b, k, v, method, with_q, with_filters):
    rates = _rates(method, k) if k else None
    ambiguous = 0
    for seed in range(2):
        args = make_inputs(b, k, v, jnp.float32, with_q and k > 0, with_filters, seed,
                           temps=(1.0, 0.0, 0.6, 1.7)) + (rates,)
        out, num = rejection_sample_kernel(*args, method=method, interpret=True, blocks=SMALL_BLOCKS[platform])
        ambiguous += check_against_numpy(args, method, out, num)
    assert ambiguous <= 2


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_ties_across_tiles_and_splits_take_the_first_index(platform):
    """Equal maxima in different tiles / splits: greedy picks the first, like argmax."""
    b, k, v = 2, 1, 640
    logits = np.zeros((b, k + 1, v), np.float32)
    logits[:, :, [5, 200, 600]] = 7.0  # three equal maxima, in three different 64-lane tiles and splits
    logits[1, 0, 5] = 6.0  # row 1: the first maximum is at 200
    args = (jnp.asarray([[5], [200]], jnp.int32), jnp.asarray([1, 1], jnp.int32), jnp.asarray(logits), None,
            jnp.zeros((b,), jnp.float32), None, None, jnp.zeros((b, k)), jnp.ones((b, v)), None)
    out, num = rejection_sample_kernel(*args, method="standard", interpret=True, blocks=SMALL_BLOCKS[platform])
    np.testing.assert_array_equal(np.asarray(out), [[5, 5], [200, 5]])
    np.testing.assert_array_equal(np.asarray(num), [1, 1])


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_fully_masked_position_and_exact_residual(platform):
    """Row 0: an all -inf position rejects its draft and draws token 0 (in range). Row 1: p is exactly
    1/2 on tokens 7 and 250, the draft is 7 with q(7) = 1 and u = 0.9 >= p/q: rejected, and the
    residual max(p - q, 0) lives on token 250 alone."""
    b, k, v = 2, 2, 300
    logits = np.random.default_rng(0).normal(size=(b, k + 1, v)).astype(np.float32)
    logits[0, 0] = -np.inf
    logits[1, 0] = -np.inf
    logits[1, 0, [7, 250]] = 0.0
    q = np.full((b, k, v), 1.0 / v, np.float32)
    q[1, 0] = 0.0
    q[1, 0, 7] = 1.0
    args = (jnp.asarray([[3, 4], [7, 1]], jnp.int32), jnp.asarray([2, 2], jnp.int32), jnp.asarray(logits),
            jnp.asarray(q), jnp.ones((b,), jnp.float32), None, None, jnp.asarray([[0.5, 0.5], [0.9, 0.5]]),
            jnp.asarray(np.random.default_rng(1).exponential(size=(b, v)), jnp.float32), None)
    out, num = rejection_sample_kernel(*args, method="standard", interpret=True, blocks=SMALL_BLOCKS[platform])
    np.testing.assert_array_equal(np.asarray(out), [[0, -1, -1], [250, -1, -1]])
    np.testing.assert_array_equal(np.asarray(num), [0, 0])
    check_against_numpy(args, "standard", out, num, max_ambiguous_frac=0.0)


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_front_end_kernel_path_matches_numpy(platform):
    """rejection_sample_with_counts(use_kernel=True): same noise the jnp path draws, numpy-checked."""
    from specjax.sample.rejection import draw_rejection_noise, row_keys

    b, k, v = 4, 3, 400
    draft, num, logits, q, temp, top_k, top_p, _, _ = make_inputs(b, k, v, jnp.float32, True, True, 7,
                                                                  temps=(1.0, 0.0, 0.8))
    key = jax.random.key(11)
    kw = dict(temperature=temp, top_k=top_k, top_p=top_p, key=key, method="block")
    out_k, acc_k = rejection_sample_with_counts(draft, num, logits, q, use_kernel=True, interpret=True,
                                                kernel_platform=platform, **kw)
    uniforms, exps = draw_rejection_noise(row_keys(key, b), k, v)
    args = (draft, num, logits, q, temp, top_k, top_p, uniforms, exps, None)
    check_against_numpy(args, "block", out_k, acc_k)
    out_r, acc_r = rejection_sample_with_counts(draft, num, logits, q, use_kernel=False, **kw)
    _, _, amb = numpy_reference(args, "block")
    np.testing.assert_array_equal(np.asarray(out_k)[~amb], np.asarray(out_r)[~amb])


@pytest.mark.slow
def test_kernel_distribution_chi_square():
    """Many rows with the same logits and fresh noise: the committed first token follows the target's
    distribution (lossless), for a draft that is often rejected."""
    from scipy import stats

    b, k, v = 2048, 1, 12
    rng = np.random.default_rng(0)
    target = rng.normal(size=(k + 1, v)) * 1.5
    draft_q = rng.dirichlet(np.ones(v))
    p0 = np.exp(target[0] - target[0].max())
    p0 /= p0.sum()
    draft = rng.choice(v, size=(b, k), p=draft_q).astype(np.int32)
    args = (jnp.asarray(draft), jnp.full((b,), k, jnp.int32), jnp.asarray(np.broadcast_to(target, (b, k + 1, v)),
            jnp.float32), jnp.asarray(np.broadcast_to(draft_q, (b, k, v)), jnp.float32), jnp.ones((b,)), None, None,
            jnp.asarray(rng.random((b, k)), jnp.float32), jnp.asarray(rng.exponential(size=(b, v)), jnp.float32),
            None)
    blocks = KernelBlocks(platform="gpu", tile_v=8, race_tile_v=8, splits=2)
    out, _ = rejection_sample_kernel(*args, method="standard", interpret=True, blocks=blocks)
    counts = np.bincount(np.asarray(out)[:, 0], minlength=v)
    assert stats.chisquare(counts, p0 * b).pvalue > 1e-3


def test_kernel_checks_shapes_and_blocks():
    args = list(make_inputs(2, 3, 16, jnp.float32, False, False, 0)) + [None]
    bad = list(args)
    bad[7] = bad[7][:, :2]  # uniforms [B, K-1]
    with pytest.raises(ValueError, match="uniforms"):
        rejection_sample_kernel(*bad, method="standard", interpret=True)
    with pytest.raises(ValueError, match="tile_v"):
        KernelBlocks(platform="gpu", tile_v=100, race_tile_v=128, splits=1)
    with pytest.raises(ValueError, match="multiples of 128"):
        KernelBlocks(platform="tpu", tile_v=64, race_tile_v=128, splits=1)
    with pytest.raises(ValueError, match="platform"):
        rejection_sample_kernel(*args, method="standard", interpret=True, platform="tpu",
                                blocks=SMALL_BLOCKS["gpu"])


def _lower(platform, lowering_platform):
    b, k, v = 4, 4, 151936
    args = (jnp.zeros((b, k), jnp.int32), jnp.zeros((b,), jnp.int32), jnp.zeros((b, k + 1, v), jnp.bfloat16),
            jnp.zeros((b, k, v), jnp.bfloat16), jnp.zeros((b,)), None, None, jnp.zeros((b, k)), jnp.zeros((b, v)))
    fn = jax.jit(lambda *a: rejection_sample_kernel(*a, method="block", platform=platform))
    return fn.trace(*args).lower(lowering_platforms=(lowering_platform,)).as_text()


def test_kernel_lowers_for_gpu_triton():
    """The GPU bodies pass Pallas's Triton lowering (PTX compilation itself needs a GPU)."""
    text = _lower("gpu", "cuda")
    assert text.count("__gpu$xla.gpu.triton") == 3  # stats, residual mass, race


def test_kernel_lowers_for_tpu_mosaic():
    """The TPU bodies pass Pallas's Mosaic lowering for a v5e (Mosaic's own compile needs a TPU)."""
    tpu_info = pytest.importorskip("jax._src.pallas.mosaic.tpu_info")
    if not hasattr(tpu_info, "registry") or not hasattr(tpu_info, "get_tpu_info_for_chip"):
        pytest.skip("this jax has no hook to name a TPU generation off-TPU")
    tpu_info.registry["cpu"] = lambda: tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5E, 1)
    try:
        text = _lower("tpu", "tpu")
    finally:
        del tpu_info.registry["cpu"]
    assert text.count("tpu_custom_call") == 3


def test_pallas_kernels_import_nothing_from_specjax():
    import subprocess
    import sys

    code = ("import sys, pallas_kernels.rejection, pallas_kernels.sampling_ops; "
            "bad = sorted(m for m in sys.modules if m == 'specjax' or m.startswith('specjax.')); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
