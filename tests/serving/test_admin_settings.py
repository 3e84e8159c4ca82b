"""Live scheduler changes through the serving layer (`serving/admin_settings.py`): applied
by each AsyncEngine's loop thread between two steps (a gated runner holds a step and the
change waits for it), on every data-parallel replica or on none (replicas built with
different compiled bounds: a change one of them refuses changes neither)."""

from __future__ import annotations

import asyncio

import pytest
from support.fake_engines import GatedRunner, fake_engine, wait_until

from jaxserve import SamplingParams
from jaxserve.engine.errors import InvalidRequest
from jaxserve.serving.async_engine import AsyncEngine, EngineStopped
from jaxserve.serving.async_replica_pool import AsyncReplicaPool
from jaxserve.serving.router import make_router
from jaxserve.serving.admin_settings import SchedulerAdmin


def test_change_is_applied_by_the_loop_thread_between_steps() -> None:
    runner = GatedRunner()
    engine = fake_engine(runner)
    ae = AsyncEngine(engine)
    ae.start()
    admin = SchedulerAdmin(ae)

    async def main() -> None:
        stream = ae.submit("r", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0,
                                                          ignore_eos=True))
        await asyncio.get_running_loop().run_in_executor(
            None, wait_until, runner.blocked.is_set, "the first step to wait for its permit")
        change = asyncio.ensure_future(admin.update({"max_num_seqs": 2}))
        await asyncio.sleep(0)  # let it queue its command
        # The loop thread is inside a step: nothing touched the scheduler yet.
        assert not change.done()
        assert engine.scheduler.cfg.max_num_seqs == 4 and admin.settings()["max_num_seqs"] == 4
        runner.allow(10)
        before, after = await change
        assert (before["max_num_seqs"], after["max_num_seqs"]) == (4, 2)
        assert admin.settings() == after == engine.scheduler_settings()
        outs = [out async for out in stream]
        assert outs[-1].finished and outs[-1].outputs[0].num_tokens == 3

    try:
        asyncio.run(main())
    finally:
        runner.allow(100)
        ae.stop()
    with pytest.raises(EngineStopped):
        ae.reconfigure({"max_num_seqs": 3})


def _pool(engines):  # noqa: ANN001, ANN202
    replicas = [AsyncEngine(e) for e in engines]
    pool = AsyncReplicaPool(replicas, make_router(engines))
    pool.start()
    return pool


def test_every_replica_or_none() -> None:
    # Replica 1 compiled buckets for 2 sequences only: 3 is fine on replica 0, not on 1.
    engines = [fake_engine(), fake_engine(max_num_seqs=2)]
    pool = _pool(engines)
    admin = SchedulerAdmin(pool)

    async def main() -> None:
        with pytest.raises(InvalidRequest, match=r"max_num_seqs=3 is past what start-up compiled: at most "
                                                 r"2") as info:
            await admin.update({"max_num_seqs": 3, "itl_slo": 0.5})
        assert info.value.field == "max_num_seqs"
        assert [e.scheduler_settings()["max_num_seqs"] for e in engines] == [4, 2]
        assert [e.scheduler_settings()["itl_slo"] for e in engines] == [None, None]
        before, after = await admin.update({"max_num_seqs": 1, "itl_slo": "0.5,1=2"})
        assert before["max_num_seqs"] == 4
        assert after["itl_slo"] == {"default": 0.5, "1": 2.0}
        assert [e.scheduler_settings() for e in engines] == [after, after]

    try:
        asyncio.run(main())
    finally:
        pool.stop()
