"""Engines over the arithmetic fake runner (jaxserve.engine.fake_runner), for tests of the
scheduler, the async engine and the fronts that need no model: runners a test can gate step
by step or make fail, and the oracle of the tokens they produce."""

from __future__ import annotations

import pathlib
import tempfile
import threading
import time

from support.bpe_tokenizer import train_bpe_tokenizer
from support.engine_fixtures import VOCAB, tiny_model_config, tiny_tokenizer

from jaxserve.config import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.fake_runner import ArithmeticRunner
from jaxserve.engine.sizing import plan_engine

DEADLINE_S = 20.0


class GatedRunner(ArithmeticRunner):
    """Every step waits for a permit from the test (`allow`)."""

    def __init__(self) -> None:
        super().__init__(VOCAB)
        self._permits = threading.Semaphore(0)
        self.blocked = threading.Event()  # set while a step waits for its permit

    def allow(self, steps: int = 1) -> None:
        for _ in range(steps):
            self._permits.release()

    def dispatch(self, batch):  # noqa: ANN001, ANN201 - the Runner protocol
        self.blocked.set()
        if not self._permits.acquire(timeout=DEADLINE_S):
            raise TimeoutError("the test never allowed this step")
        self.blocked.clear()
        return super().dispatch(batch)


class FailingRunner(ArithmeticRunner):
    def dispatch(self, batch):  # noqa: ANN001, ANN201
        raise RuntimeError("device lost")


def fake_engine(runner: ArithmeticRunner | None = None, **cfg: object) -> Engine:
    base = dict(max_num_seqs=4, max_num_batched_tokens=64, page_size=8, max_model_len=128,
                attention_impl="reference")
    base.update(cfg)
    config = EngineConfig(**base)  # type: ignore[arg-type]
    plan = plan_engine(config, tiny_model_config(), 4, 1 << 30)
    return Engine(config, plan, runner or ArithmeticRunner(VOCAB), tiny_tokenizer(), (2,))


def bpe_engine(max_model_len: int = 256) -> Engine:
    """A fake engine that speaks support.bpe_tokenizer's byte-level BPE tokenizer (freshly
    trained, in a new temporary directory): a vocabulary a grammar can spell any JSON text
    with, for the structured-output fronts."""
    tok = train_bpe_tokenizer(pathlib.Path(tempfile.mkdtemp(prefix="jaxserve-bpe-")))
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, page_size=8,
                          max_model_len=max_model_len, attention_impl="reference")
    model = tiny_model_config(vocab_size=tok.vocab_size, eos_token_ids=tok.eos_token_ids,
                              max_position_embeddings=max(512, max_model_len))
    plan = plan_engine(config, model, 4, 1 << 30)
    return Engine(config, plan, ArithmeticRunner(tok.vocab_size), tok, tok.eos_token_ids)


def wait_until(predicate, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)  # polling with a deadline, not synchronisation by sleep


def all_pages_free(engine: Engine) -> bool:
    alloc = engine.scheduler.allocator
    return alloc.num_free_pages == alloc.num_usable_pages


MARK = 97  # the marker token a fault keys on: in no prompt but the culprit's
GREEDY = dict(temperature=0.0, ignore_eos=True)


def arithmetic(prompt: list[int], max_tokens: int) -> list[int]:
    """Oracle for the fake runner: next = (last * 31 + position * 7 + 1) % VOCAB."""
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append((seq[-1] * 31 + (len(seq) - 1) * 7 + 1) % VOCAB)
    return seq[len(prompt):]
