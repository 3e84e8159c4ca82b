"""`jaxserve bench` with a speculating jaxserve server: the gRPC target reads each sample's
draft / accepted counts from its Timing, the summary adds them up over completed requests
(failed ones excluded), saved documents round-trip them, and the table states the rate."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from jaxserve.cli.bench.report import RequestRecord, format_table, summarize
from jaxserve.cli.bench.sweep import summary_of
from jaxserve.cli.bench.targets import GrpcTarget
from jaxserve.cli.bench.workload import BenchRequest
from jaxserve.server.stubs import load

pb2 = load().pb2


class _FakeClient:
    """The one call GrpcTarget.send makes: a stream of one chunk and one Finished."""

    def __init__(self, drafted: int, accepted: int):
        self.drafted, self.accepted = drafted, accepted

    async def stream(self, prompt: Any, params: Any) -> AsyncIterator[Any]:
        yield pb2.GenerateResponse(chunk=pb2.Chunk(index=0, token_ids=[5, 6, 7], text="abc"))
        yield pb2.GenerateResponse(finished=pb2.Finished(
            index=0, reason=pb2.LENGTH, usage=pb2.Usage(prompt_tokens=4, completion_tokens=3),
            timing=pb2.Timing(spec_num_draft_tokens=self.drafted,
                              spec_num_accepted_tokens=self.accepted)))


def _record(drafted: int, accepted: int) -> RequestRecord:
    target = GrpcTarget("127.0.0.1:1")
    target._client = _FakeClient(drafted, accepted)  # type: ignore[assignment]
    rec = RequestRecord()
    asyncio.run(target.send(BenchRequest(prompt=(1, 2, 3, 4), max_tokens=3), rec))
    return rec


def test_grpc_target_reads_the_counts_and_summary_adds_them() -> None:
    recs = [_record(12, 9), _record(8, 2), _record(0, 0)]
    assert [(r.spec_draft_tokens, r.spec_accepted_tokens) for r in recs] == [(12, 9), (8, 2),
                                                                             (0, 0)]
    failed = RequestRecord(error="UNAVAILABLE", spec_draft_tokens=100, spec_accepted_tokens=1)
    s = summarize(recs + [failed], 1.0)
    assert (s.spec_draft_tokens, s.spec_accepted_tokens) == (20, 11)
    assert s.spec_acceptance_rate == 11 / 20
    back = summary_of({"summary": s.to_dict()})
    assert (back.spec_draft_tokens, back.spec_accepted_tokens) == (20, 11)
    assert "11 of 20 draft tokens accepted (55.0%)" in format_table([("spec", s)])


def test_no_speculation_no_rate_and_old_documents_load() -> None:
    s = summarize([_record(0, 0)], 1.0)
    assert s.spec_acceptance_rate is None
    assert "draft tokens" not in format_table([("plain", s)])
    old = s.to_dict()
    del old["spec_draft_tokens"], old["spec_accepted_tokens"]  # a document saved before
    assert summary_of({"summary": old}).spec_draft_tokens == 0
