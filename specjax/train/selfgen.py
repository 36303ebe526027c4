"""Training data a target writes itself: varied prompts (prose, chat, code) -> the target's own continuations.

The EAGLE authors regenerate their training responses with the target, so the
head learns the target's own style; a head trained only on one kind of text
(e.g. Python source) loses acceptance elsewhere. Here the target answers a
fixed, seeded prompt set (:func:`build_prompts`): chat requests rendered with
its chat template (explanations, writing, advice, code), and raw continuations
of prose openings and Python source. Half the rows decode greedily, half
sample at temperature 0.7.

Generation runs on device in one compiled program per batch shape
(:func:`generate_batch`: a prefill pass then a ``lax.scan`` of one-token
steps through ``models.llama.forward_features``), and keeps what the head
trains on, so training never runs the target again: per position the token,
the target's final-normed hidden state (its LM head gives the teacher
distribution), the residual streams of the fused layers (EAGLE-3 features) and
the target's argmax. Shards are written atomically as ``.npy`` files
(``shard_00000/tokens.npy``, ...) and a rerun skips finished shards, so an
interrupted generation resumes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
import sysconfig
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.llama import LlamaConfig, forward_features

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------- prompts

_EXPLAIN = ["photosynthesis", "recursion in programming", "inflation", "black holes", "the water cycle",
            "how vaccines work", "supply and demand", "the French Revolution", "machine learning", "plate tectonics",
            "compound interest", "the immune system", "climate change", "how the internet works", "gravity",
            "the causes of World War I", "DNA replication", "public key cryptography", "the stock market",
            "how a bill becomes law", "volcanoes", "the Roman Empire", "electric circuits", "natural selection",
            "the theory of relativity", "how batteries work", "sleep and memory", "the printing press",
            "hash tables", "blockchain", "the greenhouse effect", "how airplanes fly", "the human heart",
            "neural networks", "the Renaissance", "ocean tides", "the scientific method", "prime numbers",
            "the Cold War", "how compilers work", "probability", "rainbows", "the solar system", "antibiotics",
            "operating systems", "democracy", "the industrial revolution", "quantum computing", "earthquakes",
            "the moon landing", "sorting algorithms", "nutrition", "cloud computing", "the Silk Road"]
_STORY = ["a lighthouse keeper", "a robot learning to paint", "a lost dog finding its way home", "a city under the sea",
          "a time traveler in ancient Egypt", "a dragon who is afraid of fire", "two friends on a road trip",
          "a mysterious letter", "a chef in a small village", "the last tree on Earth", "a detective in Paris",
          "a child who can talk to birds", "a haunted library", "a space station crew", "a musician's first concert",
          "a snowstorm in the mountains", "a forgotten toy", "a pirate searching for treasure", "an old clockmaker",
          "a garden that grows overnight", "a knight and a wizard", "a rainy day in London", "a message in a bottle",
          "a family reunion", "a volcano island", "a baker who bakes dreams"]
_POEM = ["the ocean", "autumn leaves", "the city at night", "friendship", "the stars", "a mountain sunrise",
         "winter", "coffee", "the passage of time", "rain", "home", "a cat", "spring flowers", "the desert"]
_EMAIL = [("my manager", "taking a day off next week"), ("a customer", "a delayed order"),
          ("my landlord", "a broken heater"), ("a professor", "an extension for an assignment"),
          ("the team", "the new project schedule"), ("a friend", "plans for the weekend"),
          ("a hiring manager", "following up after an interview"), ("a neighbor", "a noisy party"),
          ("the school", "my child's absence"), ("a colleague", "feedback on a presentation")]
_ADVICE = ["learning a new language", "staying productive while working from home", "saving money",
           "running a first marathon", "public speaking", "writing a resume", "starting a vegetable garden",
           "learning to code", "cooking healthy meals", "managing stress", "traveling on a budget",
           "preparing for a job interview", "improving sleep", "taking better photos", "studying for exams",
           "keeping a house plant alive", "making friends in a new city", "reading more books"]
_COMPARE = [("Python", "JavaScript"), ("cats", "dogs"), ("renting", "buying a home"), ("tea", "coffee"),
            ("trains", "planes"), ("SQL", "NoSQL databases"), ("electric cars", "gasoline cars"),
            ("TCP", "UDP"), ("stocks", "bonds"), ("summer", "winter"), ("Linux", "Windows"), ("books", "movies")]
_CODE = ["reverses a string", "checks whether a number is prime", "computes the Fibonacci sequence",
         "merges two sorted lists", "counts the words in a text file", "finds the largest element in a list",
         "removes duplicates from a list", "converts Celsius to Fahrenheit", "validates an email address",
         "reads a CSV file and prints the average of a column", "implements binary search",
         "checks whether a string is a palindrome", "flattens a nested list", "sorts a dictionary by value",
         "computes the factorial of a number", "parses command line arguments", "implements a stack class",
         "downloads a web page", "finds the most common element in a list", "generates random passwords",
         "implements bubble sort", "computes the greatest common divisor", "transposes a matrix",
         "counts vowels in a string", "implements a linked list", "groups words by their first letter",
         "measures how long a function takes", "writes a list of dictionaries to a JSON file"]
_CODE_LANGS = ["Python", "JavaScript", "C", "Rust", "Java", "Go"]
_PROSE = ["The history of {t} is", "In the early morning, the village", "There are three reasons why {t}",
          "Scientists have long wondered about {t}.", "Once upon a time, there was", "The most important thing about {t}",
          "Dear diary, today I", "When I was young, my grandmother told me", "The report found that {t}",
          "Chapter 1\n\nThe rain had not stopped for"]
_SYSTEMS = [None, "You are a helpful assistant.", "You are a concise assistant. Answer briefly.",
            "You are a friendly teacher who explains things clearly."]


@dataclasses.dataclass(frozen=True)
class Prompt:
    kind: str
    """"chat" (rendered with the chat template), "prose" or "code" (raw continuation)."""
    text: str
    """The user message (chat) or the raw text to continue."""
    system: Optional[str] = None


def _held_out(topic: str, share: int) -> bool:
    """A topic's side (train / held-out) depends only on the topic: sha256 % share == 0 is held out."""
    return int(hashlib.sha256(topic.encode()).hexdigest(), 16) % share == 0


