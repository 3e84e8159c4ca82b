"""One admission path: the same bad input gets the same error text from `LLM`, the gRPC front
and the HTTP front (each front only renames the field), each check is written once, and the
Engine's read-only `limits` / `stats()` report what the scheduler and allocator hold.

Engines run the arithmetic fake runner (no model, no compile)."""

from __future__ import annotations

import asyncio
import itertools
import json
import pathlib
import re
import time
import urllib.request

import aiohttp
import grpc
import pytest
from support.fake_engines import GatedRunner, fake_engine

from jaxserve import LLM, SamplingParams
from jaxserve.engine.fake_runner import ArithmeticRunner
from jaxserve.engine.limits import EngineStats, InvalidRequest
from jaxserve.server.background import BackgroundServer
from jaxserve.server.client import Client, pb2
from jaxserve.server.config import ServerConfig
from jaxserve.serving.served import ServedModel
from jaxserve.serving.replica_pool import ReplicaPool
from jaxserve.serving.router import make_router

DEADLINE_S = 20.0
KV_PAGES = 12  # 96 tokens of KV: less than one max_model_len (128) sequence
ROOT = pathlib.Path(__file__).resolve().parents[2]


def small_kv_engine(runner: ArithmeticRunner | None = None):  # noqa: ANN201 - an Engine
    probe = fake_engine()
    return fake_engine(runner, kv_cache_memory=KV_PAGES * probe.plan.kv_bytes_per_page)


@pytest.fixture(scope="module")
def gate() -> GatedRunner:
    return GatedRunner()


@pytest.fixture(scope="module")
def server(gate: GatedRunner) -> BackgroundServer:
    # Gated: refused requests never reach a step; the one held request waits at its step.
    srv = BackgroundServer(ServerConfig(port=0, http_port=0),
                           lambda: ServedModel(small_kv_engine(gate), "fake")).start()
    yield srv
    gate.allow(10000)
    srv.stop()


@pytest.fixture(scope="module")
def llm() -> LLM:
    """The offline API over an engine like the server's (same limits, same KV pages)."""
    obj = LLM.__new__(LLM)  # LLM() builds a model; the facade's own code is what is tested
    obj.engine = small_kv_engine()
    obj.config = obj.engine.config
    obj._ids = itertools.count()
    return obj


# Offline name of the field -> the gRPC and HTTP names (None: not expressible there).
GRPC_NAMES = {"prompt_token_ids": "token_ids.ids", "messages": "chat.messages",
              "prompt": "prompt", "request_id": "request_id"}
HTTP_NAMES = {"prompt_token_ids": "prompt", "prompt": "prompt"}

