"""echo, prompt_logprobs, suffix and best_of on the OpenAI HTTP front (and the mapping of the
structured-output fields).

The shape helpers (`server.openai_choices`) and the body mapping (`openai_schema`) are tested
on hand-built values; the rest goes through the official `openai` SDK (vLLM's extras in
`extra_body`) against a real server on free loopback ports, with the offline `LLM.generate`
/ `LLM.chat` over an engine with the same config as the oracle (greedy)."""

from __future__ import annotations

import pytest
from support.engine_fixtures import tiny_logprob_atol
from support.http_clients import openai_client
from support.openai_front import CHAT, NO_EOS, SDK_KEY
from support.probes import wait_pages_free

from jaxserve import SamplingParams
from jaxserve.server import openai_choices as choices
from jaxserve.server import openai_schema as schema
from jaxserve.server.background import BackgroundServer
from jaxserve.serving.admission import render_chat

openai = pytest.importorskip("openai")
PROMPT = "w5 w9 w33 w7 w100"


def decode(tid: int) -> str:
    return f"<{tid}>"


# --------------------------------------------------------------------------- shapes
def test_legacy_logprobs_prompt_first_then_generated() -> None:
    pairs = choices.prompt_pairs([1, 2, 3], [None, {2: -1.0, 9: -0.5, 8: -0.75},
                                             {3: -0.25, 4: -2.0}])
    pairs += choices.generated_pairs([{7: -0.5, 6: -0.25}])
    lp, end = choices.legacy_logprobs(pairs, decode, 0, 1)
    assert lp["tokens"] == ["<1>", "<2>", "<3>", "<7>"]
    assert lp["token_logprobs"] == [None, -1.0, -0.25, -0.5]
    # Each: the token, then the 1 likeliest (an echo's prompt entries may hold more).
    assert lp["top_logprobs"] == [None, {"<2>": -1.0, "<9>": -0.5}, {"<3>": -0.25},
                                  {"<7>": -0.5, "<6>": -0.25}]
    assert lp["text_offset"] == [0, 3, 6, 9] and end == 12


def test_vllm_prompt_logprobs_ranks() -> None:
    entries = [None, {2: -1.0, 9: -0.5, 8: -0.75}, {3: -0.25, 4: -2.0}]
    got = choices.vllm_prompt_logprobs([1, 2, 3], entries, 2, 2, decode)
    assert got[0] is None
    # 2 is not among the top-2 (the entry holds 3 keys): rank unknown, null.
    assert got[1] == {"2": {"logprob": -1.0, "rank": None, "decoded_token": "<2>"},
                      "9": {"logprob": -0.5, "rank": 1, "decoded_token": "<9>"},
                      "8": {"logprob": -0.75, "rank": 2, "decoded_token": "<8>"}}
    assert got[2] == {"3": {"logprob": -0.25, "rank": 1, "decoded_token": "<3>"},
                      "4": {"logprob": -2.0, "rank": 2, "decoded_token": "<4>"}}
    # Computed with N=2, shown with 1: the prompt token keeps its rank among the computed.
    got = choices.vllm_prompt_logprobs([1, 3], [None, {3: -2.0, 4: -0.25}], 1, 2, decode)
    assert got[1] == {"3": {"logprob": -2.0, "rank": 2, "decoded_token": "<3>"},
                      "4": {"logprob": -0.25, "rank": 1, "decoded_token": "<4>"}}
    assert choices.vllm_prompt_logprobs([1], None, 1, 1, decode) is None


def test_echo_of_chat_is_the_last_assistant_content() -> None:
    assert choices.echo_of_chat(CHAT) == ""  # the last message is a user's
    assert choices.echo_of_chat(CHAT[:3]) == "w7 w8"
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert choices.echo_of_chat([{"role": "assistant", "content": parts}]) == "a\nb"
    assert choices.echo_of_chat([{"role": "assistant", "content": None}]) == ""


@pytest.mark.parametrize("body, want", [
    ({"echo": True, "logprobs": 2}, 2),  # the legacy object covers the prompt
    ({"echo": True, "logprobs": 2, "prompt_logprobs": 4}, 4),
    ({"echo": True, "logprobs": 3, "prompt_logprobs": 1}, 3),
    ({"echo": True}, None),
    ({"logprobs": 2}, None),
    ({"prompt_logprobs": 0}, 0),
])
def test_echo_with_logprobs_asks_for_prompt_logprobs(body: dict, want: int | None) -> None:
    req = schema.parse_completion({"prompt": "w5", **body})
    assert req.params.prompt_logprobs == want
    assert req.prompt_logprobs == body.get("prompt_logprobs")
    assert req.echo == bool(body.get("echo"))


