"""The offline API's inputs as vLLM's users write them: prompt dicts ({"prompt": text},
{"prompt_token_ids": ids}; other keys refused by name) and `LLM.chat` with OpenAI tools.

Engines over the arithmetic fake runner (no model): its tokens follow a formula
(`support.fake_engines.arithmetic`), and it honours the step's token mask, so a forced tool
call's grammar shapes its output. Oracles: the formula, jsonschema for the forced call's
arguments, the text a regex forces for "auto", and admission's `render_chat` for the
conversation's prompt."""

from __future__ import annotations

import itertools
import json

import jsonschema
import pytest
from support.fake_engines import arithmetic, bpe_engine, fake_engine

from jaxserve import LLM, SamplingParams
from jaxserve.serving.admission import render_chat

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
ASK = [{"role": "user", "content": "hello"}]
GREEDY = dict(temperature=0.0, ignore_eos=True)


def offline(engine) -> LLM:  # noqa: ANN001 - an Engine
    obj = LLM.__new__(LLM)  # LLM() loads a checkpoint; the facade's own code is what is used
    obj.engine = engine
    obj.config = engine.config
    obj._ids = itertools.count()
    return obj


@pytest.fixture(scope="module")
def words() -> LLM:
    return offline(fake_engine())


@pytest.fixture(scope="module")
def bpe() -> LLM:
    return offline(bpe_engine(max_model_len=1024))


def test_prompt_dicts_are_vllms_prompt_forms(words: LLM) -> None:
    params = SamplingParams(max_tokens=5, **GREEDY)
    outs = words.generate([{"prompt": "w5 w9"}, {"prompt_token_ids": [5, 9]}, "w5 w9",
                           [5, 9]], params, use_tqdm=False)
    for out in outs:
        assert out.prompt_token_ids == [5, 9]
        assert out.outputs[0].token_ids == arithmetic([5, 9], 5)
    assert [o.prompt for o in outs] == ["w5 w9", None, "w5 w9", None]
    [one] = words.generate({"prompt_token_ids": [7]}, params, use_tqdm=False)  # one dict
    assert one.outputs[0].token_ids == arithmetic([7], 5)


@pytest.mark.parametrize("prompt,message", [
    ({"prompt": "w5", "multi_modal_data": {"image": b""}},
     "prompts[1]['multi_modal_data'] is not supported (the served models take text only)"),
    ({"prompt_token_ids": [5], "mm_processor_kwargs": {}},
     "prompts[1]['mm_processor_kwargs'] is not supported"),
    ({"prompt": "w5", "multi_modal_uuids": {}}, "prompts[1]['multi_modal_uuids'] is not"),
    ({"prompt": "w5", "foo": 1}, "prompts[1]['foo'] is not supported (it is not a prompt"),
    ({"prompt": "w5", "prompt_token_ids": [5]}, "prompts[1] must hold exactly one of"),
    ({}, "prompts[1] must hold exactly one of"),
    ({"prompt": 5}, "prompts[1][\"prompt\"]=5 must be a string"),
    ({"prompt_token_ids": "w5"}, "prompts[1][\"prompt_token_ids\"]='w5' must be a list"),
])
def test_prompt_dict_keys_not_implemented_are_refused_by_name(words: LLM, prompt: dict,
                                                              message: str) -> None:
    with pytest.raises(ValueError) as e:
        words.generate(["w5", prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    assert str(e.value).startswith(message), str(e.value)
    assert not words.engine.has_unfinished()  # nothing was queued


def test_chat_forced_tool_call_is_parsed(bpe: LLM) -> None:
    [out] = bpe.chat(ASK, SamplingParams(max_tokens=60, seed=3), use_tqdm=False,
                     tools=[WEATHER, CLOCK],
                     tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = out.outputs[0]
    assert c.content is None and len(c.tool_calls) == 1, (c.text, c.tool_calls)
    call = c.tool_calls[0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]),
                        WEATHER["function"]["parameters"])
    assert json.loads(c.text) == json.loads(call["function"]["arguments"])  # the raw text


def test_chat_auto_reads_the_models_calls_and_renders_the_tools(bpe: LLM) -> None:
    text = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    regex = text.replace("{", r"\{").replace("}", r"\}")
    [out] = bpe.chat(ASK, SamplingParams(max_tokens=80, structured_outputs={"regex": regex},
                                         **GREEDY), use_tqdm=False, tools=[WEATHER, CLOCK])
    c = out.outputs[0]
    assert c.text == text and c.content is None
    assert [(t["function"]["name"], t["function"]["arguments"]) for t in c.tool_calls] == \
        [("get_time", "{}")]
    want = render_chat(ASK, bpe.tokenizer, tools=[WEATHER, CLOCK], limits=bpe.engine.limits)
    assert out.prompt_token_ids == want
    # tool_choice none: tools rendered, the output not read; no tools: not read either
    [plain] = bpe.chat(ASK, SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False,
                       tools=[WEATHER], tool_choice="none")
    assert plain.outputs[0].tool_calls is None and plain.outputs[0].content is None
    [bare] = bpe.chat(ASK, SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
    assert bare.prompt_token_ids == render_chat(ASK, bpe.tokenizer)


def test_chat_rendering_options_reach_the_template(bpe: LLM) -> None:
    template = "{% for m in messages %}[{{ m.content }}|{{ flavour }}]{% endfor %}"
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    [out] = bpe.chat(convo, SamplingParams(max_tokens=1), use_tqdm=False,
                     add_generation_prompt=False, chat_template=template,
                     chat_template_kwargs={"flavour": "x"}, continue_final_message=True)
    assert out.prompt_token_ids == render_chat(
        convo, bpe.tokenizer, False, chat_template=template,
        chat_template_kwargs={"flavour": "x"}, continue_final_message=True)
    assert bpe.tokenizer.decode(out.prompt_token_ids) == "[hi|x][ok"


@pytest.mark.parametrize("kw,message", [
    (dict(tools=[{"type": "function", "function": {"name": "a b"}}]),
     "tools[0].function.name must be"),
    (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice='sometimes' must be"),
    (dict(tools=[WEATHER], tool_choice="required",
          sampling_params=SamplingParams(structured_outputs={"regex": "a"})),
     "structured_outputs cannot be combined with tool_choice required"),
])
def test_chat_bad_tools_are_refused_by_name(bpe: LLM, kw: dict, message: str) -> None:
    with pytest.raises(ValueError) as e:
        bpe.chat(ASK, use_tqdm=False, **kw)
    assert str(e.value).startswith(message), str(e.value)
    assert not bpe.engine.has_unfinished()
