"""Chat template tests: our sandboxed renderer vs transformers' `apply_chat_template`.

The bundled SmolLM2 template and a few hand-written templates that exercise the HF-specific
environment (tojson options, namespace, loop controls, `tools`/`bos_token` variables) must render
byte-identically to transformers; invalid messages, `raise_exception` and sandbox escapes must
fail with a clear error.
"""

from __future__ import annotations

import jinja2.exceptions
import pytest

from jaxserve.models.bundled import bundled_model_path
from jaxserve.models.chat_template import (ChatTemplate, ChatTemplateError, render_chat_template,
                                           validate_messages)
from jaxserve.models.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

SYSTEM = {"role": "system", "content": "You are terse."}
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [SYSTEM, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Tell me a joke."},
     {"role": "assistant", "content": "Why did the chicken cross the road?"},
     {"role": "user", "content": "Why?"}],
    [SYSTEM, {"role": "user", "content": "héllo 👍 中文\n\ttabs  "},
     {"role": "assistant", "content": "  spaced  "}, {"role": "user", "content": ""}],
    [{"role": "user", "content": "quote \" and <|im_end|> inside"},
     {"role": "assistant", "content": "ok", "name": "bot"}],
]

CUSTOM_TEMPLATES = [
    # tojson with HF's options; non-ASCII must stay unescaped
    "{% for m in messages %}{{ m | tojson }}|{{ m | tojson(indent=2, sort_keys=True) }}\n{% endfor %}",
    # namespace, loop controls, bos/eos variables, whitespace control
    "{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}"
    "{% if m.role == 'system' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
    "  [{{ ns.n }}] {{ m.role }}: {{ m.content | trim }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}  [{{ ns.n + 1 }}] assistant:{% endif %}",
    # `tools` is defined-as-None in HF, not undefined: `is not none` must be false
    "{% if tools is not none %}TOOLS{% else %}NO TOOLS{% endif %}{% if documents is defined %} D{% endif %}"
    "{{ messages | length }}{{ messages[-1]['content'] | upper }}",
    # lstrip/trim blocks
    "{% for m in messages %}\n    {% if loop.first %}\n<first>\n    {% endif %}\n{{ m.content }}\n{% endfor %}",
]


@pytest.fixture(scope="module")
def bundled():
    return bundled_model_path()


@pytest.fixture(scope="module")
def ours(bundled) -> Tokenizer:
    return Tokenizer.from_gguf(bundled)


@pytest.fixture(scope="module")
def hf(bundled):
    from support.bundled_hf import bundled_hf_tokenizer  # transformers' reading of `bundled`

    return bundled_hf_tokenizer()


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen", [True, False])
def test_bundled_template_matches_transformers(ours, hf, conv, gen):
    msgs = CONVERSATIONS[conv]
    expect = hf.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
    assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == expect
    ids = ours.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True)
    assert ids == hf.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True,
                                         return_dict=False)


def test_default_adds_generation_prompt(ours):
    assert ours.apply_chat_template(CONVERSATIONS[0]).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("tpl", range(len(CUSTOM_TEMPLATES)))
def test_custom_templates_match_transformers(ours, hf, tpl):
    template = CUSTOM_TEMPLATES[tpl]
    for msgs in CONVERSATIONS:
        for gen in (True, False):
            expect = hf.apply_chat_template(msgs, chat_template=template, tokenize=False,
                                            add_generation_prompt=gen)
            got = render_chat_template(template, msgs, add_generation_prompt=gen,
                                       bos_token=ours.bos_token, eos_token=ours.eos_token,
                                       unk_token=ours.unk_token, pad_token=ours.pad_token)
            assert got == expect, (tpl, msgs, gen)


def test_strftime_now_and_extra_variables():
    out = render_chat_template("{{ strftime_now('%Y') }} {{ custom }}", [{"role": "user", "content": ""}],
                               custom={"k": [1, 2]})
    year, rest = out.split(" ", 1)
    assert year.isdigit() and len(year) == 4 and rest == "{'k': [1, 2]}"


@pytest.mark.parametrize("messages, match", [
    ("hello", "list"),
    ([], "empty"),
    (["hi"], r"messages\[0\]"),
    ([{"content": "x"}], r"messages\[0\].*'role'"),
    ([{"role": "user"}], r"messages\[0\].*'content'"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": 5}], r"messages\[1\]\.content"),
    ([{"role": 3, "content": "a"}], r"messages\[0\]\.role"),
    ([{"role": "user", "content": "a", "meta": object()}], r"messages\[0\]\.meta"),
])
def test_bad_messages(ours, messages, match):
    with pytest.raises(ValueError, match=match):
        ours.apply_chat_template(messages)
    with pytest.raises(ValueError, match=match):
        validate_messages(messages)


def test_raise_exception_is_value_error():
    template = ("{% if messages[0]['role'] != 'system' %}"
                "{{ raise_exception('first message must be system') }}{% endif %}ok")
    with pytest.raises(ValueError, match="first message must be system"):
        render_chat_template(template, [{"role": "user", "content": "x"}])
    assert render_chat_template(template, [SYSTEM]) == "ok"


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__ }}",
    "{{ cycler.__init__.__globals__ }}",
    "{% set ns = namespace() %}{% set ns.__dict__ = 1 %}",
    "{{ messages.append({'role': 'x'}) }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{{ raise_exception.__globals__ }}",
    "{{ (messages|first).items.__self__ }}",
])
def test_sandbox_escapes_are_blocked(template):
    msgs = [{"role": "user", "content": "x"}]
    try:
        out = render_chat_template(template, msgs)
    except jinja2.exceptions.SecurityError:
        return  # blocked outright (our ChatTemplateSecurityError is also a ValueError)
    # Otherwise it rendered without reaching anything: no class, function or globals leaked.
    assert "class" not in out and "function" not in out and "module" not in out, out
    assert msgs == [{"role": "user", "content": "x"}]


def test_template_errors_are_value_errors():
    with pytest.raises(ChatTemplateError, match="compile"):
        ChatTemplate("{% for x in %}")
    with pytest.raises(ChatTemplateError, match="render"):
        render_chat_template("{{ 1 + messages }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="empty"):
        ChatTemplate("")


def test_no_template(ours, tmp_path):
    ours.save(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
    bare = Tokenizer.from_hf_dir(tmp_path)
    assert bare.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template(CONVERSATIONS[0])
