"""A failed step hurts only the requests that caused it; a lost device stops the engine.

Faults are injected through the arithmetic fake runner (`InjectedFault`: a step holding a
marker token fails, fatal or not, culprit rows named or not), through host-side processing
(batch build, result application, detokenization) and through a real ModelRunner on the tiny
random model. Each test checks the failed requests end with FinishReason.ERROR and the reason,
the others finish with the outputs an independent oracle predicts, every KV page comes back,
and the engine keeps serving (or, for a fatal fault, reports itself dead).
"""

from __future__ import annotations

import asyncio

import pytest
from support.engine_fixtures import VOCAB, rollout, tiny_engine, tiny_model
from support.fake_engines import GREEDY, MARK, arithmetic, fake_engine

from jaxserve import SamplingParams
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.errors import EngineDead
from jaxserve.engine.fake_runner import ArithmeticRunner
from jaxserve.engine.fault_injection import InjectedFault
from jaxserve.engine.limits import Admitted
from jaxserve.engine.outputs import RequestOutputKind
from jaxserve.engine.sequence import FinishReason
from jaxserve.engine.scheduler import Scheduler
from jaxserve.serving.async_engine import AsyncEngine, EngineStopped

FINAL_ONLY = RequestOutputKind.FINAL_ONLY  # these tests check each request's whole output

def run(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:  # noqa: ANN001
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def pages_all_free(engine) -> bool:  # noqa: ANN001
    s = engine.stats()
    return s.kv_pages_used == 0 and s.num_running == 0 and s.num_waiting == 0


GOOD = {f"ok{i}": ([5 + i, 6, 7 + i] * (i + 1), SamplingParams(max_tokens=6 + i, **GREEDY))
        for i in range(3)}


def assert_good(finals: dict, requests: dict) -> None:
    for rid, (prompt, params) in requests.items():
        c = finals[rid].outputs[0]
        assert c.finish_reason is FinishReason.LENGTH and c.error is None, rid
        assert c.token_ids == arithmetic(prompt, params.max_tokens), rid


# --------------------------------------------------------------------------- fake runner
def test_runner_fault_on_named_rows_fails_only_the_culprit() -> None:
    engine = fake_engine(ArithmeticRunner(VOCAB, InjectedFault(MARK, name_rows=True)))
    bad = {"bad": ([3, MARK, 4], SamplingParams(max_tokens=5, n=2, **GREEDY))}
    finals = run(engine, {**GOOD, **bad})
    assert_good(finals, GOOD)  # scheduled in the failed step too, then simply rerun
    out = finals["bad"]
    assert out.error and "injected fault" in out.error
    assert [c.finish_reason for c in out.outputs] == [FinishReason.ERROR] * 2
    assert all(c.error for c in out.outputs)
    assert pages_all_free(engine)
    assert_good(run(engine, GOOD), GOOD)  # still serving


def test_runner_fault_with_unknown_culprit_fails_that_steps_requests() -> None:
    engine = fake_engine(ArithmeticRunner(VOCAB, InjectedFault(MARK)))
    first = {"a": ([3, MARK], SamplingParams(max_tokens=4, **GREEDY)),
             "b": ([8, 9], SamplingParams(max_tokens=4, **GREEDY))}
    finals = run(engine, first)
    for rid in first:  # both rows of the failed step: the runner could not say which
        c = finals[rid].outputs[0]
        assert c.finish_reason is FinishReason.ERROR and "injected fault" in c.error
    assert pages_all_free(engine)
    assert_good(run(engine, GOOD), GOOD)
    assert pages_all_free(engine)


def test_fatal_runner_fault_kills_the_engine() -> None:
    engine = fake_engine(ArithmeticRunner(VOCAB, InjectedFault(MARK, fatal=True)))
    engine.add_request("bad", [3, MARK], SamplingParams(max_tokens=3))
    with pytest.raises(EngineDead, match="injected fault"):
        engine.step()
    assert engine.dead is not None and "injected fault" in engine.dead
    with pytest.raises(EngineDead):
        engine.step()
    with pytest.raises(EngineDead):
        engine.add_request("later", [5], SamplingParams(max_tokens=1))


def test_fatal_fault_fails_the_async_engine_but_not_a_per_request_one() -> None:
    engine = fake_engine(ArithmeticRunner(VOCAB, InjectedFault(MARK, name_rows=True)))
    failures: list[BaseException] = []
    ae = AsyncEngine(engine, on_failure=failures.append)
    ae.start()

    async def collect(on: AsyncEngine, rid: str, prompt: list[int]) -> object:
        last = None
        async for out in on.submit(rid, prompt, SamplingParams(max_tokens=4, **GREEDY),
                                        output_kind=FINAL_ONLY):
            last = out
        return last

    async def main() -> list:
        return await asyncio.gather(collect(ae, "bad", [3, MARK]),
                                    collect(ae, "good", [8, 9]))

    try:
        bad, good = asyncio.run(main())
    finally:
        ae.stop()
    assert bad.outputs[0].finish_reason is FinishReason.ERROR and "injected" in bad.error
    assert good.outputs[0].token_ids == arithmetic([8, 9], 4)
    assert ae.error is None and not failures and pages_all_free(engine)

    dead = AsyncEngine(fake_engine(ArithmeticRunner(VOCAB, InjectedFault(MARK, fatal=True))),
                       on_failure=failures.append)
    dead.start()

    async def fatal() -> None:
        with pytest.raises(EngineStopped, match="injected fault"):
            await collect(dead, "bad", [3, MARK])

    try:
        asyncio.run(fatal())
    finally:
        dead.stop()
    assert isinstance(dead.error, EngineDead) and len(failures) == 1


# --------------------------------------------------------------------------- host side
def unchecked(engine, prompt: list[int], params: SamplingParams) -> Admitted:  # noqa: ANN001
    """A request queued as if admission had passed it (for values admission would refuse)."""
    return Admitted(None, tuple(prompt), params, params.max_tokens)


def huge_top_k() -> SamplingParams:
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=5, ignore_eos=True)
    object.__setattr__(params, "top_k", 2 ** 1024)  # past every check, as in issue 13
    return params


