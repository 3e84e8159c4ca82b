"""Tool calling without a model: the output parsers (hermes, llama3_json, the forced shapes),
the request checks, the grammar of a forced call and the wire deltas.

Oracles: hand-written expected content and calls for each text; the same text fed whole and
in pieces of every small size (a stream's deltas must add up to the whole message); jsonschema
for the forced call's schema (instances written by hand, valid and not); the engine's own
grammar compiler (llguidance) for the schema checks. Fuzz (hypothesis, derandomized): texts
built from the markers, fed in random pieces, and random JSON in every tool field.
"""

from __future__ import annotations

import itertools
import json
import pathlib
import tempfile
from typing import Callable

import jsonschema
import pytest
from support.bpe_tokenizer import train_bpe_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st
from support.tiers import fuzz_examples

from jaxserve.engine.errors import InvalidRequest
from jaxserve.engine.grammar import GrammarCompiler
from jaxserve.engine.structured_outputs import StructuredOutputs
from jaxserve.server.openai_tools import delta, message
from jaxserve.serving import tool_prompt, tools
from jaxserve.serving.tool_parsers import (CallDelta, HermesParser, Llama3JsonParser,
                                           NamedParser, RequiredParser, ToolParser, assemble)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def parse(make: Callable[..., ToolParser], text: str, step: int = 0, **kw: object
          ) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) of `text` fed whole (step 0) or `step` characters at a
    time; checks the ids are distinct and each call's first event carries its name."""
    counter = itertools.count()
    p = make(new_id=lambda: f"call_{next(counter)}", **kw)
    pieces = [text] if not step else [text[i:i + step] for i in range(0, len(text), step)]
    events = [e for piece in pieces for e in p.feed(piece)] + p.finish()
    firsts = [e for e in events if isinstance(e, CallDelta) and e.id is not None]
    assert [e.index for e in firsts] == list(range(len(firsts)))
    content, calls = assemble(events)
    assert len({c["id"] for c in calls}) == len(calls) == p.calls
    return content, [(c["name"], c["arguments"]) for c in calls]


def check(make: Callable[..., ToolParser], text: str, want: tuple[str | None, list], **kw: object
          ) -> None:
    for step in (0, 1, 2, 3, 5, 11):
        assert parse(make, text, step, **kw) == want, (text, step)


HERMES_CASES = [
    ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
     '</tool_call>\n', ("Let me look.", [("get_weather", '{"city": "Paris"}')])),
    # two calls, text between and after; arguments given as JSON text; non-ASCII kept
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", '
     '"arguments": "{\\"q\\": \\"é\\"}"}</tool_call> done.',
     ("\n done.", [("a", "{}"), ("b", '{"q": "é"}')])),
    # malformed JSON, a call without a name, arguments not an object: all content, tags too
    ('x <tool_call>{"name": "f", "arguments": {</tool_call> y',
     ('x <tool_call>{"name": "f", "arguments": {</tool_call> y', [])),
    ('<tool_call>{"arguments": {}}</tool_call>', ('<tool_call>{"arguments": {}}</tool_call>', [])),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', [])),
    # no call: the text exactly, a marker's start included
    ("  plain text, <tool and <tool_cal  \n", ("  plain text, <tool and <tool_cal  \n", [])),
    # an unclosed call: a call when its JSON is complete, else content (cut by max_tokens)
    ('<tool_call>{"name": "f", "arguments": {"n": 1}}', (None, [("f", '{"n": 1}')])),
    ('ok <tool_call>{"name": "f", "argu', ('ok <tool_call>{"name": "f", "argu', [])),
    # a call whose name is not among the tools is still the model's call
    ('<tool_call>{"name": "nope", "parameters": {"a": 1}}</tool_call>',
     (None, [("nope", '{"a": 1}')])),
]


@pytest.mark.parametrize("text,want", HERMES_CASES)
def test_hermes(text: str, want: tuple) -> None:
    check(HermesParser, text, want)


def test_hermes_without_parallel_calls_keeps_the_first() -> None:
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    check(HermesParser, text, (None, [("a", '{"x": 1}')]), parallel=False)
    check(HermesParser, text, (None, [("a", '{"x": 1}'), ("b", "{}")]))


