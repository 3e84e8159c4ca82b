"""Speculative decoding on the wire (issue 33): the per-request opt-out `speculative` reaches
SamplingParams from both HTTP endpoints and gRPC (field 24), a wrong type is refused naming
it, and a sample's draft / accepted token counts come back in gRPC's Timing and in the batch
job's records. Parsing and mapping functions only: no server, no engine."""

from __future__ import annotations

import pytest

from jaxserve.cli.batch_job import result_record
from jaxserve.engine.outputs import CompletionOutput, RequestOutput
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.sequence import FinishReason, RequestMetrics
from jaxserve.server import openai_chat_schema, openai_schema, proto_map

pb2 = proto_map.pb2
MESSAGES = [{"role": "user", "content": "hi"}]


def _completion(**body: object) -> SamplingParams:
    return openai_schema.parse_completion({"prompt": "w5 w6", **body}).params


def _chat(**body: object) -> SamplingParams:
    return openai_chat_schema.parse_chat({"messages": MESSAGES, **body}).params


@pytest.mark.parametrize("parse", [_completion, _chat], ids=["completions", "chat"])
def test_http_speculative_reaches_sampling_params(parse) -> None:  # noqa: ANN001
    assert parse().speculative is True  # absent: the engine's setting applies
    assert parse(speculative=None).speculative is True  # null: unset
    assert parse(speculative=False).speculative is False
    assert parse(speculative=True).speculative is True


@pytest.mark.parametrize("parse", [_completion, _chat], ids=["completions", "chat"])
@pytest.mark.parametrize("value", ["false", 0, 1, [False]])
def test_http_speculative_must_be_a_boolean(parse, value: object) -> None:  # noqa: ANN001
    with pytest.raises(openai_schema.ApiError) as exc:
        parse(speculative=value)
    assert exc.value.status == 400
    assert exc.value.body["error"]["param"] == "speculative"


def test_grpc_field_24_reaches_sampling_params() -> None:
    assert pb2.SamplingParams.DESCRIPTOR.fields_by_name["speculative"].number == 24
    assert proto_map.sampling_from_proto(pb2.SamplingParams()).speculative is True
    off = pb2.SamplingParams(speculative=False)
    assert off.HasField("speculative")  # presence: an explicit false is not "unset"
    assert proto_map.sampling_from_proto(off).speculative is False
    assert proto_map.sampling_from_proto(pb2.SamplingParams(speculative=True)).speculative


def _metrics(drafted: int, accepted: int) -> RequestMetrics:
    return RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0,
                          last_token_time=12.0, finished_time=12.5,
                          spec_num_draft_tokens=drafted, spec_num_accepted_tokens=accepted)


def test_grpc_timing_carries_the_draft_and_accepted_counts() -> None:
    t = proto_map.timing_to_proto(_metrics(drafted=12, accepted=7))
    assert (t.spec_num_draft_tokens, t.spec_num_accepted_tokens) == (12, 7)
    assert t.e2e_s == pytest.approx(2.5) and t.queue_s == pytest.approx(0.5)
    t = proto_map.timing_to_proto(_metrics(0, 0))
    assert (t.spec_num_draft_tokens, t.spec_num_accepted_tokens) == (0, 0)
    assert proto_map.timing_to_proto(None).spec_num_draft_tokens == 0


def _output(counts: list[tuple[int, int]]) -> RequestOutput:
    comps = [CompletionOutput(index=i, text=f"t{i}", token_ids=[5, 6], cumulative_logprob=None,
                              logprobs=None, finish_reason=FinishReason.LENGTH,
                              metrics=_metrics(d, a), num_tokens=2)
             for i, (d, a) in enumerate(counts)]
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1, 2, 3], outputs=comps,
                         finished=True, metrics=comps[0].metrics)  # type: ignore[arg-type]


def test_batch_record_adds_the_counts_when_the_engine_speculates() -> None:
    out = _output([(9, 4), (6, 5)])
    plain = result_record("q", out, SamplingParams(n=2))
    assert "spec_num_draft_tokens" not in plain and "spec_num_accepted_tokens" not in plain
    rec = result_record("q", out, SamplingParams(n=2), speculative=True)
    assert (rec["spec_num_draft_tokens"], rec["spec_num_accepted_tokens"]) == (15, 9)
    assert {k: v for k, v in rec.items() if not k.startswith("spec_")} == plain
