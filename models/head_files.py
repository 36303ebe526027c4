"""Draft-head files: specjax's own format (``config.json`` + ``model.safetensors`` with dotted names),
the published layouts through :mod:`models.published_heads`, and the shape check both pass through.

:mod:`models.heads` re-exports these names; the head definitions are imported here inside the
functions, so either module can be imported first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional

import jax
import numpy as np

if TYPE_CHECKING:
    from models.heads import HeadConfig
    from models.llama import LlamaConfig


def _flatten(tree: Mapping[str, Any], leaf=np.asarray, prefix: str = "") -> dict[str, Any]:
    """Dotted names -> ``leaf(value)`` of a nested param dict."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, leaf, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = leaf(v)
    return out


def _unflatten(flat: Mapping[str, np.ndarray]) -> dict:
    tree: dict = {}
    for name, v in flat.items():
        node = tree
        *path, leaf = name.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[leaf] = v
    return tree


def check_head_params(config: HeadConfig, params: Mapping[str, Any], where: str) -> None:
    """ValueError unless ``params`` has exactly the names and shapes ``config`` implies (d2t ids in range)."""
    from models.heads import INT_PARAMS, init_head_params  # noqa: F401 (models.heads re-exports this module)

    expected = jax.eval_shape(lambda: init_head_params(config, jax.random.key(0)))
    want = _flatten(expected, lambda v: tuple(v.shape))
    got = _flatten(params, lambda v: tuple(np.shape(v)))
    if want != got:
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        wrong = sorted(k for k in set(want) & set(got) if want[k] != got[k])
        raise ValueError(f"{where}: params do not match the head config (missing {missing}, unexpected {extra}, "
                         f"wrong shapes {wrong})")
    if "d2t" in params:
        d2t = np.asarray(params["d2t"])
        if d2t.min() < 0 or d2t.max() >= config.vocab_size or len(np.unique(d2t)) != d2t.size:
            raise ValueError(f"{where}: d2t must hold distinct target ids in [0, {config.vocab_size})")


def save_head(path: str | Path, config: HeadConfig, params, *, dtype: str = "bfloat16") -> Path:
    """Write ``config.json`` + ``model.safetensors`` (dotted param names; d2t stays int32) to directory ``path``."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from models.heads import INT_PARAMS

    path = Path(path)
    dtypes = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
    if dtype not in dtypes:
        raise ValueError(f"dtype must be one of {sorted(dtypes)}, got {dtype!r}")
    check_head_params(config, params, str(path))
    path.mkdir(parents=True, exist_ok=True)
    flat = {k: (np.asarray(v, np.int32) if k in INT_PARAMS else np.asarray(v, np.float32).astype(dtypes[dtype]))
            for k, v in _flatten(jax.device_get(params)).items()}
    save_file(flat, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**config.to_json(), "torch_dtype": dtype}, indent=2) + "\n")
    return path


def is_head_dir(path: str | Path) -> bool:
    from models.heads import HEAD_ARCHITECTURE

    cfg = Path(path) / "config.json"
    return cfg.is_file() and HEAD_ARCHITECTURE in (json.loads(cfg.read_text()).get("architectures") or [])


def load_head(path: str | Path, dtype=np.float32, target_config: Optional[LlamaConfig] = None
              ) -> tuple[HeadConfig, dict]:
    """(HeadConfig, params) of a head directory; ValueError naming what is wrong.

    specjax's own format (:func:`save_head`) and the published layouts of :mod:`models.published_heads`
    (EAGLE-3 / EAGLE-1 as their authors publish them, the ``speculators`` format, FasterDecoding Medusa),
    detected from config.json. ``target_config`` resolves what a published head leaves to the target
    (EAGLE-3's default fused layers); pass it whenever the target is known.
    """
    from safetensors.numpy import load_file

    from models.heads import HEAD_ARCHITECTURE, INT_PARAMS, HeadConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"draft head directory {str(path)!r} has no config.json")
    raw = json.loads((path / "config.json").read_text())
    if HEAD_ARCHITECTURE not in (raw.get("architectures") or []):
        from models.published_heads import load_published_head

        return load_published_head(path, dtype=dtype, target_config=target_config)
    config = HeadConfig.from_json(raw)
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise ValueError(f"draft head directory {str(path)!r} has no model.safetensors")
    flat = {k: (np.asarray(v, np.int32) if k in INT_PARAMS else np.asarray(v, np.float32).astype(dtype))
            for k, v in load_file(str(weights)).items()}
    params = _unflatten(flat)
    check_head_params(config, params, str(weights))
    return config, params