def test_max_tool_calls_keeps_the_first_that_many() -> None:
    """--max-tool-calls: an "auto" parser keeps the first N calls of the text (as
    parallel_tool_calls=false keeps the first one), and parallel false still means one."""
    text = "".join(f'<tool_call>{{"name": "f{i}", "arguments": {{}}}}</tool_call>'
                   for i in range(3))
    check(HermesParser, text, (None, [("f0", "{}"), ("f1", "{}")]), max_calls=2)
    check(HermesParser, text, (None, [("f0", "{}")]), parallel=False, max_calls=2)
    got = parse(lambda new_id: tools.parser(tools.check_tools([WEATHER], "auto", None, 1),
                                            "hermes", new_id), text, 3)
    assert got == (None, [("f0", "{}")])


LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}',
     (None, [("get_weather", '{"city": "Paris"}')])),
    # the python tag, brackets inside strings, ";"-separated calls, "arguments", text after
    ('<|python_tag|>{"name": "f", "parameters": {"s": "a}b{\\""}}; {"name": "g", '
     '"arguments": {}} thanks', ("thanks", [("f", '{"s": "a}b{\\""}'), ("g", "{}")])),
    ("\n  The answer is 4.  ", ("\n  The answer is 4.  ", [])),
    ("<|python_tag|>print(1)", ("<|python_tag|>print(1)", [])),
    ('{"not": "a call"} and more', ('{"not": "a call"} and more', [])),
    ('{"name": "f", "parameters": [1]}', ('{"name": "f", "parameters": [1]}', [])),
    ('{"name": "f", "parameters": {"a"', ('{"name": "f", "parameters": {"a"', [])),
    ('{"name": "f", "parameters": {}}; {"name": "g", "par',
     ('{"name": "g", "par', [("f", "{}")])),
    ("<|python_tag|>", ("<|python_tag|>", [])),
]


@pytest.mark.parametrize("text,want", LLAMA_CASES)
def test_llama3_json(text: str, want: tuple) -> None:
    check(Llama3JsonParser, text, want)


def test_named_function_streams_its_arguments() -> None:
    p = NamedParser("get_weather", new_id=lambda: "call_x")
    events = p.feed('{"city"') + p.feed(': "Paris"}') + p.finish()
    assert events == [CallDelta(0, '{"city"', "call_x", "get_weather"),
                      CallDelta(0, ': "Paris"}')]
    assert parse(lambda **kw: NamedParser("f", **kw), "") == (None, [("f", "")])


REQUIRED_CASES = [
    ('[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"y": [1, '
     '{"z": "}]"}]}}]', (None, [("a", '{"x": 1}'), ("b", '{"y": [1, {"z": "}]"}]}')])),
    ('[ {"name":"a","parameters":{}} ]', (None, [("a", "{}")])),
    # cut by max_tokens: the calls read so far, the last one's arguments cut too
    ('[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"y"',
     (None, [("a", '{"x": 1}'), ("b", '{"y"')])),
    # no call read: the text is the content
    ('[{"name": "a", "para', ('[{"name": "a", "para', [])),
    ("not json", ("not json", [])),
]


@pytest.mark.parametrize("text,want", REQUIRED_CASES)
def test_required(text: str, want: tuple) -> None:
    check(RequiredParser, text, want)


def test_required_streams_arguments_before_the_call_ends() -> None:
    p = RequiredParser(new_id=lambda: "call_0")
    first = p.feed('[{"name": "get_weather", "parameters": {"ci')
    assert first == [CallDelta(0, "", "call_0", "get_weather"), CallDelta(0, '{"ci')]
    assert p.feed('ty": "Oslo"}}]') + p.finish() == [CallDelta(0, 'ty": "Oslo"}')]


