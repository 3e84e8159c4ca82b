"""vLLM's request extras on the HTTP front (issue #29: they were accepted and ignored):
truncate_prompt_tokens, allowed_token_ids and bad_words honoured, the others refused with a
400 naming the field. Oracle: the offline API (conftest's `llm`, the same engine config)
given the prompt the truncation keeps, computed here from vLLM's definition."""

from __future__ import annotations

import asyncio

import pytest
from support.http_clients import call, url_of
from support.openai_front import GREEDY, SDK_KEY
from support.probes import wait_pages_free

from jaxserve import SamplingParams
from jaxserve.server.background import BackgroundServer

AUTH = {"Authorization": f"Bearer {SDK_KEY}"}
PROMPT = " ".join(f"w{t}" for t in range(5, 25))  # 20 tokens
IDS = list(range(5, 25))
MAX_MODEL_LEN = 512  # support.openai_front.CONFIG


def complete(server: BackgroundServer, path: str = "/v1/completions", **body: object
             ) -> tuple[int, dict]:
    return asyncio.run(call(url_of(server), path, {"model": "tiny", **body}, AUTH))


@pytest.mark.parametrize("k,max_tokens,kept", [(4, 3, 4), (30, 3, 20), (-1, 500, 12),
                                               (-1, 3, 20)])
def test_truncate_prompt_tokens_keeps_the_last_tokens(
        sdk_server: BackgroundServer, llm, k: int, max_tokens: int,  # noqa: ANN001
        kept: int) -> None:
    status, body = complete(sdk_server, prompt=PROMPT, max_tokens=max_tokens,
                            truncate_prompt_tokens=k, echo=True, **GREEDY)
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == kept
    want = llm.generate([IDS[-kept:]], SamplingParams(max_tokens=max_tokens, **GREEDY),
                        use_tqdm=False)[0].outputs[0]
    echo = " ".join(f"w{t}" for t in IDS[-kept:])
    assert body["choices"][0]["text"] == echo + want.text  # the kept prompt is echoed
    wait_pages_free(sdk_server)


@pytest.mark.parametrize("k,message", [
    (MAX_MODEL_LEN + 1, f"truncate_prompt_tokens={MAX_MODEL_LEN + 1} must be -1 or at most "
                        f"max_model_len={MAX_MODEL_LEN}"),
    (0, "truncate_prompt_tokens=0 must be -1 (as many as fit) or an integer in"),
    (-2, "truncate_prompt_tokens=-2 must be -1"),
    ("4", "truncate_prompt_tokens='4' must be -1"),
])
def test_bad_truncate_prompt_tokens_is_a_400(sdk_server: BackgroundServer, k: object,
                                             message: str) -> None:
    status, body = complete(sdk_server, prompt=PROMPT, truncate_prompt_tokens=k)
    assert status == 400 and body["error"]["param"] == "truncate_prompt_tokens"
    assert body["error"]["message"].startswith(message), body


def test_truncation_applies_to_chat_and_to_the_offline_api(sdk_server: BackgroundServer,
                                                          llm) -> None:  # noqa: ANN001
    status, body = complete(sdk_server, "/v1/chat/completions", max_tokens=2,
                            messages=[{"role": "user", "content": PROMPT}],
                            truncate_prompt_tokens=5, **GREEDY)
    assert status == 200 and body["usage"]["prompt_tokens"] == 5, body
    out = llm.generate([PROMPT], SamplingParams(max_tokens=2, truncate_prompt_tokens=6,
                                                **GREEDY), use_tqdm=False)[0]
    assert out.prompt_token_ids == IDS[-6:] and out.prompt is None  # the text was cut
    whole = llm.generate([PROMPT], SamplingParams(max_tokens=2, truncate_prompt_tokens=-1,
                                                  **GREEDY), use_tqdm=False)[0]
    assert whole.prompt_token_ids == IDS and whole.prompt == PROMPT
    # Prompt logprobs score the kept prompt: one entry per kept token, None for its first.
    scored = llm.generate([IDS], SamplingParams(max_tokens=0, prompt_logprobs=1,
                                                truncate_prompt_tokens=4), use_tqdm=False)[0]
    assert scored.prompt_token_ids == IDS[-4:] and len(scored.prompt_logprobs) == 4
    assert scored.prompt_logprobs[0] is None and IDS[-3] in scored.prompt_logprobs[1]
    wait_pages_free(sdk_server)


def test_token_filters_are_honoured(sdk_server: BackgroundServer, llm) -> None:  # noqa: ANN001
    params = dict(max_tokens=6, allowed_token_ids=[7, 8, 30], bad_words=["w8", "w7 w7"])
    status, body = complete(sdk_server, prompt="w5 w9", **params, **GREEDY)
    assert status == 200, body
    want = llm.generate(["w5 w9"], SamplingParams(**params, **GREEDY), use_tqdm=False)
    assert body["choices"][0]["text"] == want[0].outputs[0].text
    assert set(want[0].outputs[0].token_ids) <= {7, 30}
    wait_pages_free(sdk_server)


