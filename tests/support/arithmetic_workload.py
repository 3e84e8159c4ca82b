"""The arithmetic fake runner's workload for engine-level tests: an engine over it, a driver
that runs requests to completion (and checks no KV page leaked), the arithmetic oracle, and a
mix of requests that takes every stop and sampling path.

Used by the overlapped-scheduling tests and the speculative decoding tests, which both check
that their feature changes no output of this workload.
"""

from __future__ import annotations

import numpy as np
from support.engine_fixtures import VOCAB, tiny_model_config, tiny_tokenizer

from jaxserve import SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.fake_runner import ArithmeticRunner, arithmetic_next_token
from jaxserve.engine.sizing import plan_engine
from jaxserve.engine.speculation import OnTokens

EOS = 2


class RecordingRunner(ArithmeticRunner):
    """Arithmetic outputs; records each dispatched batch's fed tokens and live rows."""

    def __init__(self) -> None:
        super().__init__(VOCAB)
        self.fed_tokens = 0
        self.rows_per_step: list[int] = []

    def dispatch(self, batch):  # noqa: ANN001, ANN201 - the Runner protocol
        self.fed_tokens += int((batch.forward.feed_rows >= 0).sum())
        self.rows_per_step.append(int(batch.forward.num_seqs[0]))
        return super().dispatch(batch)


def engine_of(runner: ArithmeticRunner, overlap: bool, proposer: object = None,
              **cfg: object) -> Engine:
    """An engine over `runner` (`proposer`: a speculative proposer, see `Engine`)."""
    base = dict(max_num_seqs=6, max_num_batched_tokens=48, page_size=8, max_model_len=160,
                attention_impl="reference", async_scheduling=overlap)
    base.update(cfg)
    config = EngineConfig(**base)  # type: ignore[arg-type]
    plan = plan_engine(config, tiny_model_config(), 4, 1 << 30)
    return Engine(config, plan, runner, tiny_tokenizer(), (EOS,),
                  proposer=None if proposer is None else OnTokens(proposer))  # type: ignore[arg-type]


def arithmetic(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(arithmetic_next_token(seq[-1], len(seq) - 1, VOCAB))
    return seq[len(prompt):]


def drive(engine: Engine, requests: dict, arrive: dict | None = None) -> dict:
    """Run to completion; `arrive`: request id -> the step() call before which it is added."""
    finals = {}
    pending = dict(requests)
    step = 0
    while pending or engine.has_unfinished():
        for rid in [r for r in pending if (arrive or {}).get(r, 0) <= step]:
            prompt, params = pending.pop(rid)
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        step += 1
        assert step < 2000, "the engine made no progress"
    alloc = engine.scheduler.allocator
    assert alloc.num_free_pages == alloc.num_usable_pages, "KV pages leaked"
    return finals


def mixed_requests() -> tuple[dict, dict]:
    """Every kind of stop and sampling path, with prompts whose arithmetic outputs make the
    token-value stops fire mid-stream."""
    rng = np.random.default_rng(7)
    tok = tiny_tokenizer()
    reqs: dict = {}
    for i in range(14):
        prompt = [int(x) for x in rng.integers(3, VOCAB, int(rng.integers(3, 40)))]
        out = arithmetic(prompt, 12)
        kind = i % 7
        if kind == 0:  # max_tokens only: known in advance, no wasted row
            params = SamplingParams(max_tokens=int(rng.integers(1, 12)), ignore_eos=True)
        elif kind == 1:  # a stop token id that the stream reaches: known one step late
            params = SamplingParams(max_tokens=12, stop_token_ids=[out[4]], ignore_eos=True)
        elif kind == 2:  # a stop string: found by the detokenizer, one step late
            params = SamplingParams(max_tokens=12, stop=[tok.decode([out[5]]).strip()],
                                    ignore_eos=True)
        elif kind == 3:  # n samples forking one prompt, with logprobs
            params = SamplingParams(max_tokens=9, n=2, logprobs=2, ignore_eos=True)
        elif kind == 4:  # penalties: the step in flight is applied before the next is built
            params = SamplingParams(max_tokens=8, repetition_penalty=1.3, ignore_eos=True)
        elif kind == 5:  # prompt logprobs and the EOS rule (the stream may end on EOS)
            params = SamplingParams(max_tokens=10, prompt_logprobs=2)
        else:  # prefill only (prompt scoring)
            params = SamplingParams(max_tokens=0, prompt_logprobs=1)
        reqs[f"r{i}"] = (prompt, params)
    arrive = {f"r{i}": (i * 3) % 11 for i in range(14)}
    return reqs, arrive


def summary(finals: dict) -> dict:
    return {rid: [(c.token_ids, c.finish_reason, c.text, c.logprobs) for c in o.outputs]
            + [o.prompt_logprobs] for rid, o in finals.items()}