def test_wire_message_and_deltas() -> None:
    events = [" Hi", CallDelta(0, "", "call_a", "f"), CallDelta(0, '{"x"'),
              CallDelta(0, ": 1}"), CallDelta(1, "{}", "call_b", "g")]
    assert delta(events) == {"content": " Hi", "tool_calls": [
        {"index": 0, "id": "call_a", "type": "function",
         "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"index": 1, "id": "call_b", "type": "function",
         "function": {"name": "g", "arguments": "{}"}}]}
    assert delta([CallDelta(1, "]")]) == {"tool_calls": [{"index": 1,
                                                          "function": {"arguments": "]"}}]}
    assert delta([]) == {}
    msg = message(HermesParser(new_id=lambda: "call_z"),
                  '<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert msg == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_z", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    assert message(HermesParser(), "just text")["content"] == "just text"
    assert "tool_calls" not in message(HermesParser(), "just text")
    assert isinstance(tools.parser(tools.check_tools([TIME]), "hermes"), HermesParser)
    assert isinstance(tools.parser(tools.check_tools([TIME]), "llama3_json"), Llama3JsonParser)
    assert isinstance(tools.parser(tools.check_tools([TIME], "required"), "hermes"),
                      RequiredParser)
    assert tools.parser(tools.check_tools([TIME], "none"), "hermes") is None
    assert tools.parser(None, "hermes") is None


# ----------------------------------------------------------------------------- requests
BAD = [
    (dict(tools={"type": "function"}), "tools"),
    (dict(tools=[{"type": "function"}]), "tools[0].function"),
    (dict(tools=[{"function": {"name": "f"}}]), "tools[0]"),
    (dict(tools=[WEATHER, {"type": "function", "function": {"description": "x"}}]),
     "tools[1].function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "has space"}}]),
     "tools[0].function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "x" * 65}}]),
     "tools[0].function.name"),
    (dict(tools=[WEATHER, TIME, WEATHER]), "tools[2].function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": [1]}}]),
     "tools[0].function.parameters"),
    (dict(tools=[{"type": "function", "function": {"name": "f",
                                                    "parameters": {"type": "string"}}}]),
     "tools[0].function.parameters"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "description": 3}}]),
     "tools[0].function.description"),
    (dict(tools=[TIME] * 129), "tools"),
    (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice"),
    (dict(tools=[WEATHER], tool_choice={"type": "function"}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[], tool_choice={"type": "function", "function": {"name": "get_time"}}),
     "tool_choice"),
    (dict(tools=[WEATHER], parallel_tool_calls="no"), "parallel_tool_calls"),
]


@pytest.mark.parametrize("kwargs,field", BAD)
def test_bad_tools_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        tools.check_tools(kwargs.get("tools"), kwargs.get("tool_choice"),
                          kwargs.get("parallel_tool_calls"))
    assert e.value.field == field
    assert str(e.value).startswith(field)


def test_good_tools() -> None:
    assert tools.check_tools(None) is None and tools.check_tools([], "auto") is None
    req = tools.check_tools([WEATHER, {**TIME, "extra": 1}], None, False)
    assert req is not None and req.names == ("get_weather", "get_time")
    assert (req.choice, req.function, req.parallel) == ("auto", None, False)
    assert req.tools[1] == {"type": "function", "function": {"name": "get_time"}}
    named = tools.check_tools([WEATHER, TIME], {"type": "function",
                                                "function": {"name": "get_time"}})
    assert (named.choice, named.function, named.parallel) == ("function", "get_time", True)
    assert tools.check_tools([WEATHER], "none").choice == "none"
    assert not tools.parses(tools.check_tools([WEATHER], "none"))