IDS = [5, 6, 7]
# (prompt, sampling kwargs, offline field, a phrase of the message)
CASES = [
    (IDS, dict(temperature=-0.5), "temperature", "must be 0 (greedy) or in [1e-05, 100]"),
    (IDS, dict(top_p=1.5), "top_p", "must be in (0, 1]"),
    (IDS, dict(top_k=-2), "top_k", "must be -1 or 0 (disabled) or an integer in [1, "),
    (IDS, dict(max_tokens=-1), "max_tokens", "must be an integer in [0, "),
    (IDS, dict(max_tokens=126), "max_tokens", "max_tokens must be in [0, 125]"),
    (IDS, dict(logprobs=21), "logprobs", "must be an integer in [0, 20]"),
    (IDS, dict(n=17), "n", "must be an integer in [1, 16]"),
    (IDS, dict(min_tokens=9, max_tokens=4), "min_tokens", "must be <= max_tokens=4"),
    ([5] * 200, {}, "prompt", "has 200 tokens; max_model_len=128 allows at most 127"),
    ("w5 " * 130, {}, "prompt", "max_model_len=128 allows at most 127 prompt tokens"),
    ([5, 999], {}, "prompt_token_ids", "[1]=999 is outside the vocabulary [0, 211)"),
    ([-1], {}, "prompt_token_ids", "[0]=-1 is outside the vocabulary"),
    ("", {}, "prompt", " must not be empty"),
    ([], {}, "prompt_token_ids", " must not be empty"),
    (IDS, dict(max_tokens=100), "prompt", "need 13 KV pages but the cache holds only 12"),
    # Bounds on every field (issue #13): float32-safe floats, int32 / vocabulary integers,
    # counts, and the prompt byte bound (the tiny word-level tokenizer may drop whitespace,
    # so it gets the fallback of 256 bytes per token: 128 * 256).
    (IDS, dict(temperature=150.0), "temperature", "must be 0 (greedy) or in [1e-05, 100]"),
    (IDS, dict(repetition_penalty=200.0), "repetition_penalty", "must be in [0.01, 100]"),
    (IDS, dict(top_k=2**31 - 1), "top_k",
     "top_k=2147483647 must be -1 or 0 (disabled) or in [1, 211] (the vocabulary size)"),
    (IDS, dict(stop_token_ids=[5, 211]), "stop_token_ids",
     "stop_token_ids[1]=211 is outside the vocabulary [0, 211)"),
    (IDS, dict(stop_token_ids=[5] * 65), "stop_token_ids", "has 65 ids; at most 64"),
    (IDS, dict(logit_bias={5: 101.0}), "logit_bias", "logit_bias[5]=101.0 must be in [-100, 100]"),
    (IDS, dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias",
     "logit_bias has 301 entries; at most 300"),
    (IDS, dict(logit_bias={5: 1.0, 211: -1.0}), "logit_bias",
     "logit_bias key 211 is outside the vocabulary [0, 211)"),
    (IDS, dict(logit_bias={-1: 1.0}), "logit_bias", "logit_bias key -1 must be a token id"),
    ("w5 " * 11000, {}, "prompt", "prompt is at least 33000 bytes long; at most 32768 bytes"),
]
# Values the gRPC messages cannot carry (int32 / uint64 / float32 fields, UTF-8 strings):
# the offline API and HTTP agree, and the server keeps serving (the 500s and its
# engine-killing top_k >= 2**1024).
LLM_HTTP_CASES = [
    (IDS, dict(top_k=2**1024), "top_k", "must be -1 or 0 (disabled) or an integer in [1, "),
    (IDS, dict(temperature=1e39), "temperature", "temperature=1e+39 must be 0 (greedy) or in"),
    (IDS, dict(top_p=1e39), "top_p", "top_p=1e+39 must be in (0, 1]"),
    (IDS, dict(temperature=10**400), "temperature", "must be a finite number"),  # OverflowError
    (IDS, dict(presence_penalty=1e39), "presence_penalty", "must be in [-2, 2]"),
    (IDS, dict(repetition_penalty=1e39), "repetition_penalty", "must be in [0.01, 100]"),
    (IDS, dict(seed=2**64), "seed", "must be an integer in [0, 18446744073709551615]"),
    (IDS, dict(max_tokens=2**31), "max_tokens", "must be an integer in [0, 2147483647]"),
    ("w5 \ud800", {}, "prompt", "prompt is not valid Unicode: character 3 is a lone UTF-16 "
                                "surrogate"),
    (IDS, dict(stop=["w9", "\udc00"]), "stop", "stop[1] is not valid Unicode"),
    (IDS, dict(logit_bias={"x": 1.0}), "logit_bias", "logit_bias key 'x' must be a token id"),
    (IDS, dict(logit_bias={"5": "a"}), "logit_bias",
     "logit_bias[5]='a' must be a finite number in [-100, 100]"),
    (IDS, dict(logit_bias={5: 1e39}), "logit_bias", "logit_bias[5]=1e+39 must be in [-100, 100]"),
]


def offline_error(llm: LLM, prompt: object, sampling: dict) -> InvalidRequest | ValueError:
    with pytest.raises(ValueError) as err:
        llm.generate([prompt], SamplingParams(**{"max_tokens": 4, **sampling}),
                     use_tqdm=False)
    return err.value