@pytest.mark.parametrize("ids,message", [
    ([10**12], "allowed_token_ids[0]=1000000000000 must be an integer in"),
    ([5, 211], "allowed_token_ids[1]=211 is outside the vocabulary [0, 211)"),
    ([], "allowed_token_ids must not be empty"),
    ("w5", "allowed_token_ids must be a non-empty list"),
])
def test_bad_allowed_token_ids_is_a_400(sdk_server: BackgroundServer, ids: object,
                                        message: str) -> None:
    status, body = complete(sdk_server, prompt="w5", allowed_token_ids=ids)
    assert status == 400 and body["error"]["param"] == "allowed_token_ids", body
    assert body["error"]["message"].startswith(message), body


# --------------------------------------------------------------------------- refused fields
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("field,value,message", [
    ("use_beam_search", True, "use_beam_search is not supported by this endpoint (only "
                              "False, its default, is accepted); got True"),
    ("guided_decoding_backend", "xgrammar", "guided_decoding_backend is not supported by "
                                            "this endpoint (the grammar backend"),
    ("prompt_embeds", "AAAA", "prompt_embeds is not supported by this endpoint (prompts are"),
    ("foo", 1, "foo is not supported by this endpoint; got 1"),
])
def test_fields_nothing_reads_are_a_400_naming_them(sdk_server: BackgroundServer, path: str,
                                                    field: str, value: object,
                                                    message: str) -> None:
    base = {"messages": [{"role": "user", "content": "w5"}]} if "chat" in path else \
        {"prompt": "w5"}
    status, body = complete(sdk_server, path, max_tokens=1, **base, **{field: value}) \
        if path != "/tokenize" else complete(sdk_server, path, **base, **{field: value})
    assert status == 400, body
    assert body["error"]["param"] == field and body["error"]["message"].startswith(message)


def test_no_op_values_and_nulls_are_accepted(sdk_server: BackgroundServer) -> None:
    for path, base in (("/v1/completions", {"prompt": "w5"}),
                       ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "w5"}]})):
        status, body = complete(sdk_server, path, max_tokens=1, use_beam_search=False,
                                length_penalty=1, foo=None, user="u1", **base)
        assert status == 200, body
    # /detokenize reads only tokens (and model): a sampling field there is refused
    status, body = complete(sdk_server, "/detokenize", tokens=[5], temperature=0.5)
    assert status == 400 and body["error"]["param"] == "temperature", body
    status, body = complete(sdk_server, "/tokenize", prompt="w5", ignore_eos=True)
    assert status == 400 and body["error"]["param"] == "ignore_eos", body
    wait_pages_free(sdk_server)


def test_completions_honour_add_special_tokens() -> None:
    # The word tokenizer adds no BOS, so the mapping is checked: admission encodes a text
    # with its PromptInput's add_special_tokens (as /tokenize does).
    from jaxserve.server.openai_schema import ApiError, parse_completion

    assert parse_completion({"prompt": "w5"}).prompt.add_special_tokens is True
    req = parse_completion({"prompt": "w5", "add_special_tokens": False})
    assert req.prompt.add_special_tokens is False
    with pytest.raises(ApiError, match="add_special_tokens=1 must be a boolean"):
        parse_completion({"prompt": "w5", "add_special_tokens": 1})


# --------------------------------------------------------------------------- gRPC
def test_grpc_takes_the_same_extras(sdk_server: BackgroundServer, llm) -> None:  # noqa: ANN001
    import grpc

    from jaxserve.client import Client

    params = SamplingParams(max_tokens=5, allowed_token_ids=[7, 8, 30], bad_words=["w8"],
                            truncate_prompt_tokens=3, **GREEDY)
    with Client(sdk_server.target, api_key=SDK_KEY) as client:
        [got] = client.generate(PROMPT, params)
        with pytest.raises(grpc.RpcError) as e:
            client.generate("w5", SamplingParams(allowed_token_ids=[5, 211]))
    want = llm.generate([IDS[-3:]], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and set(got.token_ids) <= {7, 30}
    assert got.usage.prompt_tokens == 3
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(
        "sampling.allowed_token_ids[1]=211 is outside the vocabulary [0, 211)")
    wait_pages_free(sdk_server)


def test_grpc_refuses_fields_its_proto_does_not_define(sdk_server: BackgroundServer) -> None:
    """A newer client's field (here number 25 of SamplingParams) reaches the server as an
    unknown field, which protobuf would let it ignore: it is INVALID_ARGUMENT instead."""
    import grpc

    from jaxserve.client import Client
    from jaxserve.server.client import pb2

    sampling = pb2.SamplingParams()
    sampling.ParseFromString(pb2.SamplingParams(max_tokens=1).SerializeToString()
                             + bytes([0xC8, 0x01, 0x05]))  # field 25, varint 5
    req = pb2.GenerateRequest(prompt="w5", sampling=sampling)
    chat = pb2.GenerateRequest()
    chat.chat.messages.add(role="user", content="w5")
    message = pb2.ChatMessage()
    message.ParseFromString(chat.chat.messages[0].SerializeToString() + bytes([0x50, 0x01]))
    chat.chat.messages[0].CopyFrom(message)  # field 10 of a ChatMessage
    with Client(sdk_server.target, api_key=SDK_KEY) as client:
        for bad, where in ((req, "sampling has field number 25"),
                           (chat, "chat.messages[0] has field number 10")):
            with pytest.raises(grpc.RpcError) as e:
                list(client.stub.Generate(bad, metadata=client._metadata))  # noqa: SLF001
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith(where), e.value.details()
