"""Data parallelism: the router's policy, the replica facades, and DP x TP engines on 8 virtual
CPU devices against TP 1 (the oracle).

Router and facades run on fake engines (ArithmeticRunner: arithmetic outputs, no jax). The
model runs are in a subprocess (`tests/support/workers/dp_worker.py`) because the device count is fixed when
jax starts: DP 2 x TP 2 and DP 2 x TP 1, for a model whose KV heads divide TP and one whose do
not, give the TP 1 greedy tokens and top-5 logprobs within 1e-5 relative, compile nothing
after warmup on any replica, hold each replica's weights and pages on its own devices only,
and share the work; a DP 2 x TP 2 gRPC server streams the same tokens.

The default run checks DP 2 x TP 2 of the model whose KV heads TP replicates (and its TP 1),
with two token buckets; the other three offline configurations, with the default buckets,
are marked slow (JAXSERVE_RUN_SLOW=1): the whole grid costs ~6 minutes of compiles on 2 cores.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from support.workers.dp_worker import DEFAULT_ROWS, MODELS, SIZES
from support.engine_fixtures import run_device_worker
from support.fake_engines import GatedRunner, fake_engine

from jaxserve.config import EngineConfig
from jaxserve.engine.block_allocator import hash_pages
from jaxserve.engine.fake_runner import arithmetic_next_token
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.serving.async_engine import AsyncEngine, QueueFull
from jaxserve.serving.async_replica_pool import AsyncReplicaPool
from jaxserve.serving.replica_pool import ReplicaPool
from jaxserve.serving.router import ReplicaRouter, make_router

# The module's fixture runs a subprocess worker with its own 900 s limit; its first test
# (which builds the fixture) may take that long, and the limit lies past it so that the
# worker's TimeoutExpired, with its stderr, is what reports a hang.
pytestmark = pytest.mark.timeout(960)

VOCAB = 211  # engine_fixtures.VOCAB, which fake_engine's plan uses


# ------------------------------------------------------------------------- router policy
def pick(r: ReplicaRouter, loads: list[int], ids: list[int] | None) -> int:
    """Route a request and record it where it was routed (what the facades do)."""
    route = r.choose(loads, r.page_hashes(ids))
    r.record(route, route.replica)
    return route.replica


def test_least_loaded_and_ties_rotate() -> None:
    r = ReplicaRouter(3, page_size=4, capacity_pages=100)
    assert pick(r, [2, 0, 1], None) == 1
    assert pick(r, [5, 5, 1], [1, 2, 3]) == 2
    # Equal loads: successive picks spread instead of piling on replica 0.
    assert [pick(r, [0, 0, 0], None) for _ in range(3)] == [0, 1, 2]


def test_prefix_affinity_within_slack() -> None:
    r = ReplicaRouter(2, page_size=4, capacity_pages=100, slack=2)
    system = list(range(100, 112))  # three full pages shared by every prompt below
    assert pick(r, [0, 0], system + [1]) == 0
    # Replica 0 holds the prefix: it wins while it is at most `slack` requests busier ...
    assert pick(r, [2, 0], system + [2]) == 0
    assert r.prefix_routed == 1
    # ... and load wins beyond that; the prefix is then recorded on replica 1 too.
    assert pick(r, [3, 0], system + [3]) == 1
    assert pick(r, [3, 1], system + [4]) == 1  # both match: the less loaded
    # A prompt shorter than one page has no full page to match: load only.
    assert pick(r, [0, 1], [7, 7]) == 0


def test_longest_match_wins_and_records_are_bounded() -> None:
    r = ReplicaRouter(2, page_size=2, capacity_pages=3, slack=0)
    assert pick(r, [0, 0], [1, 2, 3, 4]) == 0
    assert pick(r, [1, 0], [1, 2, 9, 9, 5, 6]) == 1  # slack 0: load beats a 1-page match
    assert pick(r, [0, 0], [1, 2, 9, 9, 8, 8]) == 1  # 2 pages matched on 1, 1 page on 0
    # Replica 1 remembers 3 pages at most: two new ones push out the oldest.
    assert pick(r, [5, 0], [5, 5, 6, 6]) == 1
    assert r._matched(1, hash_pages([1, 2, 9, 9], 2)) == 0  # noqa: SLF001 - forgotten
    assert r._matched(0, hash_pages([1, 2, 3, 4], 2)) == 2  # noqa: SLF001 - kept


@pytest.mark.parametrize("aware", [True, False])
def test_no_prefix_routing_when_caching_is_off(aware: bool) -> None:
    r = ReplicaRouter(2, page_size=2, capacity_pages=8, prefix_aware=aware, slack=10)
    assert pick(r, [0, 0], [1, 2, 3, 4]) == 0
    assert pick(r, [1, 0], [1, 2, 3, 4]) == (0 if aware else 1)


def test_a_route_is_recorded_only_where_the_request_went() -> None:
    r = ReplicaRouter(2, page_size=2, capacity_pages=8, slack=4)
    first = r.choose([0, 0], r.page_hashes([1, 2, 3, 4]))
    assert first.replica == 0 and not first.by_prefix
    r.record(first, 1)  # replica 0 was full: replica 1 took it
    again = r.choose([0, 1], r.page_hashes([1, 2, 3, 4, 5]))
    assert again.replica == 1 and again.by_prefix  # past the idle replica 0, for its prefix
    r.record(again, 0)  # but replica 1 was full: not counted as routed by prefix
    assert r.prefix_routed == 0
    assert r._matched(0, again.hashes) == 2  # noqa: SLF001 - replica 0 took the pages


def test_ids_that_are_not_token_ids_route_by_load() -> None:
    """Hashing must not crash on them: the engine refuses them, naming the bad id."""
    r = ReplicaRouter(2, page_size=2, capacity_pages=8)
    assert r.page_hashes([2**70, 1, 2, 3]) == ()
    assert r.page_hashes(None) == ()
    engines = [fake_engine(), fake_engine()]
    pool = ReplicaPool(engines, make_router(engines))
    with pytest.raises(ValueError, match=r"prompt_token_ids\[0\]=1180591620717411303424"):
        pool.add_request("bad", [2**70] + [1] * 20, SamplingParams(max_tokens=2))
    assert not pool.has_unfinished()


def test_router_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_replicas=0"):
        ReplicaRouter(0, 4, 8)
    with pytest.raises(ValueError, match="got 1 loads for 2 replicas"):
        ReplicaRouter(2, 4, 8).choose([0])
    with pytest.raises(ValueError, match="data_parallel_size=0"):
        EngineConfig(data_parallel_size=0)


# ------------------------------------------------------------------------- offline pool
def expected_tokens(prompt: list[int], n: int) -> list[int]:
    out, last, pos = [], prompt[-1], len(prompt) - 1
    for _ in range(n):
        last = arithmetic_next_token(last, pos, VOCAB)
        out.append(last)
        pos += 1
    return out


def test_replica_pool_serves_every_request_once_across_replicas() -> None:
    engines = [fake_engine(), fake_engine()]
    pool = ReplicaPool(engines, make_router(engines))
    prompts = [[i + 1, i + 2, i + 3] for i in range(10)]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    for i, p in enumerate(prompts):
        pool.add_request(f"r{i}", p, params)
    assert [e.num_requests for e in engines] == [5, 5]
    with pytest.raises(ValueError, match="already in flight"):
        pool.add_request("r3", [1, 2], params)
    assert pool.abort("r9") and not pool.abort("nope")
    done = {}
    while pool.has_unfinished():
        for o in pool.step():
            if o.finished:
                assert o.request_id not in done
                done[o.request_id] = o.outputs[0]
    assert sorted(done) == sorted(f"r{i}" for i in range(10))
    assert done["r9"].finish_reason.value == "abort"
    for i in range(9):
        assert list(done[f"r{i}"].token_ids) == expected_tokens(prompts[i], 5)
    assert all(e.scheduler.allocator.num_free_pages == e.scheduler.allocator.num_usable_pages
               for e in engines)
    pool.close()


def test_replica_pool_routes_a_shared_prefix_to_its_replica() -> None:
    engines = [fake_engine(), fake_engine()]  # max_num_seqs 4: slack 1
    pool = ReplicaPool(engines, make_router(engines))
    system = list(range(30, 46))  # two full pages of 8
    params = SamplingParams(max_tokens=2, ignore_eos=True)

    def run() -> None:
        while pool.has_unfinished():
            pool.step()

    pool.add_request("a", system + [1], params)  # replica 0 computes the shared pages
    run()
    pool.add_request("b", [5, 6, 7], params)  # rotation: replica 1
    pool.add_request("c", system + [2], params)  # least loaded and holds the prefix: 0
    pool.add_request("d", system + [3], params)  # 1 is less loaded; 0 holds the prefix
    assert [e.num_requests for e in engines] == [2, 1]
    assert pool.prefix_routed == 1
    run()
    # "c" and "d" each found both system pages in replica 0's cache.
    assert [e.scheduler.allocator.prefix_hits for e in engines] == [4, 0]


# ------------------------------------------------------------------------- async facade
def test_data_parallel_engine_routes_falls_back_and_aborts() -> None:
    gated = [GatedRunner(), GatedRunner()]
    engines = [fake_engine(runner=g) for g in gated]
    replicas = [AsyncEngine(e, max_waiting=1) for e in engines]
    dp = AsyncReplicaPool(replicas, make_router(engines))
    params = SamplingParams(max_tokens=3, ignore_eos=True)

    async def main() -> None:
        dp.start()
        s0 = dp.submit("a", [1, 2, 3], params)
        s1 = dp.submit("b", [4, 5, 6], params)
        assert [r.num_in_flight for r in replicas] == [1, 1]
        with pytest.raises(ValueError, match="already in flight"):
            dp.submit("a", [7], params)
        # Both queues hold one waiting sequence: the next request finds no room anywhere.
        with pytest.raises(QueueFull):
            dp.submit("c", [7, 8], params)
        assert dp.num_in_flight == 2 and dp.num_waiting == 2
        for g in gated:
            g.allow(10)
        outs = [o async for o in s0]
        assert outs[-1].finished  # DELTA outputs: the deltas add up to the tokens
        assert [t for o in outs for t in o.outputs[0].delta_token_ids] == \
            expected_tokens([1, 2, 3], 3)
        s1.abort()
        dp.abort_all()
        dp.stop()
        assert dp.error is None

    asyncio.run(main())
    for e in engines:
        assert not e.has_unfinished()
        a = e.scheduler.allocator
        assert a.num_free_pages == a.num_usable_pages


# ------------------------------------------------------------------------- 8 virtual devices
@pytest.fixture(scope="module")
def worker() -> dict:
    return run_device_worker("dp_worker.py")


def grid() -> list:
    """(model, dp, tp) of the DP runs; those outside dp_worker's default run are marked slow."""
    slow = pytest.mark.slow(reason="the rest of the DP grid: ~5 min of compiles on 2 cores")
    return [pytest.param(m, dp, tp, marks=() if (m, dp, tp) in DEFAULT_ROWS else slow)
            for m in MODELS for dp, tp in SIZES if dp > 1]