def grpc_error(server: BackgroundServer, prompt: object, sampling: dict,
               **request: object) -> str:
    kw = dict(request)
    if isinstance(prompt, str):
        kw["prompt"] = prompt
    elif prompt is not None:
        kw["token_ids"] = pb2.TokenIds(ids=prompt)
    req = pb2.GenerateRequest(sampling=pb2.SamplingParams(**{"max_tokens": 4, **sampling}),
                              **kw)
    with Client(server.target) as client:
        with pytest.raises(grpc.RpcError) as err:
            list(client.stub.Generate(req, timeout=DEADLINE_S))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    return err.value.details()


def http_errors(server: BackgroundServer, bodies: list[dict]) -> list[dict]:
    url = f"http://127.0.0.1:{server.server.http_port}/v1/completions"

    async def post(session: aiohttp.ClientSession, body: dict) -> dict:
        async with session.post(url, data=json.dumps(body),
                                headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 400, (body, await resp.text())
            return (await resp.json())["error"]

    async def main() -> list[dict]:
        async with aiohttp.ClientSession() as session:
            return list(await asyncio.gather(*(post(session, b) for b in bodies)))

    return asyncio.run(main())


def after(message: str, name: str) -> str:
    """The message past its leading field name."""
    assert message.startswith(name), (message, name)
    return message[len(name):]


def test_same_bad_input_same_text_everywhere(server: BackgroundServer, llm: LLM) -> None:
    bodies = [{"prompt": p, "max_tokens": 4, **s} for p, s, _, _ in CASES]
    http = http_errors(server, bodies)
    for (prompt, sampling, field, phrase), h in zip(CASES, http):
        off = offline_error(llm, prompt, sampling)
        offline = str(off)
        assert phrase in offline, (prompt, sampling, offline)
        text = after(offline, field)
        assert InvalidRequest.of(off).field == field, offline
        g = grpc_error(server, prompt, sampling)
        grpc_name = GRPC_NAMES.get(field, f"sampling.{field}")
        assert after(g, grpc_name) == text, (g, offline)
        http_name = HTTP_NAMES.get(field, field)
        assert h["param"] == http_name and h["type"] == "invalid_request_error", h
        assert after(h["message"], http_name) == text, (h, offline)
    # Every refusal left the engines clean.
    assert not llm.engine.has_unfinished()
    assert llm.engine.stats().kv_pages_used == 0


def test_unwireable_values_same_text_offline_and_http(server: BackgroundServer,
                                                      llm: LLM) -> None:
    bodies = [{"prompt": p, "max_tokens": 4, **s} for p, s, _, _ in LLM_HTTP_CASES]
    http = http_errors(server, bodies)
    for (prompt, sampling, field, phrase), h in zip(LLM_HTTP_CASES, http):
        off = offline_error(llm, prompt, sampling)
        assert phrase in str(off) and InvalidRequest.of(off).field == field, str(off)
        http_name = HTTP_NAMES.get(field, field)
        assert h["param"] == http_name, h
        assert after(h["message"], http_name) == after(str(off), field), (h, str(off))
    assert server.server.engine.error is None  # nothing reached a step
    with urllib.request.urlopen(f"http://127.0.0.1:{server.server.http_port}/health",
                                timeout=DEADLINE_S) as resp:
        assert resp.status == 200


def test_client_priority_range_at_the_fronts_only(server: BackgroundServer, llm: LLM) -> None:
    """Callers of the fronts may not jump the queue (default range [0, 2**31 - 1]); the
    offline API, a trusted caller, may use any int64 priority."""
    g = grpc_error(server, IDS, {}, priority=-2**31)
    assert g == "priority=-2147483648 must be in [0, 2147483647]"
    with pytest.raises(ValueError, match=r"^priority=9223372036854775808 must be in "
                                         r"\[-9223372036854775808, 9223372036854775807\]"):
        llm.generate([IDS], SamplingParams(max_tokens=1), use_tqdm=False, priority=[2**63])
    out = llm.generate([IDS], SamplingParams(max_tokens=1), use_tqdm=False, priority=[-2**31])
    assert len(out[0].outputs[0].token_ids) == 1


def test_chat_size_same_text_offline_and_grpc(server: BackgroundServer, llm: LLM) -> None:
    msgs = [{"role": "user", "content": "w5 " * 6000}, {"role": "user", "content": "w6 " * 6000}]
    with pytest.raises(ValueError) as err:
        llm.chat(msgs, SamplingParams(max_tokens=2), use_tqdm=False)
    offline = str(err.value)
    assert offline.startswith("messages (the sum of the contents) is at least 36000 bytes")
    chat = pb2.ChatMessages(messages=[pb2.ChatMessage(**m) for m in msgs])
    assert after(grpc_error(server, None, {}, chat=chat), "chat.messages") == \
        after(offline, "messages")


def test_chat_roles_same_text_offline_and_grpc(server: BackgroundServer, llm: LLM) -> None:
    msgs = [{"role": "user", "content": "w5"}, {"role": "robot", "content": "w6"}]
    with pytest.raises(ValueError) as err:
        llm.chat(msgs, SamplingParams(max_tokens=2), use_tqdm=False)
    offline = str(err.value)
    assert offline.startswith("messages[1].role='robot' must be one of system, user")
    chat = pb2.ChatMessages(messages=[pb2.ChatMessage(**m) for m in msgs])
    g = grpc_error(server, None, {}, chat=chat)
    assert after(g, "chat.messages") == after(offline, "messages")


def test_duplicate_in_flight_id_same_text_engine_and_grpc(server: BackgroundServer,
                                                          gate: GatedRunner) -> None:
    engine = fake_engine()
    engine.add_request("same", IDS, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError) as err:
        engine.add_request("same", IDS, SamplingParams(max_tokens=2))
    offline = str(err.value)
    assert offline.startswith("request_id='same' is already in flight")
    with Client(server.target) as client:
        held = client.stream(IDS, SamplingParams(max_tokens=2), request_id="same")
        deadline = time.monotonic() + DEADLINE_S
        while server.server.engine.num_in_flight == 0:  # admitted, held at its step
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert grpc_error(server, IDS, {}, request_id="same") == offline
        gate.allow(100)
        assert [m.finished.reason for m in held if m.HasField("finished")] == [pb2.LENGTH]


def test_each_check_is_written_once() -> None:
    """The message of every request check appears in one source file only."""
    sources = [p for d in ("jaxserve", "server") for p in (ROOT / d).rglob("*.py")]
    texts = {p: p.read_text() for p in sources}
    for phrase in ("is already in flight", "is outside the vocabulary",
                   '"prompt must not be empty"', "prompt_token_ids must not be empty",
                   "prompt tokenizes to no tokens", "is over the limit",
                   "KV pages but the cache", "messages must not be empty", "].role=",
                   "request_id is {len(", "tokens; max_model_len=", "is not valid Unicode",
                   "bytes can \"", "(disabled) or in \"", "ids; at most", "must be in [{lo}",
                   "messages; at most", "].content must be a string"):
        holders = [p.relative_to(ROOT) for p, t in texts.items() if phrase in t]
        assert len(holders) == 1, (phrase, holders)
    # Fronts and metrics read the engine's limits / stats, never its internals.
    for rel in ("server/openai_http.py", "server/servicer.py", "jaxserve/serving/metrics.py",
                "jaxserve/serving/async_engine.py"):
        text = (ROOT / rel).read_text()
        for internal in (r"\.scheduler\b", r"\.allocator\b", r"\.plan\.", "batch_shape"):
            # (a word: the engine's public scheduler_settings() is not its scheduler)
            assert not re.search(internal, text), (rel, internal)
    http = (ROOT / "server/openai_http.py").read_text()
    assert "import re\n" not in http and "proto_map" not in http and "Interceptor" not in http
    assert len(http.splitlines()) < 400


# --------------------------------------------------------------------------- limits / stats
def test_limits_describe_the_plan() -> None:
    engine = small_kv_engine()
    lim = engine.limits
    sc = engine.plan.scheduler
    assert (lim.max_model_len, lim.vocab_size, lim.page_size, lim.num_kv_pages) == \
        (128, 211, 8, KV_PAGES)
    assert lim.num_kv_pages == engine.scheduler.allocator.num_usable_pages == sc.num_pages - 1
    assert (lim.max_num_seqs, lim.max_num_batched_tokens) == (4, 64)
    assert lim.eos_token_ids == (2,) and (lim.max_logprobs, lim.max_n) == (20, 16)
    with pytest.raises(AttributeError):
        engine.limits = lim  # type: ignore[misc] - read-only
    with pytest.raises(Exception):
        lim.max_model_len = 1  # type: ignore[misc] - frozen


def drive(engine, until=None) -> None:  # noqa: ANN001
    for _ in range(1000):
        if not engine.has_unfinished() or (until is not None and until()):
            return
        engine.step()
    raise AssertionError("the engine did not finish")


def test_stats_count_what_the_engine_did() -> None:
    engine = fake_engine(max_num_seqs=4, max_num_batched_tokens=64)  # prefix caching on
    st = engine.stats()
    assert st == EngineStats(0, 0, 0, 0, engine.limits.num_kv_pages, 0, 0, 0, 0, 0, 0)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    prompt = list(range(10, 27))  # 17 tokens: 2 full pages, 3 pages with the first token
    engine.add_request("a", prompt, params)
    engine.add_request("b", [5, 6], SamplingParams(max_tokens=3, ignore_eos=True, n=2))
    st = engine.stats()
    assert (st.num_requests, st.num_waiting, st.num_running, st.kv_pages_used) == (2, 3, 0, 0)
    engine.step()  # both prompts prefill in one step (19 tokens); b's second sample waits
    st = engine.stats()
    assert (st.num_running, st.num_waiting) == (2, 1)
    assert (st.num_steps, st.last_step_tokens) == (1, 19)
    assert st.kv_pages_used == 3 + 1 and st.kv_usage == pytest.approx(4 / st.kv_pages_total)
    # a looked up its 2 full pages (16 tokens), found none; b has no full page.
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (16, 0)
    drive(engine)
    st = engine.stats()
    assert (st.num_requests, st.num_running, st.num_waiting, st.kv_pages_used) == (0, 0, 0, 0)
    engine.add_request("c", prompt + [99], params)  # shares a's 2 cached full pages
    engine.step()
    st = engine.stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (32, 16)
    assert st.compiles_after_warmup == 0 and st.num_preemptions == 0


def test_stats_count_preemptions_and_replicas_add_up() -> None:
    probe = fake_engine()
    engine = fake_engine(max_num_seqs=2, max_num_batched_tokens=16,
                         kv_cache_memory=4 * probe.plan.kv_bytes_per_page)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engine.add_request("a", [5] * 8, params)  # each needs 3 of the 4 pages to finish
    engine.add_request("b", [6] * 8, params)
    drive(engine)
    st = engine.stats()
    assert st.num_preemptions >= 1 and st.num_preemptions == engine.scheduler.num_preemptions
    engines = [fake_engine(), fake_engine()]
    pool = ReplicaPool(engines, make_router(engines))
    for i in range(3):
        pool.add_request(f"r{i}", [i + 5, 9], SamplingParams(max_tokens=2))
    total = pool.stats()
    assert total.num_requests == 3 and total.num_waiting == 3
    assert total.kv_pages_total == 2 * engines[0].limits.num_kv_pages
    assert pool.limits == engines[0].limits
    pool.close()