def test_batch_build_failure_pinpoints_the_row() -> None:
    engine = fake_engine()
    engine.add_request("huge", unchecked(engine, [8, 9], huge_top_k()))
    finals = run(engine, GOOD)
    assert_good(finals, GOOD)
    c = finals["huge"].outputs[0]
    assert c.finish_reason is FinishReason.ERROR and "OverflowError" in c.error
    assert pages_all_free(engine)
    assert_good(run(engine, GOOD), GOOD)


def test_detokenizer_failure_finishes_only_that_request(monkeypatch) -> None:  # noqa: ANN001
    original = IncrementalDetokenizer.add_token

    def add_token(self, token_id: int) -> bool:  # noqa: ANN001
        if self._stops == ("boom",):
            raise UnicodeError("broken detokenizer")
        return original(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "add_token", add_token)
    engine = fake_engine()
    bad = {"bad": ([8, 9], SamplingParams(max_tokens=5, stop=("boom",), **GREEDY))}
    finals = run(engine, {**GOOD, **bad})
    assert_good(finals, GOOD)
    c = finals["bad"].outputs[0]
    assert c.finish_reason is FinishReason.ERROR and "broken detokenizer" in c.error
    assert len(c.token_ids) == 1  # failed on its first token
    assert pages_all_free(engine)


def test_output_failure_finishes_only_that_request(monkeypatch) -> None:  # noqa: ANN001
    original = IncrementalDetokenizer.pop_delta

    def pop_delta(self) -> str:  # noqa: ANN001
        if self._stops == ("boom",):
            raise RuntimeError("broken output")
        return original(self)

    monkeypatch.setattr(IncrementalDetokenizer, "pop_delta", pop_delta)
    engine = fake_engine()
    bad = {"bad": ([8, 9], SamplingParams(max_tokens=5, n=2, stop=("boom",), **GREEDY))}
    finals = run(engine, {**GOOD, **bad})
    assert_good(finals, GOOD)
    out = finals["bad"]
    assert out.finished and "broken output" in out.error
    assert [c.finish_reason for c in out.outputs] == [FinishReason.ERROR] * 2
    assert pages_all_free(engine) and not engine.has_unfinished()


