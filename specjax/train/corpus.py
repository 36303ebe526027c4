"""The training corpus (the Python standard library's own source) and its BPE tokenizer.

Every machine that runs specjax has a CPython stdlib, so the built-in model pair
is trained on it: ``*.py`` files under ``sysconfig.get_paths()["stdlib"]``,
skipping test suites, IDLE and installed packages. Files are split into train /
held-out by a hash of their relative path, so the split does not depend on
directory listing order, on which other files exist, or on the Python version
(a file keeps its side of the split across versions).

CLI: ``python -m specjax.train.corpus --out DIR`` trains and saves the tokenizer.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import sysconfig
from pathlib import Path
from typing import Iterator, Optional

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|bos|>"
SPECIAL_TOKENS = (EOS_TOKEN, BOS_TOKEN)  # ids 0 and 1, in this order
EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "__pycache__"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class CorpusConfig:
    root: Optional[str] = None
    """Directory to scan; None = this interpreter's stdlib."""
    heldout_per_mille: int = 20
    """Files whose path hash falls below this (out of 1000) are held out (~2%)."""
    max_file_bytes: int = 400_000
    """Skip generated giants (e.g. big data tables) that would dominate the corpus."""

    def __post_init__(self) -> None:
        if not 0 < self.heldout_per_mille < 1000:
            raise ValueError(f"heldout_per_mille must be in (0, 1000), got {self.heldout_per_mille}")
        if self.max_file_bytes < 1:
            raise ValueError(f"max_file_bytes must be >= 1, got {self.max_file_bytes}")
        if self.root is not None and not Path(self.root).is_dir():
            raise ValueError(f"root {self.root!r} is not a directory")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(config: CorpusConfig = CorpusConfig()) -> list[str]:
    """Sorted relative POSIX paths of the corpus's ``*.py`` files."""
    root = Path(config.root) if config.root is not None else stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in filenames:
            if not name.endswith(".py"):
                continue
            full = Path(dirpath) / name
            if full.stat().st_size > config.max_file_bytes:
                continue
            out.append(full.relative_to(root).as_posix())
    return sorted(out)


def is_heldout(rel_path: str, config: CorpusConfig = CorpusConfig()) -> bool:
    # sha256, not hash(): Python's str hash is salted per process.
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 1000 < config.heldout_per_mille


def split_files(config: CorpusConfig = CorpusConfig()) -> tuple[list[str], list[str]]:
    """(train, heldout) relative paths, each sorted; disjoint and deterministic."""
    files = list_files(config)
    heldout = [f for f in files if is_heldout(f, config)]
    train = [f for f in files if not is_heldout(f, config)]
    return train, heldout


def read_text(rel_path: str, config: CorpusConfig = CorpusConfig()) -> str:
    root = Path(config.root) if config.root is not None else stdlib_root()
    # A few stdlib files are latin-1; errors="replace" keeps the corpus well-defined.
    return (root / rel_path).read_text(encoding="utf-8", errors="replace")


def iter_texts(paths: list[str], config: CorpusConfig = CorpusConfig()) -> Iterator[str]:
    for p in paths:
        yield read_text(p, config)


# --------------------------------------------------------------------------- tokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizerConfig:
    vocab_size: int = 4096
    min_frequency: int = 2

    def __post_init__(self) -> None:
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (byte alphabet), got {self.vocab_size}")
        if self.min_frequency < 1:
            raise ValueError(f"min_frequency must be >= 1, got {self.min_frequency}")


def train_tokenizer(texts: Iterator[str], config: TokenizerConfig = TokenizerConfig()):
    """Byte-level BPE (GPT-2 style pre-tokenizer), special tokens first. Deterministic for a given corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: code must round-trip byte-exactly, no invented leading space.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        min_frequency=config.min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok, out_dir: str | os.PathLike, *, model_max_length: int = 2048) -> None:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` (+ special_tokens_map) for both loaders."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": None,
        "pad_token": EOS_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def encode_files(tok, paths: list[str], config: CorpusConfig = CorpusConfig()):
    """One flat uint16 token stream: each file's ids followed by EOS (the document separator)."""
    import numpy as np

    eos = tok.token_to_id(EOS_TOKEN)
    encs = tok.encode_batch(list(iter_texts(paths, config)))
    parts = []
    for enc in encs:
        parts.append(np.asarray(enc.ids, np.uint16))
        parts.append(np.asarray([eos], np.uint16))
    return np.concatenate(parts) if parts else np.zeros((0,), np.uint16)  # [N]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Train the stdlib BPE tokenizer and save it.")
    ap.add_argument("--out", required=True, help="output directory for tokenizer.json etc.")
    ap.add_argument("--vocab-size", type=int, default=4096)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ccfg = CorpusConfig()
    train, heldout = split_files(ccfg)
    logger.info("corpus: %d train files, %d held-out files", len(train), len(heldout))
    tok = train_tokenizer(iter_texts(train, ccfg), TokenizerConfig(vocab_size=args.vocab_size))
    save_tokenizer(tok, args.out)
    logger.info("saved tokenizer (vocab %d) to %s", tok.get_vocab_size(), args.out)


if __name__ == "__main__":
    main()