def _row(worker: dict, model: str, dp: int, tp: int) -> dict:
    return next(r for r in worker["offline"]
                if r["model"] == model and r["dp"] == dp and r["tp"] == tp)


@pytest.mark.parametrize("model,dp,tp", grid())
def test_dp_tp_matches_tp1(worker: dict, model: str, dp: int, tp: int) -> None:
    base, got = _row(worker, model, 1, 1), _row(worker, model, dp, tp)
    assert got["outputs"].keys() == base["outputs"].keys()
    for rid, want in base["outputs"].items():
        have = got["outputs"][rid]
        assert have["tokens"] == want["tokens"], rid
        for a, b in zip(have["logprobs"], want["logprobs"]):
            assert a.keys() == b.keys()
            x, y = (np.array([d[k] for k in sorted(b)]) for d in (a, b))
            # Two layouts of one model: support.numerics.model_logprob_atol (the worker's).
            assert np.abs(x - y).max() <= base["logprob_atol"], (rid, x, y)
    reps = got["replicas"]
    # The logits themselves (every prompt position, full-sequence forward on each replica's
    # sharded params) against TP 1's: support.numerics.logits_atol, from the weights.
    assert all(r["logits_err"] <= r["logits_atol"] for r in reps), reps
    assert [r["compiles_after_warmup"] for r in reps] == [0] * dp
    assert all(r["steps"] > 0 for r in reps), "every replica must have served requests"


