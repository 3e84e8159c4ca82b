"""prompt_logprobs on the gRPC front: the PromptLogprobs message (built by
`proto_map.ResponseBuilder`, read back by the client's `fold` / `prompt_logprobs_of`).

Unit tests run on hand-built RequestOutputs; the end-to-end test runs a real server on a free
loopback port with the tiny model, and its oracle is the offline `LLM.generate` over an
engine with the same config (greedy, so the same prompt gives the same logits)."""

from __future__ import annotations

import pytest
from support.engine_fixtures import tiny_engine, tiny_logprob_atol
from support.grpc_streams import check_stream_shape
from support.openai_front import CONFIG
from support.probes import wait_pages_free

from jaxserve import SamplingParams
from jaxserve.engine.outputs import CompletionOutput, RequestOutput
from jaxserve.engine.sequence import FinishReason, RequestMetrics
from jaxserve.server.background import BackgroundServer
from jaxserve.server.client import Client, fold, prompt_logprobs_of
from jaxserve.server.config import ServerConfig
from jaxserve.server.proto_map import ResponseBuilder
from jaxserve.serving.served import ServedModel

# Prompt tokens 5, 6, 7; top-2 per position; 6 is among its top-2, 7 is not (values exact
# in float32, the wire type).
PROMPT = [5, 6, 7]
PROMPT_LPS = [None, {6: -0.5, 6000: -0.25}, {7: -3.0, 1: -0.125, 2: -0.75}]


def _output(tokens: list[int], finished: bool, prompt_lps: object = None) -> RequestOutput:
    c = CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=None,
                         logprobs=None, delta_text="x" * len(tokens), delta_token_ids=tokens,
                         finish_reason=FinishReason.LENGTH if finished else None,
                         num_tokens=len(tokens), metrics=RequestMetrics(arrival_time=0.0))
    return RequestOutput("r", None, PROMPT, [c], finished, RequestMetrics(arrival_time=0.0),
                         prompt_logprobs=prompt_lps)  # type: ignore[arg-type]


def test_prompt_logprobs_message_goes_first_and_once() -> None:
    builder = ResponseBuilder(params=SamplingParams(prompt_logprobs=2, max_tokens=2))
    msgs = builder.responses(_output([9], False, PROMPT_LPS))
    msgs += builder.responses(_output([10], True, PROMPT_LPS))  # CUMULATIVE repeats them
    kinds = [m.WhichOneof("kind") for m in msgs]
    assert kinds == ["prompt_logprobs", "chunk", "chunk", "finished"]
    tokens = msgs[0].prompt_logprobs.tokens
    assert [t.token_id for t in tokens] == PROMPT
    assert not tokens[0].HasField("logprob") and not tokens[0].top
    assert tokens[1].logprob == -0.5
    # `top`: the 2 likeliest, likeliest first, the prompt token among them when it is.
    assert [(t.token_id, t.logprob) for t in tokens[1].top] == [(6000, -0.25), (6, -0.5)]
    assert [t.token_id for t in tokens[2].top] == [1, 2]
    assert prompt_logprobs_of(msgs[0].prompt_logprobs) == PROMPT_LPS
    check_stream_shape(msgs[1:], 1)
    assert fold(msgs)[0].prompt_logprobs == PROMPT_LPS


def test_no_prompt_logprobs_message_unless_asked() -> None:
    builder = ResponseBuilder(params=SamplingParams(max_tokens=1))
    msgs = builder.responses(_output([9], True))
    assert [m.WhichOneof("kind") for m in msgs] == ["chunk", "finished"]
    assert fold(msgs)[0].prompt_logprobs is None


def test_chunk_top_holds_the_n_likeliest() -> None:
    """TokenLogprob.top is the `logprobs` likeliest tokens even when the sampled one is
    among them (the engine's entry then holds it once, first)."""
    builder = ResponseBuilder(params=SamplingParams(logprobs=2, max_tokens=1))
    out = _output([9], True)
    out.outputs[0].delta_logprobs = [{9: -0.125, 3: -2.0}]
    lp = builder.responses(out)[0].chunk.logprobs[0]
    assert (lp.token_id, [t.token_id for t in lp.top]) == (9, [9, 3])


@pytest.fixture(scope="module")
def server() -> BackgroundServer:
    srv = BackgroundServer(ServerConfig(port=0, http_port=None),
                           lambda: ServedModel(tiny_engine(**CONFIG), "tiny", "hf")).start()
    yield srv
    srv.stop()


@pytest.mark.parametrize("max_tokens", [4, 0])
def test_grpc_prompt_logprobs_equal_offline(server: BackgroundServer, llm,  # noqa: ANN001
                                            max_tokens: int) -> None:
    prompt = "w5 w9 w33 w7 w7 w100"
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            prompt_logprobs=3)
    want = llm.generate(prompt, params, use_tqdm=False)[0]
    assert want.prompt_logprobs is not None and want.prompt_logprobs[0] is None
    with Client(server.target) as client:
        msgs = list(client.stream(prompt, params))
    kinds = [m.WhichOneof("kind") for m in msgs]
    assert kinds[0] == "prompt_logprobs" and kinds.count("prompt_logprobs") == 1
    check_stream_shape(msgs[1:], 1)
    got = fold(msgs)[0]
    assert got.token_ids == want.outputs[0].token_ids
    assert got.finish_reason == "LENGTH" and got.usage.completion_tokens == max_tokens
    assert [t.token_id for t in msgs[0].prompt_logprobs.tokens] == want.prompt_token_ids
    assert len(got.prompt_logprobs) == len(want.prompt_token_ids)
    assert got.prompt_logprobs[0] is None
    for g, w in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
        assert list(g) == list(w)  # the prompt token first, the same top-3 ids
        # Another batch layout of the test model (tiny_logprob_atol, derived from its weights);
        # the wire's float32 field is exact for the engine's float32 logprobs.
        assert g == pytest.approx(w, abs=tiny_logprob_atol())
    wait_pages_free(server)
