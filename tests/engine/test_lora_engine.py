"""Multi-LoRA through the engine over the arithmetic fake runner: each row's next token is
shifted by its adapter's `offset` (`fake_runner.FakeLora`), so the oracle is the arithmetic
rollout with that offset, whatever slot the adapter landed in and whatever shares the step.

The fake runner itself refuses a load into a slot that a dispatched, uncollected step reads
and a row reading a slot never loaded; each test here also checks, at every load, that no
running sequence pinning the slot uses another adapter.
"""

from __future__ import annotations

import pytest
from support.engine_fixtures import VOCAB, tiny_model_config, tiny_tokenizer

from jaxserve import LoRARequest, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.errors import InvalidRequest
from jaxserve.engine.fake_runner import ArithmeticRunner, FakeLora, arithmetic_next_token
from jaxserve.engine.sequence import FinishReason, SequenceStatus
from jaxserve.engine.sizing import plan_engine
from jaxserve.lora_config import LoRAConfig

EOS = 2
PROMPT = [11, 12, 13, 14, 15]


class Loader:
    """`lora_path` "/fake/<offset>" -> FakeLora(offset); "/bad..." raises; counts reads."""

    def __init__(self) -> None:
        self.reads: list[str] = []
        self.broken: set[str] = set()  # paths that fail from now on

    def __call__(self, path: str) -> FakeLora:
        self.reads.append(path)
        if path.startswith("/bad") or path in self.broken:
            raise FileNotFoundError(f"no adapter_config.json under {path}")
        return FakeLora(int(path.rsplit("/", 1)[1]))


class CheckingRunner(ArithmeticRunner):
    """Records each step's adapter slots; checks every load against the running sequences."""

    def __init__(self) -> None:
        super().__init__(VOCAB)
        self.engine: Engine | None = None
        self.step_slots: list[set[int]] = []

    def load_lora(self, slot, adapter):  # noqa: ANN001, ANN201 - the Runner protocol
        assert self.engine is not None
        for r in self.engine.scheduler.running:
            if r.lora_slot == slot:  # pinned by a running sequence: must be its adapter
                assert FakeLora(int(r.lora.request.lora_path.rsplit("/", 1)[1])) == adapter
        super().load_lora(slot, adapter)

    def dispatch(self, batch, late_mask=None):  # noqa: ANN001, ANN201
        self.step_slots.append(set(batch.lora.token_slots.tolist()) - {0})
        return super().dispatch(batch, late_mask)


def lora_engine(max_loras: int = 2, overlap: bool = True, max_cpu_loras: int | None = None,
                modules: tuple = (), loader: Loader | None = None, lora: bool = True,
                proposer: object = None, **cfg: object) -> Engine:
    base = dict(max_num_seqs=8, max_num_batched_tokens=64, page_size=4, max_model_len=128,
                attention_impl="reference", async_scheduling=overlap)
    base.update(cfg)
    lc = LoRAConfig(max_loras=max_loras, max_cpu_loras=max_cpu_loras, lora_modules=modules) \
        if lora else None
    config = EngineConfig(**base, lora_config=lc)  # type: ignore[arg-type]
    plan = plan_engine(config, tiny_model_config(), 4, 1 << 30)
    runner = CheckingRunner()
    engine = Engine(config, plan, runner, tiny_tokenizer(), (EOS,),  # type: ignore[arg-type]
                    proposer=proposer, lora_loader=(loader or Loader()) if lora else None)
    runner.engine = engine
    return engine


def oracle(prompt: list[int], n: int, offset: int = 0) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(arithmetic_next_token(seq[-1], len(seq) - 1, VOCAB, offset))
    return seq[len(prompt):]


def adapter(i: int, offset: int | None = None) -> LoRARequest:
    return LoRARequest(f"ad{i}", i, f"/fake/{offset if offset is not None else 5 * i + 3}")


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens, **kw)


