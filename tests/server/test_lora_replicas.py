"""The serving layer's LoRA adapters (`serving/lora_adapters.py`, `lora_requests.py`) under
the fronts: a load reads the adapter on a worker thread while a step runs, then registers it
on each replica's loop thread between two steps; loads and unloads go to every
data-parallel replica or on none; an unload lets requests already running under the adapter
finish under it, and refuses new ones (`LoraNotFound`). Fake-runner engines with real PEFT
checks (`support.lora_fakes`); the oracle is the arithmetic shifted by the adapter's offset."""

from __future__ import annotations

import asyncio
import pathlib
import threading

import pytest
from support.fake_engines import GatedRunner, wait_until
from support.lora_fakes import PeftCheckedLoader, lora_fake_engine, lora_oracle, write_peft_dir

from jaxserve import LoRARequest, SamplingParams
from jaxserve.engine.errors import InvalidRequest
from jaxserve.serving.async_engine import AsyncEngine
from jaxserve.serving.async_replica_pool import AsyncReplicaPool
from jaxserve.serving.lora_adapters import LoraAdmin
from jaxserve.serving.lora_requests import LoraNotFound
from jaxserve.serving.replica_pool import ReplicaPool
from jaxserve.serving.router import make_router

PROMPT = [11, 12, 13, 14]
GREEDY = dict(temperature=0.0, ignore_eos=True)


async def tokens(stream) -> list[int]:  # noqa: ANN001
    outs = [out async for out in stream]
    assert outs[-1].finished
    return [t for out in outs for t in out.outputs[0].delta_token_ids]


class Refusing(PeftCheckedLoader):
    """Refuses one path (a replica whose disk lacks the adapter)."""

    def __init__(self, max_rank: int, refused: str):
        super().__init__(max_rank)
        self.refused = refused

    def __call__(self, path: str):  # noqa: ANN204
        if path == self.refused:
            raise FileNotFoundError(f"{path}: not on this replica's disk")
        return super().__call__(path)


def test_every_replica_or_none(tmp_path: pathlib.Path) -> None:
    a = write_peft_dir(tmp_path / "a", 5, seed=1)
    b = write_peft_dir(tmp_path / "b", 9, seed=2)
    engines = [lora_fake_engine(), lora_fake_engine()]
    # Replica 1 alone holds an adapter of lora_int_id 7 (registered behind the pool's back):
    # a load with that id succeeds on replica 0 and is refused on replica 1.
    engines[1].add_lora(LoRARequest("other", 7, str(a)))
    replicas = [AsyncEngine(e) for e in engines]
    pool = AsyncReplicaPool(replicas, make_router(engines))
    pool.start()
    loras = LoraAdmin(pool, engines[0], ("base",))

    async def main() -> None:
        added = await loras.load("a", str(a))
        assert [e.list_loras()[-1] for e in engines] == [added, added]
        # Requests under it on both replicas (several at once: the router spreads them).
        streams = [pool.submit(f"r{i}", PROMPT, SamplingParams(max_tokens=6, **GREEDY),
                               lora=loras.resolve("a")) for i in range(6)]
        for s in streams:
            assert await tokens(s) == lora_oracle(PROMPT, 6, 5)
        with pytest.raises(InvalidRequest, match="lora_int_id 7") as info:
            await loras.load("b", str(b), 7)
        assert info.value.field == "lora_int_id"
        assert [[r.lora_name for r in e.list_loras()] for e in engines] == [
            ["a"], ["other", "a"]]  # replica 0 let "b" go again
        await loras.unload("a")
        assert [[r.lora_name for r in e.list_loras()] for e in engines] == [[], ["other"]]
        with pytest.raises(LoraNotFound):
            loras.resolve("a")

    try:
        asyncio.run(main())
    finally:
        pool.stop()