@pytest.mark.parametrize("model,dp,tp", grid())
def test_each_replica_lives_on_its_own_devices(worker: dict, model: str, dp: int,
                                               tp: int) -> None:
    reps = _row(worker, model, dp, tp)["replicas"]
    devices = [r["devices"] for r in reps]
    assert sorted(d for row in devices for d in row) == list(range(dp * tp))
    for r in reps:
        assert r["kv_devices"] == r["devices"] and r["param_devices"] == r["devices"]
        assert r["kv_bytes_first_device"] * tp == r["kv_bytes_total"]
        assert r["param_bytes_first_device"] < r["param_bytes_total"] or tp == 1
    assert len({r["num_pages"] for r in reps}) == 1
    if tp == 1:  # sized from memory, not capped by what the sequences can use
        assert reps[0]["num_pages"] < 8 * 256 // 8 + 1


def test_grpc_server_over_dp2_tp2(worker: dict) -> None:
    served = worker["grpc_dp2_tp2"]
    base = _row(worker, "kv_replicated", 1, 1)["outputs"]
    assert served["tokens"] == {rid: o["tokens"] for rid, o in base.items()}
    # One after another, with equal loads the router alternates: both replicas served.
    assert served["generation_tokens_by_engine"] == {"0": 24.0, "1": 24.0}
    assert served["compiles_after_warmup"] == [0, 0]


def test_llm_loads_each_replica_from_a_checkpoint(worker: dict) -> None:
    """LLM(model=DIR, data_parallel_size=2, tensor_parallel_size=2): every replica reads the
    checkpoint onto its own devices and generates the TP 1 tokens."""
    got = worker["llm_dir_dp2_tp2"]
    base = _row(worker, "kv_replicated", 1, 1)["outputs"]
    assert got["tokens"] == {rid: o["tokens"] for rid, o in base.items()}
    assert got["replica_devices"] == [[0, 1], [2, 3]]
    assert got["compiles_after_warmup"] == [0, 0]