def _stdlib_snippets(limit: int, lines: int = 24) -> list[tuple[str, str]]:
    """(file, first ``lines`` lines of a top-level def) of stdlib modules, sorted: code prompts every machine has."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for f in sorted(root.glob("*.py"))[:400]:
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        src = text.splitlines()
        starts = [i for i, line in enumerate(src) if line.startswith("def ")]
        if starts:
            i = starts[len(starts) // 2]
            out.append((f.name, "\n".join(src[i:i + lines])))
    return out[:limit]


def build_prompts(*, held_out_share: int = 8) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held-out) prompts. A prompt is held out when its topic is (so held-out topics are unseen)."""
    items: list[tuple[str, Prompt]] = []
    sys_i = 0

    def chat(topic: str, text: str) -> None:
        nonlocal sys_i
        items.append((topic, Prompt("chat", text, _SYSTEMS[sys_i % len(_SYSTEMS)])))
        sys_i += 1

    for t in _EXPLAIN:
        chat(t, f"Explain {t} in simple terms.")
        chat(t, f"What is the most surprising fact about {t}?")
        items.append((t, Prompt("prose", _PROSE[len(items) % len(_PROSE)].format(t=t))))
    for t in _STORY:
        chat(t, f"Write a short story about {t}.")
    for t in _POEM:
        chat(t, f"Write a poem about {t}.")
    for who, what in _EMAIL:
        chat(what, f"Write an email to {who} about {what}.")
    for t in _ADVICE:
        chat(t, f"What are some tips for {t}?")
    for a, b in _COMPARE:
        chat(a + b, f"Compare {a} and {b}.")
    for i, t in enumerate(_CODE):
        chat(t, f"Write a Python function that {t}.")
        lang = _CODE_LANGS[i % len(_CODE_LANGS)]
        chat(t + lang, f"How do I write a program in {lang} that {t}?")
    for name, snippet in _stdlib_snippets(120):
        items.append((name, Prompt("code", snippet)))
        short = "\n".join(snippet.splitlines()[:8])
        chat(name, f"Explain what this code does:\n```python\n{short}\n```")
    train = [p for topic, p in items if not _held_out(topic, held_out_share)]
    held = [p for topic, p in items if _held_out(topic, held_out_share)]
    return train, held


