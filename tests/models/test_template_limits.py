"""A request's chat template, bounded (models/template_limits.py via ChatTemplate(max_chars)).

Oracles: each template below asks, in a few dozen bytes, for a value or a prompt far past the
bound (or nests past jinja's recursive parser): it must fail with ChatTemplateError, before
the value is built, which tracemalloc's peak shows (a bound of 16 MiB, against the GBs the
templates ask for; what the checks let through is at most a few values of `LIMIT` characters,
4 bytes each, with the sandbox's own state). Templates that stay within the bound render
exactly as without it (the unbounded sandbox is the oracle), the bundled model's included.
"""

from __future__ import annotations

import tracemalloc

import pytest

from jaxserve.models.chat_template import ChatTemplate, ChatTemplateError
from jaxserve.models.template_limits import MAX_JSON_INDENT, chars

LIMIT = 100_000
PEAK_BYTES = 16 << 20
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo"},
            {"role": "assistant", "content": "hi", "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": {"a": [1, 2]}}}]}]

ATTACKS = {
    "nested-blocks": "{% if 1 %}" * 3000 + "x" + "{% endif %}" * 3000,
    "nested-parens": "{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}",
    "chained-filters": "{{ 'a'" + "|lower" * 5000 + " }}",
    "tojson-indent": "{{ messages|tojson(indent=10**8) }}",
    "center": "{{ 'x'|center(10**9) }}",
    "str-method-width": "{{ 'x'.ljust(10**9) }}",
    "repeat": "{{ 'x' * 10**9 }}",
    "list-repeat": "{{ ([1] * 10**9)|length }}",
    "percent-width": "{{ '%999999999s' % 'x' }}",
    "percent-star": "{{ '%*s' % (999999999, 'x') }}",
    "format-width": "{{ '{:>999999999}'.format('x') }}",
    "format-filter": "{{ '%999999999s'|format('x') }}",
    "replace-chain": "{{ 'aaaaaaaaaa'" + "|replace('a', 'aaaaaaaaaa')" * 12 + " }}",
    "namespace-doubling": "{% set ns = namespace(s='ab') %}{% for i in range(60) %}"
                          "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "output-loop": "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxx"
                   "{% endfor %}{% endfor %}",
    "join-separator": "{{ range(1000)|map('string')|join('x' * 5000) }}",
    "indent-lines": "{{ ('a\\n' * 20000)|indent(' ' * 5000) }}",
    "power": "{{ 10 ** 100000000 }}",
    "macro-recursion": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
}
WITHIN = [
    "{% for m in messages %}{{ m | tojson }}|{{ m | tojson(indent=4, sort_keys=True) }}\n"
    "{% endfor %}",
    "{% set ns = namespace(n=0, s='') %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{% set ns.s = ns.s ~ m.role %}[{{ ns.n }}] {{ m.content|center(12) }}{% endfor %}"
    "{{ ns.s }}{{ '%5s|%-4d' % ('ab', 7) }}{{ '{:>6}'.format('x') }}",
    "{{ messages|map(attribute='role')|join(', ') }} {{ 'abc'|replace('b', 'xyz') }} "
    "{{ ('l1\\nl2')|indent(2) }} {{ 'x' * 3 }} {{ 2 ** 10 }} {{ range(5)|list }}",
]


@pytest.mark.parametrize("source", ATTACKS.values(), ids=ATTACKS.keys())
def test_a_template_past_the_bound_fails_before_building_it(source: str) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(ChatTemplateError) as e:
            ChatTemplate(source, max_chars=LIMIT).render(MESSAGES)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < PEAK_BYTES, peak
    assert len(str(e.value)) < 400


@pytest.mark.parametrize("source", WITHIN)
def test_a_template_within_the_bound_renders_as_unbounded(source: str) -> None:
    assert ChatTemplate(source, max_chars=LIMIT).render(MESSAGES) == \
        ChatTemplate(source).render(MESSAGES)


def test_the_bundled_template_renders_the_same_bounded() -> None:
    from jaxserve.models.bundled import BundledModelMissing, bundled_model_path
    from jaxserve.models.tokenizer import Tokenizer

    try:
        tok = Tokenizer.from_gguf(bundled_model_path())
    except BundledModelMissing as e:
        pytest.skip(str(e))
    msgs = [m for m in MESSAGES if "tool_calls" not in m]
    want = tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert ChatTemplate(tok.chat_template, max_chars=LIMIT).render(
        msgs, True, tok.bos_token, tok.eos_token) == want


def test_the_bound_is_the_prompt_and_each_value() -> None:
    """Exactly at the bound passes, one past fails: the rendered text, and a value built
    inside the template that is never printed; tojson's indent stops at MAX_JSON_INDENT."""
    print_n = "{% for i in range(n) %}x{% endfor %}"  # printed piece by piece
    assert len(ChatTemplate(print_n, max_chars=50).render(MESSAGES, n=50)) == 50
    with pytest.raises(ChatTemplateError, match="rendered prompt is over 50 characters"):
        ChatTemplate(print_n, max_chars=50).render(MESSAGES, n=51)
    hidden = "{% set s = 'x' * n %}{{ s|length }}"
    assert ChatTemplate(hidden, max_chars=50).render(MESSAGES, n=50) == "50"
    with pytest.raises(ChatTemplateError, match="1 items x 51"):
        ChatTemplate(hidden, max_chars=50).render(MESSAGES, n=51)
    ChatTemplate(f"{{{{ messages|tojson(indent={MAX_JSON_INDENT}) }}}}",
                 max_chars=LIMIT).render(MESSAGES)
    with pytest.raises(ChatTemplateError, match="indent"):
        ChatTemplate(f"{{{{ messages|tojson(indent={MAX_JSON_INDENT + 1}) }}}}",
                     max_chars=LIMIT).render(MESSAGES)


def test_chars_counts_shared_references_and_stops_at_the_limit() -> None:
    s = "y" * 1000
    assert chars([s, {"k": s}], 10**9) == 1000 + 1 + 1000 + 1 + 2  # items, key, values
    assert chars([s] * 10**6, 5000) <= 5000 + 10**6 + 1000  # stopped early, not 10^9
