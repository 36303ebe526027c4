"""specjax.backends: what runs where, per platform and per override."""

from __future__ import annotations

import jax
import pytest

from specjax import backends


@pytest.fixture
def on(monkeypatch):
    """on("tpu") makes jax.default_backend() answer "tpu" for the backends module."""

    def set_platform(name):
        monkeypatch.setattr(backends.jax, "default_backend", lambda: name)

    monkeypatch.delenv(backends.ATTENTION_ENV, raising=False)
    monkeypatch.delenv(backends.SAMPLER_ENV, raising=False)
    return set_platform


def test_cpu_defaults(on):
    on("cpu")
    assert backends.platform() == "cpu"
    assert backends.attention_backend(1) == backends.XLA
    assert backends.attention_backend(5) == backends.XLA
    # a model in the derived CPU weight layout (one CPU device, C++ kernels built): the C++ attention
    assert backends.attention_backend(1, cpu_layout=True) == backends.PAGED_CPU
    assert backends.attention_backend(None, cpu_layout=True) == backends.PAGED_CPU
    assert backends.use_pallas_sampler() is False
    assert backends.sampler_kernel_platform() == "gpu"


def test_tpu_defaults(on):
    on("tpu")
    assert backends.attention_backend(1) == backends.RAGGED_TPU
    assert backends.attention_backend(5) == backends.RAGGED_TPU
    assert backends.attention_backend(None) == backends.RAGGED_TPU
    assert backends.use_pallas_sampler() is True
    assert backends.sampler_kernel_platform() == "tpu"


@pytest.mark.parametrize("name", ["gpu", "cuda", "rocm"])
def test_gpu_defaults(on, name):
    on(name)
    assert backends.platform() == "gpu"
    assert backends.attention_backend(1) == backends.PAGED_DECODE_GPU  # a decode op
    assert backends.attention_backend(5) == backends.XLA  # verification / prefill rows
    assert backends.attention_backend(None) == backends.XLA
    assert backends.use_pallas_sampler() is False  # until the device check measures it faster
    assert backends.sampler_kernel_platform() == "gpu"


def test_step_cost_slots_per_platform(on):
    # LLM(mixed_step_padding="auto"): measured on CPU, estimated from published chip figures elsewhere.
    expected = {"cpu": 16, "tpu": 256, "gpu": 256, "cuda": 256, "rocm": 256}
    for name, slots in expected.items():
        on(name)
        assert backends.step_cost_slots() == slots


def test_overrides(on, monkeypatch):
    on("tpu")
    monkeypatch.setenv(backends.ATTENTION_ENV, "xla")
    monkeypatch.setenv(backends.SAMPLER_ENV, "XLA")
    assert backends.attention_backend(1) == backends.XLA
    on("cpu")
    assert backends.attention_backend(5, cpu_layout=True) == backends.XLA
    on("tpu")
    assert backends.use_pallas_sampler() is False
    on("gpu")
    monkeypatch.setenv(backends.SAMPLER_ENV, "pallas")
    monkeypatch.setenv(backends.ATTENTION_ENV, "pallas")
    assert backends.use_pallas_sampler() is True
    assert backends.attention_backend(1) == backends.PAGED_DECODE_GPU
    assert backends.describe()["sampler"] == "pallas_gpu"


def test_bad_overrides_are_refused_by_name(on, monkeypatch):
    on("cpu")
    monkeypatch.setenv(backends.SAMPLER_ENV, "triton")
    with pytest.raises(ValueError, match=backends.SAMPLER_ENV):
        backends.use_pallas_sampler()
    monkeypatch.setenv(backends.ATTENTION_ENV, "pallas")  # no kernel to run on CPU outside interpret mode
    with pytest.raises(ValueError, match=backends.ATTENTION_ENV):
        backends.attention_backend(1)


def test_rejection_front_end_uses_backends(on, monkeypatch):
    from specjax.sample.rejection import default_use_kernel

    on("tpu")
    assert default_use_kernel() is True
    on("cpu")
    assert default_use_kernel() is False


def test_real_platform_is_reported():
    info = backends.describe()
    assert info["platform"] == ("gpu" if jax.default_backend() in ("cuda", "rocm") else jax.default_backend())
    assert set(info) >= {"attention_decode", "attention_multi_token", "sampler"}