def render_chat(template: Optional[str], p: Prompt, bos: str = "") -> str:
    """The prompt text the target sees: chat prompts through its chat template (Jinja), raw ones as they are."""
    if p.kind != "chat":
        return p.text
    messages = ([{"role": "system", "content": p.system}] if p.system else []) + [{"role": "user", "content": p.text}]
    if template is None:  # a model without a template: a plain transcript
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    import jinja2

    env = jinja2.Environment(loader=jinja2.BaseLoader(), keep_trailing_newline=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, bos_token=bos)


# --------------------------------------------------------------------------- generation


def _sample(logits: jax.Array, temps: jax.Array, keys: jax.Array) -> jax.Array:
    """float32 [B, V] -> int32 [B]: argmax where temps == 0, else a draw from softmax(logits / temp)."""
    greedy = jnp.argmax(logits, axis=-1)
    scaled = logits / jnp.maximum(temps, 1e-6)[:, None]
    drawn = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, scaled)
    return jnp.where(temps > 0, drawn, greedy).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("config", "aux_layer_ids", "max_new", "eos_ids"))
def generate_batch(params, tokens: jax.Array, lens: jax.Array, temps: jax.Array, key: jax.Array, *,
                   config: LlamaConfig, aux_layer_ids: tuple[int, ...], max_new: int, eos_ids: tuple[int, ...]):
    """Continue ``tokens [B, P]`` (row ``b`` valid up to ``lens[b]``) by ``max_new`` tokens; all on device.

    Returns dict of [B, S = P + max_new] arrays: ``tokens`` (int32), ``length`` [B] (valid tokens, prompt
    included, up to and including the first EOS), ``prompt_len`` [B], ``hidden`` [B, S, D] and ``aux``
    [B, S, A*D] (float32; stored as float16) and ``top1`` (int32: the target's argmax at each generated
    position, -1 on the prompt).
    """
    from specjax.kv_cache import AttentionMetadata, KVCache

    b, p = tokens.shape
    s = p + max_new
    rows = jnp.arange(b)
    cache = KVCache.allocate(num_layers=config.num_hidden_layers, num_blocks=b, block_size=s,
                             num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                             dtype=jax.tree.leaves(params)[0].dtype)
    tables = rows[:, None].astype(jnp.int32)  # [B, 1]: one block of S slots per row
    pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    slots = jnp.where(pos < lens[:, None], rows[:, None] * s + pos, -1)
    # Logits only at each prompt's last token: the prompt's own positions are context, never trained on.
    logits, hidden, aux, cache = forward_features(params, tokens, pos, cache,
                                                  AttentionMetadata(slot_mapping=slots, block_tables=tables),
                                                  config=config, aux_layer_ids=aux_layer_ids,
                                                  logits_indices=(lens - 1)[:, None])  # logits [B, 1, V]
    out_tok = jnp.zeros((b, s), jnp.int32).at[:, :p].set(jnp.where(pos < lens[:, None], tokens, 0))
    out_hid = jnp.zeros((b, s, hidden.shape[-1]), jnp.float32).at[:, :p].set(hidden.astype(jnp.float32))
    out_aux = jnp.zeros((b, s, aux.shape[-1]), jnp.float32).at[:, :p].set(aux.astype(jnp.float32))
    out_top = jnp.full((b, s), -1, jnp.int32)  # -1: no target argmax recorded (prompt positions)
    row_keys = jax.vmap(lambda r: jax.random.fold_in(key, r))(rows)
    step_keys = lambda i: jax.vmap(lambda k: jax.random.fold_in(k, i))(row_keys)  # noqa: E731
    first = _sample(logits[:, 0], temps, step_keys(0))
    eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)

    def step(carry, i):
        cache, tok, done = carry
        at = lens + i  # [B]: position of tok
        md = AttentionMetadata(slot_mapping=(rows * s + at)[:, None], block_tables=tables)
        lg, hd, ax, cache = forward_features(params, tok[:, None], at[:, None], cache, md, config=config,
                                             aux_layer_ids=aux_layer_ids)
        nxt = _sample(lg[:, 0], temps, step_keys(i + 1))
        rec = (tok, hd[:, 0].astype(jnp.float32), ax[:, 0].astype(jnp.float32),
               jnp.argmax(lg[:, 0], -1).astype(jnp.int32), done)
        return (cache, nxt, done | jnp.isin(tok, eos)), rec

    _, (toks, hids, auxs, tops, dones) = jax.lax.scan(step, (cache, first, jnp.zeros((b,), bool)),
                                                      jnp.arange(max_new))  # [N, B, ...]
    cols = lens[None, :] + jnp.arange(max_new)[:, None]  # [N, B]
    out_tok = out_tok.at[rows[None], cols].set(toks)
    out_hid = out_hid.at[rows[None], cols].set(hids)
    out_aux = out_aux.at[rows[None], cols].set(auxs)
    out_top = out_top.at[rows[None], cols].set(tops)
    length = lens + jnp.sum(~dones, axis=0)  # tokens until and including the first EOS
    return {"tokens": out_tok, "length": length.astype(jnp.int32), "prompt_len": lens.astype(jnp.int32),
            "hidden": out_hid, "aux": out_aux, "top1": out_top}


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenConfig:
    """What :func:`generate_corpus` writes."""

    num_rows: int = 1024
    batch_size: int = 16
    """Rows per compiled call and per shard."""
    max_prompt_tokens: int = 96
    max_new_tokens: int = 256
    temperature: float = 0.7
    """Odd rows sample at this temperature; even rows decode greedily."""
    seed: int = 0

    def __post_init__(self) -> None:
        from specjax.train.lm import check_positive_ints

        check_positive_ints(self, ("num_rows", "batch_size", "max_prompt_tokens", "max_new_tokens"))
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")


