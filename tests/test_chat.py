"""specjax.chat: chat templates rendered as transformers renders them, messages validated by field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import specjax
from specjax.chat import ChatTemplate, render_simple_chat, validate_messages
from tiny_models import SMOLLM2_MISSING, smollm2_gguf

BUILTIN_TARGET = Path(specjax.__file__).parent / "builtin" / "target"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo <b>&"}]

# Exercises what real templates use: loop controls, tojson on non-ASCII, raise_exception, extra message keys.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}{% if m.name is defined %}({{ m.name }}){% endif %}"
    "{{ m['content'] | tojson }}{{ eos_token }}\n"
    "{% if loop.index == 5 %}{% break %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _tokenizer_dir(path: Path, template: str | None = TEMPLATE, *, as_file: bool = False) -> Path:
    shutil.copy(BUILTIN_TARGET / "tokenizer.json", path / "tokenizer.json")
    config = json.loads((BUILTIN_TARGET / "tokenizer_config.json").read_text())
    if template is not None and not as_file:
        config["chat_template"] = template
    elif template is not None:
        (path / "chat_template.jinja").write_text(template)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_without_a_template_the_simple_rendering_applies():
    t = ChatTemplate.for_model(BUILTIN_TARGET)
    assert t.source is None and t.add_special_tokens
    assert t.render(MESSAGES) == "system: be brief\nuser: héllo <b>&\nassistant:"
    assert t.render(MESSAGES, add_generation_prompt=False) == "system: be brief\nuser: héllo <b>&\n"
    assert render_simple_chat(MESSAGES) == t.render(MESSAGES)


@pytest.mark.parametrize("as_file", [False, True])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_rendering_matches_transformers_apply_chat_template(tmp_path, as_file, generation_prompt):
    transformers = pytest.importorskip("transformers")
    d = _tokenizer_dir(tmp_path, as_file=as_file)
    messages = [*MESSAGES, {"role": "user", "content": "ünïcode ✓", "name": "bob"}] * 2
    t = ChatTemplate.for_model(d)
    assert not t.add_special_tokens and (t.bos_token, t.eos_token) == ("<|bos|>", "<|endoftext|>")
    reference = transformers.AutoTokenizer.from_pretrained(str(d)).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt)
    got = t.render(messages, add_generation_prompt=generation_prompt)
    assert got == reference
    assert got.count("<|user|>") == 3  # {% break %} after the fifth message
    assert '"ünïcode ✓"' in got and '"héllo <b>&"' in got  # tojson keeps text as it is, like transformers'


def test_chat_template_jinja_wins_and_named_templates(tmp_path):
    d = _tokenizer_dir(tmp_path, template="config{{ messages[0].content }}")
    (d / "chat_template.jinja").write_text("file{{ messages[0].content }}")
    assert ChatTemplate.for_model(d).render(MESSAGES) == "filebe brief"
    (d / "chat_template.jinja").unlink()
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "dflt"}]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate.for_model(d).render(MESSAGES) == "dflt"


def test_broken_templates_fail_at_load_or_render_by_name(tmp_path):
    d = _tokenizer_dir(tmp_path, template="{% for m in messages %}")
    with pytest.raises(ValueError, match=r"the chat template does not compile: TemplateSyntaxError"):
        ChatTemplate.for_model(d)
    d = _tokenizer_dir(tmp_path, template=42)
    with pytest.raises(ValueError, match="chat_template must be a string"):
        ChatTemplate.for_model(d)
    t = ChatTemplate.for_model(_tokenizer_dir(tmp_path))
    with pytest.raises(ValueError, match=r"^body\.messages: the chat template failed: ValueError: chat template: "
                                         r"no tools here"):
        t.render([{"role": "tool", "content": "x"}], field="body.messages")
    with pytest.raises(ValueError, match=r"^messages: the chat template failed: UndefinedError"):
        ChatTemplate(source="{{ messages.nope.deeper }}").render(MESSAGES)
    with pytest.raises(ValueError, match="add_generation_prompt must be a bool"):
        t.render(MESSAGES, add_generation_prompt="yes")


@pytest.mark.parametrize("messages,message", [
    ([], r"^messages must be a non-empty list of messages"),
    ("hi", r"^messages must be a non-empty list of messages, got 'hi'"),
    (["hi"], r"^messages\[0\] must be an object with 'role' and 'content'"),
    ([{"role": "user"}], r"^messages\[0\]\.content must be a string or a list of text parts, got None"),
    ([{"content": "x"}], r"^messages\[0\]\.role must be a non-empty string"),
    ([{"role": "", "content": "x"}], r"^messages\[0\]\.role must be a non-empty string"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], r"^messages\[0\]\.content\[0\] must be \{'type'"),
    ([{"role": "user", "content": "a\udc80"}], r"^messages\[0\]\.content is not valid Unicode: lone surrogate U\+DC80"),
    ([{"role": "us\ud800", "content": "a"}], r"^messages\[0\]\.role is not valid Unicode"),
    ([{"role": "u", "content": [{"type": "text", "text": "\udfff"}]}],
     r"^messages\[0\]\.content\[0\]\.text is not valid Unicode"),
    ([{"role": "u", "content": "x", "name": "\ud800"}], r"^messages\[0\]\.name is not valid Unicode"),
    ([{"role": "u", "content": "x", 3: "y"}], r"^messages\[0\] has a key that is not a string: 3"),
])
def test_messages_are_validated_by_field(messages, message):
    with pytest.raises(ValueError, match=message):
        validate_messages(messages)


def test_content_parts_are_joined_and_extra_keys_kept():
    out = validate_messages([{"role": "user", "name": "bob",
                              "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}])
    assert out == [{"role": "user", "name": "bob", "content": "hello"}]


SMOLLM2_GGUF = smollm2_gguf()


@pytest.mark.skipif(SMOLLM2_GGUF is None, reason=SMOLLM2_MISSING)
def test_a_real_models_template_from_its_gguf_file_matches_transformers():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    t = ChatTemplate.for_model(SMOLLM2_GGUF)
    assert (t.bos_token, t.eos_token) == ("<|im_start|>", "<|im_end|>") and not t.add_special_tokens
    tok = transformers.AutoTokenizer.from_pretrained(str(SMOLLM2_GGUF.parent), gguf_file=SMOLLM2_GGUF.name)
    for messages in (MESSAGES, MESSAGES[1:]):  # without a system message the template adds its own
        for generation_prompt in (True, False):
            assert t.render(messages, add_generation_prompt=generation_prompt) == tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt)


# --------------------------------------------------------------------------- LLM.chat


@pytest.fixture(scope="module")
def chat_llm(tmp_path_factory):
    """The shipped target with a tokenizer directory that holds TEMPLATE."""
    tok_dir = _tokenizer_dir(tmp_path_factory.mktemp("tok"))
    return specjax.LLM("builtin:target", tokenizer=tok_dir, warmup=False, max_model_len=128, max_num_seqs=2,
                       max_prefill_chunk=64, query_buckets=(1, 64)), tok_dir


def test_llm_chat_is_generate_on_the_rendered_template(chat_llm):
    llm, tok_dir = chat_llm
    assert llm.get_tokenizer() is llm.tokenizer
    params = specjax.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    text = ChatTemplate.for_model(tok_dir).render(MESSAGES)
    ids = llm.tokenizer.encode(text, add_special_tokens=False).ids
    expected = llm.generate({"prompt_token_ids": ids}, params)[0]
    got = llm.chat(MESSAGES, params)
    assert len(got) == 1 and got[0].outputs[0].token_ids == expected.outputs[0].token_ids
    assert got[0].prompt_token_ids == ids and got[0].prompt == llm.tokenizer.decode(ids, skip_special_tokens=False)
    # A list of conversations: one output each, in order.
    two = llm.chat([MESSAGES, MESSAGES[1:]], params)
    assert [o.outputs[0].token_ids for o in two][0] == expected.outputs[0].token_ids and len(two) == 2


def test_llm_chat_rejects_bad_messages_by_field(chat_llm):
    llm, _ = chat_llm
    with pytest.raises(ValueError, match=r"messages\[0\]\.role"):
        llm.chat([{"role": "", "content": "x"}])
    with pytest.raises(ValueError, match=r"messages\[1\]\[0\]\.content"):
        llm.chat([MESSAGES, [{"role": "user", "content": "\ud800"}]])
    with pytest.raises(ValueError, match="messages"):
        llm.chat([])


def test_cli_generate_chat_sends_each_prompt_as_a_user_message(chat_llm, tmp_path, capsys):
    import specjax.cli

    llm, _ = chat_llm
    model_dir = _tokenizer_dir(tmp_path)  # the shipped target's weights beside the templated tokenizer
    for name in ("config.json", "model.safetensors"):
        shutil.copy(BUILTIN_TARGET / name, model_dir / name)
    params = specjax.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    expected = [llm.chat([{"role": "user", "content": p}], params)[0].outputs[0].text for p in ("hi", "def f(x):")]
    rc = specjax.cli.main(["generate", "--model", str(model_dir), "--chat", "--prompt", "hi", "--prompt", "def f(x):",
                           "--max-tokens", "5", "--ignore-eos", "--max-model-len", "128", "--no-warmup"])
    assert rc == 0
    assert capsys.readouterr().out == "".join(text + "\n" for text in expected)
    rc = specjax.cli.main(["generate", "--model", str(model_dir), "--chat", "--prompt-token-ids", "1,2"])
    assert rc == 2 and "--chat renders text prompts" in capsys.readouterr().err
