"""Chat messages -> one prompt string with the model's chat template (shared by ``specjax batch`` and ``LLM.chat``).

API::

    template = ChatTemplate.for_model("/models/qwen3-8b")      # a model / tokenizer directory or a GGUF file
    text = template.render([{"role": "user", "content": "hi"}])  # add_generation_prompt=True by default
    ids = tokenizer.encode(text, add_special_tokens=template.add_special_tokens).ids

The template is the model's jinja template (``chat_template.jinja``, else
``chat_template`` in ``tokenizer_config.json``; a GGUF file's
``tokenizer.chat_template``), rendered the way transformers'
``apply_chat_template`` renders it: a sandboxed jinja2 environment with
``trim_blocks``/``lstrip_blocks``, loop controls, ``raise_exception``,
``strftime_now`` and a ``tojson`` that keeps non-ASCII text. The rendered text
already holds the template's special tokens (BOS etc.), so it is tokenized with
``add_special_tokens=False``. A directory without a template (the stdlib pair
is a code model) gets :func:`render_simple_chat`: one ``role: content`` line per
message, then ``assistant:``; that text is tokenized with special tokens.

Messages are a non-empty list of ``{"role": str, "content": str | [{"type": "text", "text": str}, ...]}``
(OpenAI's text content parts are joined); other keys of a message (``name``, ...)
are passed to the template as they are. Every problem is a ``ValueError`` naming
the field (``messages[2].content``), including text that is not valid Unicode
(a lone UTF-16 surrogate such as ``"\\ud800"`` from a JSON escape) and a template
that fails on the messages (``messages: the chat template failed: ...``).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specjax.prompts import check_unicode, short_repr

__all__ = ["ChatTemplate", "render_simple_chat", "validate_messages"]


def validate_messages(messages: Any, field: str = "messages") -> list[dict[str, Any]]:
    """Messages checked and normalized (content parts joined to one string); ValueError naming the field."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"{field} must be a non-empty list of messages, got {short_repr(messages)}")
    out = []
    for i, m in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(m, Mapping):
            raise ValueError(f"{where} must be an object with 'role' and 'content', got {short_repr(m)}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where}.role must be a non-empty string, got {short_repr(role)}")
        check_unicode(role, f"{where}.role")
        if isinstance(content, (list, tuple)):  # OpenAI content parts: only text is supported
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(
                        f"{where}.content[{j}] must be {{'type': 'text', 'text': str}}, got {short_repr(part)}"
                    )
                texts.append(check_unicode(part["text"], f"{where}.content[{j}].text"))
            content = "".join(texts)
        if not isinstance(content, str):
            raise ValueError(f"{where}.content must be a string or a list of text parts, got {short_repr(content)}")
        check_unicode(content, f"{where}.content")
        extra = {}
        for key, value in m.items():
            if key in ("role", "content"):
                continue
            if not isinstance(key, str):
                raise ValueError(f"{where} has a key that is not a string: {short_repr(key)}")
            check_unicode(key, f"{where} key")
            if isinstance(value, str):
                check_unicode(value, f"{where}.{key}")
            extra[key] = value
        out.append({**extra, "role": role, "content": content})
    return out


def render_simple_chat(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
    """``role: content`` per line, then ``assistant:``: the fallback for tokenizers without a template.

    ``messages`` must already be validated (:func:`validate_messages`).
    """
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + "assistant:" if add_generation_prompt else text


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatTemplate:
    """A tokenizer's jinja chat template, or (``source=None``) :func:`render_simple_chat`."""

    source: str | None = None
    """The jinja source; None for the simple ``role: content`` rendering."""
    bos_token: str = ""
    """Passed to the template as ``bos_token`` (from tokenizer_config.json)."""
    eos_token: str = ""
    """Passed to the template as ``eos_token``."""

    def __post_init__(self) -> None:
        for name in ("bos_token", "eos_token"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a str, got {type(getattr(self, name)).__name__}")
        if self.source is not None and not isinstance(self.source, str):
            raise ValueError(f"source must be a str or None, got {type(self.source).__name__}")

    @property
    def add_special_tokens(self) -> bool:
        """Whether the rendered text is tokenized with special tokens: a real template writes its own BOS."""
        return self.source is None

    @classmethod
    def for_model(cls, path: str | os.PathLike) -> "ChatTemplate":
        """The chat template of a model: a Hugging Face model or tokenizer directory, or a GGUF file.

        Read by :func:`models.loading.read_chat_template` (``chat_template.jinja``, else
        ``tokenizer_config.json``'s; a GGUF file's ``tokenizer.chat_template``), with the BOS / EOS
        token strings the template may print. No template: the simple rendering. ValueError naming
        the path when the template is not a string or does not compile.
        """
        from models.loading import read_chat_template  # imports jax: only once a chat template is wanted

        try:
            source = read_chat_template(path)
            bos, eos = _special_tokens(path)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{os.fspath(path)}: cannot read the chat template: {exc}") from None
        template = cls(source=source or None, bos_token=bos, eos_token=eos)
        if template.source is not None:
            try:
                _compiled_template(template.source)  # fail here, not at the first chat request
            except ImportError as exc:
                raise ValueError(f"{os.fspath(path)}: rendering chat templates needs jinja2 ({exc})") from None
            except Exception as exc:  # noqa: BLE001 - jinja's TemplateSyntaxError and friends
                raise ValueError(
                    f"{os.fspath(path)}: the chat template does not compile: {type(exc).__name__}: {exc}"
                ) from None
        return template

    def render(self, messages: Any, add_generation_prompt: bool = True, *, field: str = "messages") -> str:
        """One prompt string for ``messages`` (validated first); ValueError naming ``field`` for any problem."""
        if not isinstance(add_generation_prompt, bool):
            raise ValueError(f"add_generation_prompt must be a bool, got {short_repr(add_generation_prompt)}")
        messages = validate_messages(messages, field)
        if self.source is None:
            return render_simple_chat(messages, add_generation_prompt)
        try:
            text = _compiled_template(self.source).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token,
            )
        except Exception as exc:  # noqa: BLE001 - whatever the template raises is this request's problem
            raise ValueError(f"{field}: the chat template failed: {type(exc).__name__}: {exc}") from None
        return check_unicode(text, f"{field} (as rendered by the chat template)")


def _special_tokens(path: str | os.PathLike) -> tuple[str, str]:
    """(bos, eos) token strings of a model, "" where it names none."""
    from models.gguf import is_gguf_file, open_gguf

    if is_gguf_file(path):
        f = open_gguf(path)
        tokens = f.get("tokenizer.ggml.tokens") or []

        def token(key: str) -> str:
            i = f.get(key)
            return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else ""

        return token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
    config_file = Path(path) / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}

    def token(name: str) -> str:
        value = config.get(name) if isinstance(config, dict) else None
        if isinstance(value, dict):
            value = value.get("content")
        return value if isinstance(value, str) else ""

    return token("bos_token"), token("eos_token")


def _tojson(value, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' filter: keeps non-ASCII text as it is (jinja's own escapes HTML characters).
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _raise_exception(message) -> None:
    raise ValueError(f"chat template: {message}")


@functools.lru_cache(maxsize=4)
def _compiled_template(source: str):
    """A sandboxed jinja2 template, set up as transformers' ``apply_chat_template`` sets it up."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