def test_suffix_and_best_of() -> None:
    schema.parse_completion({"prompt": "w5", "suffix": "", "best_of": None})
    schema.parse_completion({"prompt": "w5", "n": 2, "best_of": 2})
    schema.parse_completion({"prompt": "w5", "n": None, "best_of": 1})
    for body, field in (({"suffix": "x"}, "suffix"), ({"best_of": 2}, "best_of"),
                        ({"n": 2, "best_of": 1}, "best_of")):
        with pytest.raises(schema.ApiError) as e:
            schema.parse_completion({"prompt": "w5", **body})
        assert e.value.status == 400 and e.value.body["error"]["param"] == field


@pytest.mark.parametrize("field,value,want", [
    ("response_format", {"type": "json_object"}, {"json_object": True}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "array"}}}, {"json": {"type": "array"}}),
    ("guided_json", {"type": "object"}, {"json": {"type": "object"}}),
    ("guided_regex", "[a-z]+", {"regex": "[a-z]+"}),
    ("guided_choice", ["a", "b"], {"choice": ["a", "b"]}),
    ("guided_grammar", 'start: "x"', {"grammar": 'start: "x"'}),
    ("structured_outputs", {"json": {}}, {"json": {}})])
def test_structured_output_fields_map_to_one_spec(field: str, value: object, want: dict
                                                   ) -> None:
    """On both endpoints every structured-output source becomes the same StructuredOutputs
    (a client that asked for constrained output never silently gets free text)."""
    from jaxserve.engine.structured_outputs import StructuredOutputs
    from jaxserve.server.openai_chat_schema import parse_chat

    for parse, body in ((schema.parse_completion, {"prompt": "w5"}),
                        (parse_chat, {"messages": [{"role": "user", "content": "hi"}]})):
        got = parse({**body, field: value}).params.structured_outputs
        assert got == StructuredOutputs.from_mapping(want)
        assert parse({**body, "response_format": {"type": "text"}}
                     ).params.structured_outputs is None  # plain text
        with pytest.raises(schema.ApiError) as e:  # two sources: refused, the second named
            parse({**body, field: value, "structural_tag" if field == "guided_json" else
                   "guided_json": {"type": "object"}})
        assert e.value.status == 400


# --------------------------------------------------------------------------- the SDK
def _close(got: list, want: list) -> None:
    # Two layouts of the test model (other batch neighbours and buckets): tiny_logprob_atol,
    # derived from its weights (support.numerics.model_logprob_atol).
    assert got == pytest.approx(want, abs=tiny_logprob_atol())


def test_sdk_echo_with_logprobs(sdk_server: BackgroundServer, llm) -> None:  # noqa: ANN001
    want = llm.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0, logprobs=2,
                                               prompt_logprobs=2, **NO_EOS),
                        use_tqdm=False)[0]
    sdk = openai_client(sdk_server, SDK_KEY)
    got = sdk.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0,
                                 echo=True, logprobs=2, extra_body=NO_EOS).choices[0]
    assert got.text == PROMPT + want.outputs[0].text
    ids = want.prompt_token_ids + want.outputs[0].token_ids
    lp = got.logprobs
    tok = sdk_server.server.engine.engine.tokenizer
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    entries = want.prompt_logprobs[1:] + want.outputs[0].logprobs
    _close(lp.token_logprobs[1:], [e[t] for t, e in zip(ids[1:], entries)])
    assert all(len(top) in (2, 3) for top in lp.top_logprobs[1:])  # the token + the top-2
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    wait_pages_free(sdk_server)


def test_sdk_echo_scores_the_prompt(sdk_server: BackgroundServer, llm) -> None:  # noqa: ANN001
    """lm-eval-harness' loglikelihood request: echo, max_tokens 0, logprobs 1."""
    want = llm.generate(PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=1),
                        use_tqdm=False)[0]
    got = openai_client(sdk_server, SDK_KEY).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    c = got.choices[0]
    assert c.text == PROMPT and c.finish_reason == "length"
    assert got.usage.completion_tokens == 0
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    ids = want.prompt_token_ids
    assert c.logprobs.token_logprobs[0] is None
    _close(c.logprobs.token_logprobs[1:],
           [e[t] for t, e in zip(ids[1:], want.prompt_logprobs[1:])])
    wait_pages_free(sdk_server)