def test_named_function_grammar_is_its_parameters() -> None:
    req = tools.check_tools([WEATHER, TIME], {"type": "function",
                                              "function": {"name": "get_weather"}})
    spec, names = tools.guide(req)
    schema = spec["json"]
    jsonschema.validate({"city": "Oslo", "unit": "c"}, schema)
    for bad in ({"unit": "c"}, {"city": "Oslo", "wind": 3}, [1]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert names["structured_outputs.json"] == "tools[0].function.parameters"
    # a function without parameters takes exactly {}
    spec, names = tools.guide(tools.check_tools(
        [WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}))
    jsonschema.validate({}, spec["json"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"a": 1}, spec["json"])
    assert names["structured_outputs.json"] == "tools[1].function.parameters"
    assert tools.guide(tools.check_tools([WEATHER])) == (None, {})
    assert tools.guide(None) == (None, {})


def test_required_grammar_is_a_list_of_calls() -> None:
    for parallel in (True, False):
        spec, names = tools.guide(tools.check_tools([WEATHER, TIME], "required", parallel))
        schema = spec["json"]
        one = {"name": "get_weather", "parameters": {"city": "Rome"}}
        jsonschema.validate([one], schema)
        bad = [[], [{"name": "get_weather", "parameters": {}}],
               [{"name": "other", "parameters": {}}], [{"name": "get_time"}],
               [{"name": "get_time", "parameters": {}, "x": 1}]]
        for instance in bad:
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(instance, schema)
        two = [one, {"name": "get_time", "parameters": {}}]
        if parallel:
            jsonschema.validate(two, schema)
        else:
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(two, schema)
        assert names["structured_outputs.json"] == "tools"


def test_max_tool_calls_bounds_the_required_array() -> None:
    one = {"name": "get_time", "parameters": {}}
    for parallel, limit in ((True, 2), (False, 1)):
        req = tools.check_tools([WEATHER, TIME], "required", parallel, max_calls=2)
        assert req.call_limit == limit
        schema = tools.guide(req)[0]["json"]
        jsonschema.validate([one] * limit, schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([one] * (limit + 1), schema)
    assert "maxItems" not in tools.guide(tools.check_tools([TIME], "required"))[0]["json"]


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tok = train_bpe_tokenizer(pathlib.Path(tempfile.mkdtemp(prefix="jaxserve-bpe-")))
    return GrammarCompiler(tok, tok.vocab_size)


def test_schemas_are_checked_by_the_grammar_compiler(compiler: GrammarCompiler) -> None:
    broken = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}
    good = tools.check_tools([WEATHER, TIME]).tools
    tools.check_schemas(good, compiler.compile)  # no error
    with pytest.raises(InvalidRequest) as e:
        tools.check_schemas(tools.check_tools([WEATHER, broken]).tools, compiler.compile)
    assert e.value.field == "tools[1].function.parameters"
    assert str(e.value).startswith("tools[1].function.parameters") and "strin" in str(e.value)
    # the forced grammars compile (compact JSON: llguidance's x-guidance options)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        spec, _ = tools.guide(tools.check_tools([WEATHER, TIME], choice))
        compiler.compile(StructuredOutputs(json=spec["json"]))
    assert json.loads(json.dumps(spec))  # plain JSON, as the wire carries it


BOOK = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "$defs": {
        "City": {"enum": ["Oslo", "Lima"]},
        "Leg": {"type": "object", "properties": {"to": {"$ref": "#/$defs/City"},
                                                 "next": {"$ref": "#/$defs/Leg"}},
                "required": ["to"], "additionalProperties": False}},
    "properties": {"leg": {"$ref": "#/$defs/Leg"}, "const": {"const": {"$ref": "#/x"}}},
    "required": ["leg"], "additionalProperties": False}}}
COUNT = {"type": "function", "function": {"name": "count", "parameters": {
    "type": "object", "definitions": {"N": {"type": "integer", "minimum": 0}},
    "properties": {"n": {"$ref": "#/definitions/N"}}, "required": ["n"]}}}