def run(engine: Engine, limit: int = 3000) -> dict:
    finals = {}
    for _ in range(limit):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert not engine.has_unfinished(), "the engine made no progress"
    alloc = engine.scheduler.allocator
    assert alloc.num_free_pages == alloc.num_usable_pages, "KV pages leaked"
    slots = engine.scheduler.lora
    assert all(slots.pins(s) == 0 and slots.held(s) == 0 for s in range(1, slots.max_loras + 1))
    return finals


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_adapters_in_one_step_each_get_their_own_outputs(overlap) -> None:  # noqa: ANN001
    engine = lora_engine(max_loras=3, overlap=overlap)
    engine.add_request("base", PROMPT, greedy(12))
    for i in (1, 2, 3):
        engine.add_request(f"r{i}", PROMPT, greedy(12), lora_request=adapter(i))
    finals = run(engine)
    assert finals["base"].outputs[0].token_ids == oracle(PROMPT, 12)
    for i in (1, 2, 3):
        assert finals[f"r{i}"].outputs[0].token_ids == oracle(PROMPT, 12, 5 * i + 3), i
    assert oracle(PROMPT, 12, 8) != oracle(PROMPT, 12, 13)  # the oracle can tell them apart
    runner = engine.runner
    assert max(len(s) for s in runner.step_slots) == 3  # three adapters shared steps
    assert len(runner.lora_loads) == 3


@pytest.mark.parametrize("overlap", [False, True])
def test_slot_pressure_queues_and_completes_every_request(overlap) -> None:  # noqa: ANN001
    """6 adapters, 2 slots, 14 requests of different lengths (some ending on a stop token a
    step late, which leaves their row in the step in flight): every request completes with
    its own adapter's output, no step reads more than 2 adapters, slots are reused."""
    engine = lora_engine(max_loras=2, overlap=overlap)
    want = {}
    for k in range(14):
        i = k % 6 + 1
        prompt = [20 + k, 30 + k, 40 + k]
        full = oracle(prompt, 6 + k, 5 * i + 3)
        if k % 3 == 0:  # stop on a token value: known one step late
            params = SamplingParams(temperature=0.0, max_tokens=6 + k, stop_token_ids=[full[2]])
            want[f"q{k}"] = full[:full.index(full[2]) + 1]
        else:
            params = greedy(6 + k)
            want[f"q{k}"] = full
        engine.add_request(f"q{k}", prompt, params, lora_request=adapter(i))
        if k % 5 == 0:
            engine.add_request(f"b{k}", prompt, greedy(5))
            want[f"b{k}"] = oracle(prompt, 5)
    finals = run(engine)
    for rid, tokens in want.items():
        assert finals[rid].outputs[0].token_ids == tokens, rid
        assert finals[rid].outputs[0].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    runner = engine.runner
    assert max(len(s) for s in runner.step_slots) == 2
    # Six adapters through two slots: each loaded once (its queued requests ran together).
    assert sorted(a.offset for _, a in runner.lora_loads) == [5 * i + 3 for i in range(1, 7)]
    assert {slot for slot, _ in runner.lora_loads} == {1, 2}


def test_a_base_request_behind_a_blocked_adapter_request_runs() -> None:
    engine = lora_engine(max_loras=1)
    engine.add_request("a", PROMPT, greedy(30), lora_request=adapter(1))
    engine.step()
    engine.step()
    engine.add_request("b", PROMPT, greedy(4), lora_request=adapter(2))  # no slot: waits
    engine.add_request("base", [7, 8, 9], greedy(4))  # queued behind it
    b = engine._groups["b"].seqs[0]  # noqa: SLF001
    finals = {}
    while "base" not in finals:
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        assert b.status is SequenceStatus.WAITING  # "a" still pins the only slot
    assert finals["base"].outputs[0].token_ids == oracle([7, 8, 9], 4)
    finals.update(run(engine))
    assert finals["b"].outputs[0].token_ids == oracle(PROMPT, 4, 13)
    assert finals["a"].outputs[0].token_ids == oracle(PROMPT, 30, 8)


def test_host_cache_is_bounded_and_a_dropped_adapter_is_read_again() -> None:
    loader = Loader()
    engine = lora_engine(max_loras=1, max_cpu_loras=2, loader=loader)
    for i in (1, 2, 3):
        engine.add_lora(adapter(i))
    registry = engine._loras  # noqa: SLF001
    assert loader.reads == ["/fake/8", "/fake/13", "/fake/18"]
    assert len(registry.cached()) == 2 and 1 not in registry.cached()  # LRU dropped ad1
    engine.add_request("r", PROMPT, greedy(5), lora_request=engine.resolve_lora("ad1"))
    finals = run(engine)
    assert finals["r"].outputs[0].token_ids == oracle(PROMPT, 5, 8)
    assert loader.reads[-1] == "/fake/8" and len(loader.reads) == 4
    assert len(registry.cached()) == 2 and 1 in registry.cached()
    # Two more adapters through the one slot: the cache stays at 2 and keeps the slot's.
    for i in (2, 3):
        engine.add_request(f"s{i}", PROMPT, greedy(3), lora_request=adapter(i))
        run(engine)
        assert len(registry.cached()) == 2
        assert engine.scheduler.lora.slot_of(i) == 1 and i in registry.cached()


