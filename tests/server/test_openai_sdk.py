"""The official `openai` SDK against jaxserve's HTTP front: a real server (free loopback
ports, tiny model, an API key), chat and completions, streaming and not. Oracle: the offline
`LLM.chat` / `LLM.generate` over an engine with the same config."""

from __future__ import annotations

import pytest
from support.http_clients import openai_client
from support.openai_front import CHAT, NO_EOS, SDK_KEY
from support.probes import wait_pages_free

from jaxserve import SamplingParams
from jaxserve.server.background import BackgroundServer

openai = pytest.importorskip("openai")


def test_sdk_chat(sdk_server: BackgroundServer, llm) -> None:  # noqa: ANN001
    sdk = openai_client(sdk_server, SDK_KEY)
    want = llm.chat(CHAT, SamplingParams(max_tokens=7, temperature=0, logprobs=2, **NO_EOS),
                    use_tqdm=False)[0]
    got = sdk.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=7,
                                      temperature=0, logprobs=True, top_logprobs=2,
                                      extra_body=NO_EOS)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.choices[0].finish_reason == "length"
    assert [len(t.top_logprobs) for t in got.choices[0].logprobs.content] == [2] * 7
    assert got.usage.completion_tokens == 7
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.prompt_tokens_details.cached_tokens >= 0

    sampled = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=6, stop=["w50"],
                             **NO_EOS)
    want = llm.chat(CHAT, sampled, use_tqdm=False)[0]
    stream = sdk.chat.completions.create(model="tiny", messages=CHAT, n=2, temperature=0.8,
                                         seed=3, max_tokens=6, stop=["w50"], stream=True,
                                         stream_options={"include_usage": True},
                                         extra_body=NO_EOS)
    texts, usage = {0: "", 1: ""}, None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
        usage = chunk.usage or usage
    assert [texts[0], texts[1]] == [o.text for o in want.outputs]
    assert usage.completion_tokens == sum(len(o.token_ids) for o in want.outputs)
    wait_pages_free(sdk_server)


def test_sdk_completions(sdk_server: BackgroundServer, llm) -> None:  # noqa: ANN001
    sdk = openai_client(sdk_server, SDK_KEY)
    want = llm.generate("w5 w6 w7", SamplingParams(max_tokens=5, temperature=0, **NO_EOS),
                        use_tqdm=False)[0]
    got = sdk.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=5,
                                 temperature=0, extra_body=NO_EOS)
    assert got.choices[0].text == want.outputs[0].text
    assert got.usage.completion_tokens == 5
    text = "".join(c.choices[0].text for c in sdk.completions.create(
        model="tiny", prompt="w5 w6 w7", max_tokens=5, temperature=0, stream=True,
        extra_body=NO_EOS))
    assert text == want.outputs[0].text
    # logit_bias through the SDK (string keys on the wire), streamed chat and not.
    biased = llm.generate("w5 w6 w7", SamplingParams(max_tokens=4, temperature=0,
                                                      logit_bias={41: 100.0}, **NO_EOS),
                          use_tqdm=False)[0].outputs[0]
    got = sdk.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=4, temperature=0,
                                 logit_bias={"41": 100}, extra_body=NO_EOS)
    assert biased.token_ids == [41] * 4 and got.choices[0].text == biased.text
    want_chat = llm.chat(CHAT, SamplingParams(max_tokens=4, temperature=0,
                                              logit_bias={41: 100.0}, **NO_EOS),
                         use_tqdm=False)[0].outputs[0].text
    kw = dict(model="tiny", messages=CHAT, max_completion_tokens=4, temperature=0,
              logit_bias={"41": 100}, extra_body=NO_EOS)
    assert sdk.chat.completions.create(**kw).choices[0].message.content == want_chat
    assert "".join(c.choices[0].delta.content or "" for c in
                   sdk.chat.completions.create(stream=True, **kw) if c.choices) == want_chat
    wait_pages_free(sdk_server)


def test_sdk_errors(sdk_server: BackgroundServer) -> None:
    with pytest.raises(openai.AuthenticationError):
        openai_client(sdk_server, "wrong").chat.completions.create(model="tiny", messages=CHAT)
    sdk = openai_client(sdk_server, SDK_KEY)
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(model="tiny", messages=CHAT, temperature=-1)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(model="tiny", messages=CHAT, logit_bias={"5": 101})
    assert bad.value.body["param"] == "logit_bias"
