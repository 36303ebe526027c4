"""The C++ panel-matmul kernel (models/cpu_kernels/panel_matmul.cc) against its float64 numpy reference.

Real shapes (SmolLM2-135M's projections and LM head), every row-group remainder, padded panels,
bfloat16 weights, leading batch dims; the validated entry's refusals; the build cache; and what
happens on a machine without a C++ compiler.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.cpu_kernels import build
from models.cpu_kernels import panel_matmul as pm

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="an XLA:CPU custom call")

# (N, K) of SmolLM2-135M: qkv [(9+2*3)*64, 576], o [576, 576], gate_up [2*1536, 576], down [576, 1536].
SMOLLM2 = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def _case(m, n, k, seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    return x, w, pm.pack(w, dtype)


def _check(y, x, w_p, n, rtol):
    ref = pm.reference(x, w_p, n)
    assert y.shape == ref.shape and y.dtype == np.float32
    np.testing.assert_allclose(y, ref, rtol=rtol, atol=rtol * np.abs(ref).max())


@pytest.mark.parametrize("n,k", SMOLLM2)
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 16, 40])
def test_matches_reference_at_smollm2_shapes(m, n, k):
    x, _, w_p = _case(m, n, k, seed=m * n + k)
    y = jax.jit(pm.panel_matmul, static_argnums=2)(jnp.asarray(x), jnp.asarray(w_p), n)
    _check(np.asarray(y), x, w_p, n, rtol=2e-5)


def test_lm_head_shape_and_leading_dims():
    x, _, w_p = _case(2 * 5, 49152, 576, seed=7)  # the tied head of SmolLM2 over a [B=2, T=5] verify
    y = pm.panel_matmul(jnp.asarray(x).reshape(2, 5, 576), jnp.asarray(w_p), 49152, out_dtype=jnp.float32)
    assert y.shape == (2, 5, 49152)
    _check(np.asarray(y).reshape(10, -1), x, w_p, 49152, rtol=2e-5)


@pytest.mark.parametrize("n,k", [(1, 3), (33, 17), (70, 24), (95, 100)])
def test_padded_panels_and_odd_contractions(n, k):
    x, w, w_p = _case(3, n, k, seed=n + k)
    assert w_p.shape == (-(-n // 32), k, 32)
    np.testing.assert_array_equal(pm.unpack(w_p, n), w)
    _check(np.asarray(pm.panel_matmul(jnp.asarray(x), jnp.asarray(w_p), n)), x, w_p, n, rtol=2e-5)


@pytest.mark.parametrize("m", [1, 5, 11])
def test_bfloat16_weights_accumulate_in_float32(m):
    x, w, w_p = _case(m, 3072, 576, seed=m, dtype=jnp.bfloat16)
    assert w_p.dtype == jnp.bfloat16
    y = np.asarray(pm.panel_matmul(jnp.asarray(x), jnp.asarray(w_p), 3072))
    _check(y, x, w_p, 3072, rtol=2e-5)  # exact against the bf16-rounded weights
    np.testing.assert_allclose(y, x.astype(np.float64) @ w.T, atol=0.05)  # bf16 rounding of the weights


def test_bfloat16_activations_come_back_in_their_dtype():
    x, _, w_p = _case(4, 64, 32, seed=1)
    y = pm.panel_matmul(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w_p), 64)
    assert y.dtype == jnp.bfloat16
    ref = pm.reference(np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)), w_p, 64)
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=1e-2, atol=1e-2)


def test_entry_refuses_bad_shapes_and_dtypes():
    x = jnp.ones((2, 16), jnp.float32)
    with pytest.raises(ValueError, match="panels"):
        pm.panel_matmul(x, jnp.ones((1, 16, 16), jnp.float32), 16)
    with pytest.raises(ValueError, match="last dim 16"):
        pm.panel_matmul(x, jnp.ones((1, 8, 32), jnp.float32), 32)
    with pytest.raises(ValueError, match="n=40"):
        pm.panel_matmul(x, jnp.ones((1, 16, 32), jnp.float32), 40)
    with pytest.raises(ValueError, match="n=3"):  # a whole empty panel
        pm.panel_matmul(x, jnp.ones((2, 16, 32), jnp.float32), 3)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        pm.panel_matmul(x, jnp.ones((1, 16, 32), jnp.float16), 32)
    with pytest.raises(ValueError, match="shape"):
        pm.pack(np.ones((2, 3, 4)))


def test_build_is_cached_per_machine():
    assert pm.available() and build.load() == build.TARGET
    libs = list(build.cache_dir().glob("panel_matmul-*.so"))
    assert libs, build.cache_dir()


def test_without_a_compiler_the_kernel_is_off_and_the_layout_stays_checkpoint(tmp_path):
    """A fresh process with no compiler on PATH and an empty cache: load() says None, ``auto`` keeps the
    checkpoint layout, ``cpu`` refuses naming the missing kernel."""
    script = textwrap.dedent("""
        import jax
        from models.cpu_kernels import build
        from specjax.backends import use_cpu_weight_layout
        assert build.load() is None
        import os
        cpus = jax.devices("cpu")[:1]
        os.environ["SPECJAX_WEIGHT_LAYOUT"] = "auto"
        assert not use_cpu_weight_layout(cpus)
        os.environ["SPECJAX_WEIGHT_LAYOUT"] = "cpu"
        try:
            use_cpu_weight_layout(cpus)
        except ValueError as e:
            assert "panel-matmul kernel" in str(e), e
        else:
            raise AssertionError("no ValueError")
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    env.update(PATH=str(tmp_path), SPECJAX_CACHE_DIR=str(tmp_path / "cache"), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
    assert "no C++ compiler" in proc.stderr