def encode_prompts(target_path: str, prompts: Sequence[Prompt], max_tokens: int) -> list[list[int]]:
    """Token ids of each prompt as the target sees it (chat template applied); raw prompts over ``max_tokens``
    keep their end, chat prompts over it are None (dropped by the caller)."""
    from models.loading import load_tokenizer, read_chat_template

    tok = load_tokenizer(target_path)
    if tok is None:
        raise ValueError(f"--target {target_path!r} has no tokenizer (generated data needs one)")
    template = read_chat_template(target_path)
    out = []
    for p in prompts:
        ids = tok.encode(render_chat(template, p), add_special_tokens=p.kind != "chat").ids
        # A raw continuation keeps its end; a chat prompt cut anywhere loses its template, so it is dropped.
        out.append(ids[-max_tokens:] if p.kind != "chat" or len(ids) <= max_tokens else None)
    return out


def generate_corpus(target: tuple[LlamaConfig, Any], target_path: str, out_dir: Path, cfg: GenConfig, *,
                    aux_layer_ids: tuple[int, ...], eos_ids: tuple[int, ...], prompts: Sequence[Prompt],
                    progress: bool = True) -> dict:
    """Write ``ceil(num_rows / batch_size)`` shards to ``out_dir`` (skipping finished ones); returns stats.

    Row ``r`` answers ``prompts[r % len(prompts)]`` (the prompt list is shuffled by ``seed`` first).
    """
    from tqdm import tqdm

    t_config, t_params = target
    out_dir.mkdir(parents=True, exist_ok=True)
    order = np.random.default_rng(cfg.seed).permutation(len(prompts))
    ids = [x for x in encode_prompts(target_path, [prompts[i] for i in order], cfg.max_prompt_tokens) if x]
    # What shard contents depend on (num_rows only says how many shards: raising it later extends the data).
    meta = {"gen_config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "num_rows"},
            "aux_layer_ids": list(aux_layer_ids), "eos_ids": list(eos_ids), "num_prompts": len(ids)}
    meta_file = out_dir / "meta.json"
    if meta_file.is_file() and json.loads(meta_file.read_text()) != meta:
        raise ValueError(f"{out_dir} holds data generated with other settings ({meta_file}); use a new directory")
    meta_file.write_text(json.dumps(meta, indent=2) + "\n")
    n_shards = -(-cfg.num_rows // cfg.batch_size)
    t0, new_tokens = time.time(), 0
    for shard in tqdm(range(n_shards), desc="generate", disable=not progress):
        final = out_dir / f"shard_{shard:05d}"
        if (final / "done").is_file():
            continue
        rows = [(shard * cfg.batch_size + j) % len(ids) for j in range(cfg.batch_size)]
        toks = np.zeros((cfg.batch_size, cfg.max_prompt_tokens), np.int32)
        lens = np.zeros((cfg.batch_size,), np.int32)
        for j, r in enumerate(rows):
            toks[j, :len(ids[r])] = ids[r]
            lens[j] = len(ids[r])
        temps = np.where(np.arange(cfg.batch_size) % 2 == 1, cfg.temperature, 0.0).astype(np.float32)
        key = jax.random.fold_in(jax.random.key(cfg.seed), shard)
        out = jax.device_get(generate_batch(t_params, jnp.asarray(toks), jnp.asarray(lens), jnp.asarray(temps), key,
                                            config=t_config, aux_layer_ids=tuple(aux_layer_ids),
                                            max_new=cfg.max_new_tokens, eos_ids=tuple(eos_ids)))
        tmp = out_dir / f".tmp_{shard:05d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for k, v in out.items():
            v = np.asarray(v)
            np.save(tmp / f"{k}.npy", v.astype(np.float16) if v.dtype == np.float32 else v)
        (tmp / "done").write_text("")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        new_tokens += int(np.sum(out["length"] - out["prompt_len"]))
        logger.info("shard %d: %d new tokens (%.1f tokens/s so far this run)", shard,
                    int(np.sum(out["length"] - out["prompt_len"])), new_tokens / max(time.time() - t0, 1e-9))
    return {"shards": n_shards, "new_tokens_this_run": new_tokens, "wall_s_this_run": round(time.time() - t0, 1)}


def load_shards(data_dir: Path) -> dict[str, np.ndarray]:
    """Every finished shard of ``data_dir``, memory-mapped and concatenated along rows."""
    shards = sorted(d for d in data_dir.glob("shard_*") if (d / "done").is_file())
    if not shards:
        raise ValueError(f"no generated shards in {str(data_dir)!r}")
    names = ("tokens", "length", "prompt_len", "hidden", "aux", "top1")
    parts = {k: [np.load(d / f"{k}.npy", mmap_mode="r") for d in shards] for k in names}
    return {k: (np.concatenate(v) if k in ("tokens", "length", "prompt_len", "top1") else v) for k, v in parts.items()}


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m specjax.train.selfgen --target DIR --out DIR``: stage 1 of ``train-head --corpus generated``."""
    import argparse

    from models.loading import load_hf_model, read_generation_eos
    from specjax.builtin import resolve_model

    p = argparse.ArgumentParser(prog="python -m specjax.train.selfgen", description=main.__doc__)
    p.add_argument("--target", required=True)
    p.add_argument("--out", required=True, help="shard directory (a rerun resumes)")
    p.add_argument("--aux-layers", required=True, help="comma-separated target layers whose outputs are kept")
    p.add_argument("--rows", type=int, default=GenConfig.num_rows)
    p.add_argument("--batch-size", type=int, default=GenConfig.batch_size)
    p.add_argument("--max-prompt-tokens", type=int, default=GenConfig.max_prompt_tokens)
    p.add_argument("--max-new-tokens", type=int, default=GenConfig.max_new_tokens)
    p.add_argument("--temperature", type=float, default=GenConfig.temperature)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    path = resolve_model(args.target)
    target = load_hf_model(path, "float32")
    cfg = GenConfig(num_rows=args.rows, batch_size=args.batch_size, max_prompt_tokens=args.max_prompt_tokens,
                    max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    train, _ = build_prompts()
    aux = tuple(int(i) for i in args.aux_layers.split(","))
    stats = generate_corpus(target, path, Path(args.out), cfg, aux_layer_ids=aux,
                            eos_ids=read_generation_eos(path, target[0]), prompts=train, progress=not args.no_progress)
    print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