def test_unload_lets_a_running_request_finish_under_it(tmp_path: pathlib.Path) -> None:
    a = write_peft_dir(tmp_path / "a", 5, seed=1)
    runner = GatedRunner()
    engine = lora_fake_engine((("a", str(a)),), runner=runner)
    ae = AsyncEngine(engine)
    ae.start()
    loras = LoraAdmin(ae, engine, ("base",))

    async def main() -> None:
        lora = loras.resolve("a")
        stream = ae.submit("r", PROMPT, SamplingParams(max_tokens=8, **GREEDY), lora=lora)
        await asyncio.get_running_loop().run_in_executor(
            None, wait_until, runner.blocked.is_set, "the first step to wait for its permit")
        unload = asyncio.ensure_future(loras.unload("a"))
        await asyncio.sleep(0)  # let it queue its command
        assert not unload.done() and engine.resolve_lora("a") == lora  # a step is running
        runner.allow(100)
        assert (await unload) == lora
        assert await tokens(stream) == lora_oracle(PROMPT, 8, 5)  # finished under it
        # Resolved before the unload, queued after it: refused, never re-registered.
        late = ae.submit("late", PROMPT, SamplingParams(max_tokens=2, **GREEDY), lora=lora)
        with pytest.raises(LoraNotFound):
            await late.__anext__()
        assert engine.list_loras() == []

    try:
        asyncio.run(main())
    finally:
        runner.allow(100)
        ae.stop()


def test_offline_replica_pool_adds_everywhere_or_nowhere(tmp_path: pathlib.Path) -> None:
    a = write_peft_dir(tmp_path / "a", 5, seed=1)
    b = write_peft_dir(tmp_path / "b", 9, seed=2)
    engines = [lora_fake_engine(), lora_fake_engine(loader=Refusing(8, str(b)))]
    pool = ReplicaPool(engines, make_router(engines))
    try:
        pool.add_lora(LoRARequest("a", 1, str(a)))
        assert [e.resolve_lora("a") for e in engines] == [pool.resolve_lora("a")] * 2
        with pytest.raises(InvalidRequest, match="not on this replica's disk"):
            pool.add_lora(LoRARequest("b", 2, str(b)))
        assert [[r.lora_name for r in e.list_loras()] for e in engines] == [["a"], ["a"]]
        for i in range(4):  # spread over both replicas by load
            pool.add_request(f"r{i}", PROMPT, SamplingParams(max_tokens=5, **GREEDY),
                             lora_request=pool.resolve_lora("a"))
        finals = {}
        while pool.has_unfinished():
            finals.update({o.request_id: o for o in pool.step() if o.finished})
        assert {rid: list(o.outputs[0].token_ids) for rid, o in finals.items()} == {
            f"r{i}": lora_oracle(PROMPT, 5, 5) for i in range(4)}
        assert pool.remove_lora("a") and not pool.remove_lora("a")
        assert pool.list_loras() == [] == engines[1].list_loras()
    finally:
        pool.close()


class Recording(PeftCheckedLoader):
    """Records the thread of every read."""

    def __init__(self, max_rank: int):
        super().__init__(max_rank)
        self.threads: list[str] = []

    def __call__(self, path: str):  # noqa: ANN204
        self.threads.append(threading.current_thread().name)
        return super().__call__(path)


def test_load_reads_off_the_loop_thread_while_a_step_runs(tmp_path: pathlib.Path) -> None:
    a = write_peft_dir(tmp_path / "a", 5, seed=1)
    runner, loader = GatedRunner(), Recording(8)
    engine = lora_fake_engine(runner=runner, loader=loader)
    ae = AsyncEngine(engine)
    ae.start()
    loras = LoraAdmin(ae, engine, ("base",))

    async def main() -> None:
        stream = ae.submit("r", PROMPT, SamplingParams(max_tokens=3, **GREEDY))
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, wait_until, runner.blocked.is_set,
                                   "the first step to wait for its permit")
        load = asyncio.ensure_future(loras.load("a", str(a)))
        # The read completes while the loop thread is held inside a step.
        await loop.run_in_executor(None, wait_until, lambda: loader.threads, "the read")
        assert loader.threads[0] != "jaxserve-engine"
        assert not load.done() and engine.resolve_lora("a") is None  # registered between steps
        runner.allow(100)
        added = await load
        assert engine.resolve_lora("a") == added and len(loader.threads) == 1
        assert await tokens(stream) == lora_oracle(PROMPT, 3)

    try:
        asyncio.run(main())
    finally:
        runner.allow(100)
        ae.stop()