def test_sdk_prompt_logprobs(sdk_server: BackgroundServer, llm) -> None:  # noqa: ANN001
    want = llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2,
                                               **NO_EOS), use_tqdm=False)[0]
    sdk = openai_client(sdk_server, SDK_KEY)
    got = sdk.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0,
                                 extra_body={"prompt_logprobs": 2, **NO_EOS}).model_dump()
    c = got["choices"][0]
    assert c["text"] == want.outputs[0].text and c["logprobs"] is None
    _check_vllm_prompt_logprobs(c["prompt_logprobs"], want)

    chat_want = llm.chat(CHAT, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2,
                                              **NO_EOS), use_tqdm=False)[0]
    got = sdk.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, temperature=0,
                                      extra_body={"prompt_logprobs": 2, **NO_EOS}).model_dump()
    assert got["choices"][0]["message"]["content"] == chat_want.outputs[0].text
    _check_vllm_prompt_logprobs(got["prompt_logprobs"], chat_want)
    wait_pages_free(sdk_server)


def _check_vllm_prompt_logprobs(got: list, want) -> None:  # noqa: ANN001 - a RequestOutput
    ids = want.prompt_token_ids
    assert len(got) == len(ids) and got[0] is None
    for tid, g, w in zip(ids[1:], got[1:], want.prompt_logprobs[1:]):
        assert list(g) == [str(t) for t in w]  # the prompt token first, then the top-2
        _close([v["logprob"] for v in g.values()], list(w.values()))
        # Ranks 1, 2 for the top-2; the prompt token's is null when it is not among them.
        assert sorted(v["rank"] for v in g.values() if v["rank"] is not None) == [1, 2]
        assert (g[str(tid)]["rank"] is None) == (len(g) == 3)


@pytest.mark.parametrize("logprobs", [None, 1])
def test_sdk_streamed_echo_equals_unstreamed(sdk_server: BackgroundServer,
                                             logprobs: int | None) -> None:
    sdk = openai_client(sdk_server, SDK_KEY)
    kw = dict(model="tiny", prompt=PROMPT, n=2, temperature=0.8, seed=3, max_tokens=5,
              echo=True, logprobs=logprobs, extra_body=NO_EOS)
    whole = sdk.completions.create(**kw)
    texts, tokens = {0: "", 1: ""}, {0: [], 1: []}
    for chunk in sdk.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
            tokens[c.index] += c.logprobs.tokens if c.logprobs else []
    for c in whole.choices:
        assert texts[c.index] == c.text and c.text.startswith(PROMPT)
        assert tokens[c.index] == (c.logprobs.tokens if logprobs else [])
    wait_pages_free(sdk_server)


def test_sdk_chat_echo(sdk_server: BackgroundServer, llm) -> None:  # noqa: ANN001
    """vLLM's chat echo: the last message's content first, when it is an assistant's (here a
    turn the model continues)."""
    msgs = CHAT[:3]
    kw = dict(model="tiny", messages=msgs, max_tokens=4, temperature=0,
              extra_body={"echo": True, "add_generation_prompt": False,
                          "continue_final_message": True, **NO_EOS})
    ids = render_chat(msgs, llm.tokenizer, False, continue_final_message=True)
    want = llm.generate(ids, SamplingParams(max_tokens=4, temperature=0, **NO_EOS),
                        use_tqdm=False)[0].outputs[0].text
    sdk = openai_client(sdk_server, SDK_KEY)
    got = sdk.chat.completions.create(**kw).choices[0].message.content
    assert got == "w7 w8" + want
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       sdk.chat.completions.create(stream=True, **kw) if c.choices)
    assert streamed == got
    # Nothing to echo after a user's message.
    plain = sdk.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2,
                                        temperature=0, extra_body={"echo": True, **NO_EOS})
    assert plain.choices[0].message.content == llm.chat(
        CHAT, SamplingParams(max_tokens=2, temperature=0, **NO_EOS),
        use_tqdm=False)[0].outputs[0].text
    wait_pages_free(sdk_server)


def test_sdk_refusals(sdk_server: BackgroundServer) -> None:
    sdk = openai_client(sdk_server, SDK_KEY)
    for kw, field in ((dict(suffix="w9"), "suffix"), (dict(best_of=2), "best_of")):
        with pytest.raises(openai.BadRequestError) as e:
            sdk.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, **kw)
        assert e.value.status_code == 400 and field in str(e.value)
    got = sdk.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, n=2, best_of=2)
    assert len(got.choices) == 2
