"""Tools and tool turns rendered through chat templates (admission's `render_chat`).

Templates written here in the shape of the two families the served formats come from (a
Qwen2/2.5-like hermes template, a Llama-3.1-like JSON template) and one without tool support
(the bundled SmolLM2's, when installed, and a plain ChatML one like it). The tokenizer is the
byte-level BPE of the structured-output tests, so a prompt's ids decode back to its text.
Oracles: the full prompt text written out by hand for each template, and the OpenAI tool
objects as json.dumps writes them.
"""

from __future__ import annotations

import json
import pathlib
import tempfile

import pytest
from support.bpe_tokenizer import train_bpe_tokenizer
from support.chat_templates import LLAMA31_LIKE, QWEN_LIKE

from jaxserve.engine.errors import InvalidRequest
from jaxserve.engine.limits import EngineLimits
from jaxserve.models.tokenizer import Tokenizer
from jaxserve.server.config import ServerConfig
from jaxserve.serving import tool_prompt, tools
from jaxserve.serving.admission import Admission, render_chat

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = tools.check_tools([WEATHER, TIME]).tools
# A follow-up: the model called a function, the client sends its result back.
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
FOLLOW_UP = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [CALL]},
             {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"}]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_bpe_tokenizer(pathlib.Path(tempfile.mkdtemp(prefix="jaxserve-bpe-")))


def text_of(tok: Tokenizer, messages: list, template: str, **kw: object) -> str:
    ids = render_chat(messages, tok, chat_template=template, **kw)
    return tok.decode(ids, skip_special_tokens=False)


def test_formats_detected_from_the_template() -> None:
    assert tool_prompt.detect_format(QWEN_LIKE) == "hermes"
    assert tool_prompt.detect_format(LLAMA31_LIKE) == "llama3_json"
    assert tool_prompt.detect_format(CHATML) == "hermes"
    assert tool_prompt.detect_format(None) == "hermes"
    assert tool_prompt.resolve_format("llama3_json", QWEN_LIKE) == "llama3_json"
    assert tool_prompt.resolve_format("auto", LLAMA31_LIKE) == "llama3_json"
    with pytest.raises(ValueError):
        tool_prompt.resolve_format("mistral", QWEN_LIKE)
    assert tool_prompt.renders_tools(QWEN_LIKE) and tool_prompt.renders_tools(LLAMA31_LIKE)
    assert not tool_prompt.renders_tools(CHATML)


def test_qwen_like_template_renders_tools_and_tool_turns(tok: Tokenizer) -> None:
    got = text_of(tok, FOLLOW_UP, QWEN_LIKE, tools=TOOLS)
    want = ("<|im_start|>system\nBe brief.\n\n# Tools\n<tools>\n"
            + json.dumps(TOOLS[0]) + "\n" + json.dumps(TOOLS[1]) + "\n</tools>\n"
            "Call as <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call>"
            "<|im_end|>\n"
            "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
            "<|im_start|>assistant\n<tool_call>\n"
            "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"
            "<|im_end|>\n"
            "<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n")
    assert got == want
    # Without tools the same template renders its plain branch.
    plain = text_of(tok, FOLLOW_UP[:2], QWEN_LIKE)
    assert plain == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                     "Weather in Paris?<|im_end|>\n<|im_start|>assistant\n")