def test_unload_while_running_finishes_the_request_and_frees_the_slot() -> None:
    engine = lora_engine(max_loras=1)
    engine.add_lora(adapter(1))
    engine.add_request("r", PROMPT, greedy(10), lora_request=engine.resolve_lora("ad1"))
    for _ in range(3):
        engine.step()
    assert engine.remove_lora("ad1") and not engine.remove_lora("ad1")
    assert engine.resolve_lora("ad1") is None and engine.list_loras() == []
    finals = run(engine)
    assert finals["r"].outputs[0].token_ids == oracle(PROMPT, 10, 8)
    assert engine.scheduler.lora.binding(1) is None  # freed once nothing used it
    assert engine._loras.cached() == []  # noqa: SLF001
    # Loaded again under the same name: a new registration (new load id), same outputs.
    engine.add_request("again", PROMPT, greedy(10), lora_request=adapter(1))
    assert run(engine)["again"].outputs[0].token_ids == oracle(PROMPT, 10, 8)
    assert engine.scheduler.lora.binding(1).load_id == 2


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_releases_and_reacquires_slots(overlap) -> None:  # noqa: ANN001
    probe = lora_engine(overlap=overlap)
    engine = lora_engine(max_loras=2, overlap=overlap,
                         kv_cache_memory=10 * probe.plan.kv_bytes_per_page)
    want = {}
    for k in range(6):
        i = k % 3 + 1
        prompt = [50 + k, 60 + k, 70 + k, 80 + k]
        engine.add_request(f"p{k}", prompt, greedy(16), lora_request=adapter(i))
        want[f"p{k}"] = oracle(prompt, 16, 5 * i + 3)
    finals = run(engine)
    assert engine.stats().num_preemptions > 0
    for rid, tokens in want.items():
        assert finals[rid].outputs[0].token_ids == tokens, rid


def test_n_samples_share_the_adapter() -> None:
    engine = lora_engine(max_loras=1)
    engine.add_request("n", PROMPT * 2, greedy(6, n=3), lora_request=adapter(4))
    finals = run(engine)
    assert [c.token_ids for c in finals["n"].outputs] == [oracle(PROMPT * 2, 6, 23)] * 3
    assert len(engine.runner.lora_loads) == 1


def test_prefix_cache_is_salted_by_the_adapter() -> None:
    engine = lora_engine(max_loras=2, enable_prefix_caching=True)
    prompt = list(range(30, 47))  # 4 full pages of 4 before the last token
    hits = []
    for rid, lora in (("base", None), ("a1", adapter(1)), ("a2", adapter(2)),
                      ("a1-again", adapter(1)), ("base-again", None)):
        before = engine.stats().prefix_cache_hits
        engine.add_request(rid, prompt, greedy(3), lora_request=lora)
        out = run(engine)[rid].outputs[0]
        hits.append(engine.stats().prefix_cache_hits - before)
        assert out.token_ids == oracle(prompt, 3, 0 if lora is None else 5 * lora.lora_int_id + 3)
    assert hits == [0, 0, 0, 16, 16]