def test_update_failure_is_isolated_per_sequence(monkeypatch) -> None:  # noqa: ANN001
    original = Scheduler._token_stop

    def token_stop(self, req, token):  # noqa: ANN001, ANN202
        if req.request_id == "bad" and req.num_output_tokens == 2:
            raise KeyError("stop rule")
        return original(self, req, token)

    monkeypatch.setattr(Scheduler, "_token_stop", token_stop)
    engine = fake_engine(enable_prefix_caching=True)
    shared = [11] * 20  # full pages the prefix cache registers for both
    bad = {"bad": (shared + [1], SamplingParams(max_tokens=6, **GREEDY))}
    finals = run(engine, {**GOOD, **bad})
    assert_good(finals, GOOD)
    assert finals["bad"].outputs[0].finish_reason is FinishReason.ERROR
    assert pages_all_free(engine)
    # The pages the failed request registered are a valid cache entry for the next one.
    again = {"again": (shared + [2], SamplingParams(max_tokens=5, **GREEDY))}
    out = run(engine, again)["again"]
    assert out.num_cached_tokens == 16 and out.outputs[0].token_ids == arithmetic(
        shared + [2], 5)
    assert pages_all_free(engine)


# --------------------------------------------------------------------------- identity
def test_client_ids_never_collide_with_sample_ids() -> None:
    engine = fake_engine()
    engine.add_request("x#1", [8, 9], SamplingParams(max_tokens=6, **GREEDY))
    engine.step()  # "x#1" is running
    engine.add_request("x", [5, 6], SamplingParams(max_tokens=4, n=2, **GREEDY))
    before = engine.stats()
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request("x", [5], SamplingParams(max_tokens=1, n=3))
    assert engine.stats() == before  # a refused request queues nothing
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["x#1"].outputs[0].token_ids == arithmetic([8, 9], 6)
    assert [c.token_ids for c in finals["x"].outputs] == [arithmetic([5, 6], 4)] * 2
    assert pages_all_free(engine)


def test_client_ids_never_collide_through_the_async_engine() -> None:
    engine = fake_engine()
    ae = AsyncEngine(engine)
    ae.start()

    async def collect(rid: str, prompt: list[int], n: int) -> object:
        last = None
        async for out in ae.submit(rid, prompt, SamplingParams(max_tokens=8, n=n, **GREEDY),
                                        output_kind=FINAL_ONLY):
            last = out
        return last

    async def main() -> list:
        first = asyncio.ensure_future(collect("x#1", [8, 9], 1))
        await asyncio.sleep(0)  # let "x#1" be submitted first
        return await asyncio.gather(first, collect("x", [5, 6], 2))

    try:
        one, two = asyncio.run(main())
    finally:
        ae.stop()
    assert one.outputs[0].token_ids == arithmetic([8, 9], 8)
    assert [c.token_ids for c in two.outputs] == [arithmetic([5, 6], 8)] * 2
    assert ae.error is None and pages_all_free(engine)


# --------------------------------------------------------------------------- real runner
@pytest.fixture(scope="module")
def real_engine():  # noqa: ANN201
    # Compiled on demand (no warmup): only the few buckets these tests use.
    return tiny_engine(warmup=False, max_num_batched_tokens=16, max_model_len=64)


def test_real_runner_input_failure_is_per_request(real_engine, monkeypatch) -> None:  # noqa: ANN001
    from jaxserve.device import model_runner

    original = model_runner.to_step_inputs

    def to_step_inputs(batch, *args):  # noqa: ANN001, ANN002, ANN202
        if MARK in batch.forward.token_ids.tolist():
            raise ValueError("unconvertible step input")
        return original(batch, *args)

    monkeypatch.setattr(model_runner, "to_step_inputs", to_step_inputs)
    engine, model = real_engine, tiny_model()
    engine.add_request("early", [5, 6, 7], SamplingParams(max_tokens=6, **GREEDY))
    engine.step()  # "early" prefilled: it decodes in the step that fails
    engine.add_request("bad", [3, MARK, 4], SamplingParams(max_tokens=3, **GREEDY))
    finals = run(engine, {})
    # The runner cannot say which row it was: every request of that step ends with ERROR.
    for rid in ("early", "bad"):
        c = finals[rid].outputs[0]
        assert c.finish_reason is FinishReason.ERROR and "unconvertible" in c.error, rid
    assert finals["early"].outputs[0].token_ids == rollout(model, [5, 6, 7], 1)
    # Not fatal: the KV cache is intact, and the engine serves on exactly as the oracle.
    assert engine.dead is None and pages_all_free(engine)
    later = run(engine, {"later": ([9, 10], SamplingParams(max_tokens=4, **GREEDY))})
    assert later["later"].outputs[0].token_ids == rollout(model, [9, 10], 4)