@pytest.mark.parametrize("listed", [[BOOK], [BOOK, COUNT]], ids=["one", "two"])
def test_required_grammar_keeps_each_tools_refs(compiler, listed) -> None:
    """A tool's `$ref`s point into its own parameters' `$defs`; nested in the array's
    items they must still resolve there (they were resolved against the array: "Pointer
    '/$defs/City' does not exist"). Oracle: jsonschema resolving the built schema's refs, and
    the grammar compiling; data under `const` keeps its "$ref" key as it is."""
    spec, _ = tools.guide(tools.check_tools(listed, "required"))
    schema = spec["json"]
    good = [{"name": "book", "parameters": {"leg": {"to": "Oslo", "next": {"to": "Lima"}},
                                            "const": {"$ref": "#/x"}}}]
    jsonschema.validate(good, schema)
    for bad in ({"to": "Rome"}, {"to": "Oslo", "next": {"to": 3}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([{"name": "book", "parameters": {"leg": bad}}], schema)
    if len(listed) == 2:
        jsonschema.validate([{"name": "count", "parameters": {"n": 2}}], schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([{"name": "count", "parameters": {"n": -1}}], schema)
    compiler.compile(StructuredOutputs(**spec))


def test_forced_call_refuses_another_structured_output() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        with pytest.raises(InvalidRequest) as e:
            tools.guide(tools.check_tools([WEATHER], choice), "response_format")
        assert e.value.field == "response_format"
        assert str(e.value).startswith("response_format cannot be combined")
    assert tools.guide(tools.check_tools([WEATHER], "auto"), "response_format") == (None, {})


# ----------------------------------------------------------------------------- fuzz
# Texts made of the pieces the parsers look for, in any order: a parser never raises, and
# the text fed in any pieces reads as the text fed whole.
_PIECES = st.sampled_from(["<tool_call>", "</tool_call>", "<tool_", "<|python_tag|>",
                           '{"name": "f", "arguments": {"a": 1}}',
                           '{"name": "g", "parameters": {}}', '{"name": "f", "parameters":',
                           '{"a": "}"}', "{", "}", "[", "]", ";", ",", '"', "\\", " ", "\n",
                           "x", "é"])
_PARSERS = [HermesParser, Llama3JsonParser, RequiredParser,
            lambda **kw: NamedParser("f", **kw)]


@settings(max_examples=fuzz_examples(200), derandomize=True, deadline=None)
@given(st.lists(_PIECES, max_size=12), st.lists(st.integers(1, 40), max_size=8),
       st.sampled_from(range(len(_PARSERS))))
def test_parsers_never_raise_and_read_pieces_alike(pieces: list[str], cuts: list[int],
                                                   which: int) -> None:
    text = "".join(pieces)
    counter = itertools.count()
    p = _PARSERS[which](new_id=lambda: f"call_{next(counter)}")
    events, at = [], 0
    for n in cuts:
        events += p.feed(text[at:at + n])
        at += n
    events += p.feed(text[at:]) + p.finish()
    content, calls = assemble(events)
    pairs = [(c["name"], c["arguments"]) for c in calls]
    assert (content, pairs) == parse(_PARSERS[which], text)
    if not calls:  # no call: the text is the content, exactly
        assert content == text
    if isinstance(p, NamedParser):
        assert pairs == [("f", text)]


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=3) |
                     st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8)
_NAMES = st.sampled_from(["f", "g", "bad name", ""]) | st.text(max_size=3)
_TOOL = st.fixed_dictionaries({"type": st.sampled_from(["function", "x"]) | _JSON,
                               "function": st.fixed_dictionaries(
                                   {"name": _NAMES | _JSON},
                                   optional={"parameters": st.just({"type": "object"}) | _JSON,
                                             "description": _JSON})}) | _JSON


@settings(max_examples=fuzz_examples(120), derandomize=True, deadline=None)
@given(st.lists(_TOOL, max_size=3) | _JSON,
       st.sampled_from(["auto", "none", "required", {"type": "function",
                                                     "function": {"name": "f"}}]) | _JSON,
       st.booleans() | _JSON, _JSON)
def test_any_tools_are_accepted_or_refused_by_name(tools_: object, choice: object,
                                                   parallel: object, args: object) -> None:
    """Any JSON in the tool fields (and in an assistant call's arguments): a ToolRequest or
    an InvalidRequest naming a field, never another error."""
    try:
        req = tools.check_tools(tools_, choice, parallel)
    except InvalidRequest as e:
        assert e.field and str(e).startswith(e.field.split("[")[0])
        return
    tools.guide(req)
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [call]}]
    for fmt in ("hermes", "llama3_json"):
        try:
            tool_prompt.prepare(msgs, req.tools if req else None, None, fmt)
        except InvalidRequest as e:
            assert e.field == "messages"


_ARGS = st.dictionaries(st.text(max_size=4), _JSON, max_size=3)
_CALLS = st.lists(st.tuples(st.sampled_from(["f", "get_time"]), _ARGS), min_size=1, max_size=3)
_SPACING = st.sampled_from([(None, None), (None, (",", ":")), (1, None), (2, (", ", ": "))])


@settings(max_examples=fuzz_examples(60), derandomize=True, deadline=None)
@given(_CALLS, _SPACING, st.lists(st.integers(1, 9), max_size=12), st.booleans())
def test_written_calls_read_back(calls: list, spacing: tuple, cuts: list[int],
                                 prose: bool) -> None:
    """Calls written the way each format writes them (json.dumps with any spacing), fed in
    random pieces, read back as the same names and arguments."""
    indent, seps = spacing

    def dumps(value: object) -> str:
        return json.dumps(value, indent=indent, separators=seps, ensure_ascii=False)

    texts = {
        RequiredParser: dumps([{"name": n, "parameters": a} for n, a in calls]),
        HermesParser: "".join(("Let me see. " if prose else "") + "<tool_call>\n"
                              + dumps({"name": n, "arguments": a}) + "\n</tool_call>\n"
                              for n, a in calls),
        Llama3JsonParser: "; ".join(dumps({"name": n, "parameters": a}) for n, a in calls),
    }
    for make, text in texts.items():
        p = make()
        events, at = [], 0
        for n in cuts:
            events += p.feed(text[at:at + n])
            at += n
        content, got = assemble(events + p.feed(text[at:]) + p.finish())
        assert [(c["name"], json.loads(c["arguments"])) for c in got] == calls, make
        if prose and make is HermesParser:  # the text around the calls, stripped at the end
            assert content == ("Let me see. " + "\nLet me see. " * (len(calls) - 1)).rstrip()
        else:
            assert content is None, (make, content)