def test_refusals_name_the_field() -> None:
    plain = lora_engine(lora=False)
    with pytest.raises(InvalidRequest, match="lora_request 'ad1': LoRA is off") as e:
        plain.add_request("x", PROMPT, greedy(2), lora_request=adapter(1))
    assert e.value.field == "lora_request" and not plain.has_unfinished()
    loader = Loader()
    engine = lora_engine(modules=(("m1", "/fake/4"), ("m2", "/fake/6")), loader=loader)
    assert [(r.lora_name, r.lora_int_id) for r in engine.list_loras()] == [("m1", 1), ("m2", 2)]
    with pytest.raises(InvalidRequest, match="lora_name 'm1' is loaded as") as e:
        engine.add_request("x", PROMPT, greedy(2), lora_request=LoRARequest("m1", 1, "/fake/5"))
    assert e.value.field == "lora_name"
    with pytest.raises(InvalidRequest, match="lora_int_id 2 of LoRA adapter 'n'") as e:
        engine.add_request("x", PROMPT, greedy(2), lora_request=LoRARequest("n", 2, "/fake/5"))
    with pytest.raises(InvalidRequest, match="lora_path '/bad/1'.*could not be loaded") as e:
        engine.add_request("x", PROMPT, greedy(2), lora_request=LoRARequest("n", 3, "/bad/1"))
    assert e.value.field == "lora_path"
    with pytest.raises(InvalidRequest, match="lora_name 'm2' is already loaded"):
        engine.add_lora(LoRARequest("m2", 9, "/fake/1"))
    assert [r.lora_name for r in engine.list_loras()] == ["m1", "m2"]
    assert not engine.has_unfinished()
    # An unknown adapter registers itself (vLLM's offline rule), then runs.
    engine.add_request("y", PROMPT, greedy(3), lora_request=LoRARequest("n", 3, "/fake/9"))
    assert engine.resolve_lora("n") == LoRARequest("n", 3, "/fake/9")
    assert run(engine)["y"].outputs[0].token_ids == oracle(PROMPT, 3, 9)
    with pytest.raises(ValueError, match="lora_int_id=0"):
        LoRARequest("z", 0, "/fake/1")
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("a b", 1, "/fake/1")
    with pytest.raises(ValueError, match="needs a lora_loader"):
        config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, page_size=4,
                              max_model_len=64, lora_config=LoRAConfig())
        Engine(config, plan_engine(config, tiny_model_config(), 4, 1 << 30),
               ArithmeticRunner(VOCAB), tiny_tokenizer(), (EOS,))
    with pytest.raises(InvalidRequest, match="lora_path '/bad/2'"):
        lora_engine(modules=(("m", "/bad/2"),))


def test_an_adapter_that_cannot_be_read_any_more_fails_only_its_requests() -> None:
    loader = Loader()
    engine = lora_engine(max_loras=1, max_cpu_loras=1, loader=loader)
    engine.add_lora(adapter(1))
    engine.add_lora(adapter(2))  # drops ad1 from the host cache (not in a slot)
    loader.broken.add("/fake/8")  # its files went away
    engine.add_request("bad", PROMPT, greedy(4), lora_request=engine.resolve_lora("ad1"))
    engine.add_request("good", PROMPT, greedy(4), lora_request=engine.resolve_lora("ad2"))
    engine.add_request("base", PROMPT, greedy(4))
    finals = run(engine)
    assert finals["bad"].outputs[0].finish_reason is FinishReason.ERROR
    assert "lora_path '/fake/8'" in finals["bad"].outputs[0].error
    assert finals["good"].outputs[0].token_ids == oracle(PROMPT, 4, 13)
    assert finals["base"].outputs[0].token_ids == oracle(PROMPT, 4)


class OffsetProposer:
    """Proposes each sequence's arithmetic continuation under the offset its prompt's first
    token names: right for 2 tokens, then off by one (rejected)."""

    def __init__(self, offsets: dict[int, int]):
        self.offsets = offsets

    def propose(self, sequences):  # noqa: ANN001, ANN201 - the Proposer protocol
        out = []
        for tokens in sequences:
            seq, props = list(tokens), []
            for i in range(3):
                t = arithmetic_next_token(seq[-1], len(seq) - 1, VOCAB, self.offsets[seq[0]])
                props.append(t if i < 2 else (t + 1) % VOCAB)
                seq.append(t)
            out.append(props)
        return out


def test_verification_rows_read_their_adapter_on_every_position() -> None:
    """A decode row verifying proposals is a multi-token query; each of its tokens carries
    the row's slot, so every verified position runs under its adapter: proposals of the
    adapter's own continuation are accepted, and the outputs are the adapter's."""
    from jaxserve.config import SpeculativeConfig
    from jaxserve.engine.speculation import OnTokens

    offsets = {40: 0, 41: 8, 42: 13}
    engine = lora_engine(max_loras=2, speculative_config=SpeculativeConfig("ngram", 3),
                         proposer=OnTokens(OffsetProposer(offsets)))
    for first, lora in ((40, None), (41, adapter(1)), (42, adapter(2))):
        engine.add_request(str(first), [first, 6, 7], greedy(12), lora_request=lora)
    finals = run(engine)
    st = engine.stats()
    assert st.spec_num_drafts > 0 and st.spec_num_accepted_tokens >= st.spec_num_drafts
    for first, offset in offsets.items():
        assert finals[str(first)].outputs[0].token_ids == oracle([first, 6, 7], 12, offset)