def test_real_runner_huge_top_k_fails_one_request(real_engine) -> None:  # noqa: ANN001
    engine = real_engine
    engine.add_request("huge", unchecked(engine, [8, 9], huge_top_k()))
    finals = run(engine, {"good": ([5, 6, 7], SamplingParams(max_tokens=4, **GREEDY))})
    c = finals["huge"].outputs[0]
    assert c.finish_reason is FinishReason.ERROR and "OverflowError" in c.error
    assert finals["good"].outputs[0].token_ids == rollout(tiny_model(), [5, 6, 7], 4)
    assert engine.dead is None and pages_all_free(engine)


def test_real_runner_lost_kv_cache_is_fatal_and_health_says_so(real_engine) -> None:  # noqa: ANN001
    import json
    import urllib.error
    import urllib.request

    import grpc
    from support.probes import NOT_SERVING, health, wait_for

    from jaxserve.server.background import BackgroundServer
    from jaxserve.server.client import Client
    from jaxserve.server.config import ServerConfig
    from jaxserve.serving.served import ServedModel

    engine = real_engine  # last user of the module's engine: this test kills it
    srv = BackgroundServer(ServerConfig(port=0, http_port=0),
                           lambda: ServedModel(engine, "tiny")).start()
    try:
        engine.runner.kv_pages.delete()  # the device state is gone (as after a failed step)
        with Client(srv.target, timeout=60) as client:
            with pytest.raises(grpc.RpcError) as err:
                list(client.stream([5, 6], SamplingParams(max_tokens=2)))
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "KV cache buffer" in (err.value.details() or "")
        assert isinstance(srv.server.engine.error, EngineDead)
        wait_for(lambda: health(srv.target) == NOT_SERVING, "NOT_SERVING")
        url = f"http://127.0.0.1:{srv.server.http_port}/health"
        with pytest.raises(urllib.error.HTTPError) as http:
            urllib.request.urlopen(url, timeout=10)
        assert http.value.code == 503
        assert "KV cache buffer" in json.loads(http.value.read())["reason"]
    finally:
        srv.stop()


# --------------------------------------------------------------------------- callers
def test_batch_job_writes_an_error_line_for_a_failed_request(tmp_path) -> None:  # noqa: ANN001
    import json

    from jaxserve.cli.batch_job import BatchOptions, run_batch

    engine = fake_engine(ArithmeticRunner(VOCAB, InjectedFault(MARK, name_rows=True)))
    lines = [{"id": "good", "prompt": [8, 9], "max_tokens": 4, "temperature": 0.0,
              "ignore_eos": True},
             {"id": "bad", "prompt": [3, MARK], "max_tokens": 4}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = run_batch(engine, src, tmp_path / "out.jsonl", BatchOptions(progress=False))
    good, bad = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert good["id"] == "good" and good["finish_reason"] == "length"
    assert bad["id"] == "bad" and "injected fault" in bad["error"]
    assert (summary.ok, summary.errors) == (1, 1) and pages_all_free(engine)


def test_multihost_leader_step_failures_are_fatal() -> None:
    from jaxserve.device import multihost
    from jaxserve.device.model_runner import empty_batch
    from jaxserve.engine.runner import RunnerFailed

    class Broken:  # a runner whose step fails before touching the device
        compiles_after_warmup = 0

        def dispatch(self, batch):  # noqa: ANN001, ANN202
            raise ValueError("bad input")

        def close(self) -> None:
            return None

    shape = fake_engine().plan.batch_shape
    t, s = shape.buckets[0]
    lead = multihost.LeaderRunner(Broken())  # type: ignore[arg-type]
    with pytest.raises(RunnerFailed) as first:
        lead.execute(empty_batch(shape, t, s, False))
    with pytest.raises(RunnerFailed) as second:
        lead.execute(empty_batch(shape, t, s, False))
    # The followers may be inside the step's collectives: nothing may run after it.
    assert first.value.fatal and "bad input" in str(first.value)
    assert second.value.fatal and "broken" in str(second.value)
    lead.close()  # announces nothing more; does not hang