def test_llama31_like_template_renders_tools_and_tool_turns(tok: Tokenizer) -> None:
    got = text_of(tok, FOLLOW_UP, LLAMA31_LIKE, tools=TOOLS)
    want = ("<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\nBe brief."
            "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nAnswer a call as "
            "{\"name\": name, \"parameters\": arguments}.\n\n"
            + json.dumps(TOOLS[0], indent=4) + "\n\n" + json.dumps(TOOLS[1], indent=4)
            + "\n\nWeather in Paris?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"get_weather\", "
            "\"parameters\": {\"city\": \"Paris\"}}<|eot_id|>"
            "<|start_header_id|>ipython<|end_header_id|>\n\n18C, sunny<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert got == want
    # The family's limit (one call per turn) is the template's own error: a 400.
    two = [*FOLLOW_UP[:2], {"role": "assistant", "content": "", "tool_calls": [CALL, CALL]}]
    with pytest.raises(InvalidRequest, match="one call per turn") as e:
        text_of(tok, two, LLAMA31_LIKE, tools=TOOLS)
    assert e.value.field == "chat_template"


def test_template_without_tools_gets_the_fallback(tok: Tokenizer) -> None:
    got = text_of(tok, FOLLOW_UP, CHATML, tools=TOOLS, tool_format="hermes")
    system, rest = got.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    for tool in TOOLS:  # each tool, one JSON object a line
        assert "\n" + json.dumps(tool) + "\n" in system
    assert "<tool_call>" in system and "\"arguments\"" in system
    assert rest == ("<|im_start|>user\nWeather in Paris?<|im_end|>\n"
                    "<|im_start|>assistant\n<tool_call>\n"
                    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
                    "</tool_call><|im_end|>\n"
                    "<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response>"
                    "<|im_end|>\n<|im_start|>assistant\n")
    # llama3_json: calls as bare objects; a system message is added when there is none.
    got = text_of(tok, FOLLOW_UP[1:], CHATML, tools=TOOLS, tool_format="llama3_json")
    assert got.startswith("<|im_start|>system\n# Tools\n")
    assert "\"parameters\"" in got.split("<|im_end|>")[0]
    assert ("<|im_start|>assistant\n{\"name\": \"get_weather\", \"parameters\": "
            "{\"city\": \"Paris\"}}<|im_end|>") in got
    # Two results in a row are one user turn; no tools: no block, tool turns still text.
    two = [*FOLLOW_UP, {"role": "tool", "tool_call_id": "call_2", "content": "9"}]
    got = text_of(tok, two, CHATML)
    assert "# Tools" not in got
    assert got.endswith("<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response>\n"
                        "<tool_response>\n9\n</tool_response><|im_end|>\n"
                        "<|im_start|>assistant\n")


def test_bundled_smollm2_template_gets_the_fallback(tok: Tokenizer) -> None:
    try:
        from jaxserve.models.bundled import bundled_model_path
        bundled = Tokenizer.from_gguf(bundled_model_path())
    except (ImportError, FileNotFoundError, OSError) as e:
        pytest.skip(f"the bundled model is not installed: {e}")
    assert bundled.chat_template and not tool_prompt.renders_tools(bundled.chat_template)
    got = bundled.decode(render_chat(FOLLOW_UP[1:], bundled, tools=TOOLS),
                         skip_special_tokens=False)
    assert got.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(TOOLS[0]) in got and "<tool_response>\n18C, sunny" in got
    assert got.endswith("<|im_start|>assistant\n")


def test_bad_tool_turns_are_refused(tok: Tokenizer) -> None:
    def bad(call: object, role: str = "assistant") -> InvalidRequest:
        msgs = [FOLLOW_UP[1], {"role": role, "content": "", "tool_calls": [call]}]
        with pytest.raises(InvalidRequest) as e:
            text_of(tok, msgs, QWEN_LIKE, tools=TOOLS)
        assert e.value.field == "messages"
        return e.value

    assert "is not JSON" in str(bad({**CALL, "function": {"name": "f", "arguments": "{x"}}))
    assert "JSON object" in str(bad({**CALL, "function": {"name": "f", "arguments": "[1]"}}))
    assert "tool_calls[0] must be" in str(bad({"id": "x"}))
    assert "only assistant" in str(bad(CALL, role="user"))
    # tools cannot also come through chat_template_kwargs
    with pytest.raises(InvalidRequest) as e:
        text_of(tok, FOLLOW_UP, QWEN_LIKE, tools=TOOLS, chat_template_kwargs={"tools": []})
    assert e.value.field == "chat_template_kwargs"


def test_tool_call_parser_flag_reaches_the_admission(tok: Tokenizer) -> None:
    from jaxserve.cli.main import build_parser
    from jaxserve.cli.serve import server_config_from_args

    def config(*argv: str) -> ServerConfig:
        return server_config_from_args(build_parser().parse_args(["serve", *argv]))

    assert config().tool_call_parser == "auto"
    assert config("--tool-call-parser", "llama3_json").tool_call_parser == "llama3_json"
    with pytest.raises(SystemExit):
        config("--tool-call-parser", "mistral")
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerConfig(tool_call_parser="mistral")
    assert config().max_tool_calls is None  # unbounded, as OpenAI
    assert config("--max-tool-calls", "3").max_tool_calls == 3
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="max_tool_calls"):
            ServerConfig(max_tool_calls=bad)
    limits = EngineLimits(max_model_len=64, vocab_size=tok.vocab_size, page_size=8,
                          num_kv_pages=16, max_num_seqs=4, max_num_batched_tokens=64,
                          eos_token_ids=(0,))
    llama = Tokenizer(tok.backend, eos_token=tok.eos_token, chat_template=LLAMA31_LIKE)
    for template_tok, flag, want in ((tok, "auto", "hermes"), (llama, "auto", "llama3_json"),
                                     (llama, "hermes", "hermes"),
                                     (tok, "llama3_json", "llama3_json")):
        admit = Admission(limits, template_tok, tool_call_parser=flag, max_tool_calls=2)
        admit.close()
        assert admit.tool_format == want, (flag, want)
        assert admit.max_tool_calls == 2
