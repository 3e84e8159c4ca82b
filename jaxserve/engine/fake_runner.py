"""A model runner without a model: arithmetic outputs, for scheduler-level tests and benchmarks.

Implements the `runner.Runner` protocol on numpy alone (no jax): each sequence's next
token is a function of the token it just fed and that token's position, so a test can
predict every output and a benchmark can time the host side (schedule + batch build) with
no device work in the way. Like the model runner it keeps each step's sampled tokens for the
next step's fed rows (`ForwardInputs.feed_rows`), so overlapped scheduling is tested against the
same arithmetic.

`device_time_s` > 0 simulates a device: each step takes that long after the previous one
ends (or after its dispatch, if later), `collect` waits until then, and `host_gaps` records
how long the simulated device sat idle before each step (the host-gap benchmark's measure).

LoRA: `load_lora(slot, adapter)` records the adapter of each slot; a sampler row's token is
then shifted by its token's slot's adapter's `offset` (`FakeLora`), so a test sees that each
row ran with its own adapter. Loading a slot that a dispatched, uncollected step reads, or
reading a slot never loaded, raises: the engine must never do either.

A step's grammar bitmask is honoured (`allowed_tokens`): a constrained row whose arithmetic
token is forbidden takes the next allowed one, so structured outputs run on it too.

Fault injection (`fault_injection.InjectedFault`): a step whose new tokens include a marker
token id raises `RunnerFailed`, fatal or not, naming the culprit rows or not, so tests can
drive the engine's recovery paths. A fatal fault leaves the runner refusing every later step,
as a lost device would.
"""

from __future__ import annotations


import dataclasses
import time

import numpy as np

from jaxserve.engine.batch import StepBatch
from jaxserve.engine.batch_mask import TokenMaskRows
from jaxserve.engine.fault_injection import FaultInjector, InjectedFault
from jaxserve.engine.runner import LateMask, StepResult
from jaxserve.engine.sampling_params import MAX_LOGPROBS


def arithmetic_next_token(last_token: int, position: int, vocab_size: int,
                          offset: int = 0) -> int:
    return (last_token * 31 + position * 7 + 1 + offset) % vocab_size


@dataclasses.dataclass(frozen=True)
class FakeLora:
    """A fake adapter: shifts the arithmetic next token of its rows by `offset`."""

    offset: int
    rank: int = 8
    nbytes: int = 1024


@dataclasses.dataclass(eq=False)
class FakePending:
    result: StepResult
    ready_at: float  # when the simulated device finishes the step (monotonic seconds)
    lora_slots: frozenset[int] = frozenset()  # the adapter slots its tokens read


class ArithmeticRunner:
    def __init__(self, vocab_size: int, fault: InjectedFault | None = None,
                 device_time_s: float = 0.0):
        self.vocab_size = vocab_size
        self.fault = fault
        self._injector = FaultInjector(fault) if fault is not None else None
        self.steps = 0
        self.device_time_s = device_time_s
        self.host_gaps: list[float] = []  # simulated device idle time before each step (s)
        self._busy_until: float | None = None
        self._prev_tokens = np.zeros(0, np.int32)  # i32[S_b] of the last dispatched step
        self.loras: dict[int, object] = {}  # slot -> adapter loaded there
        self.lora_loads: list[tuple[int, object]] = []  # every load_lora call, in order
        self._uncollected: list[FakePending] = []

    @property
    def compiles_after_warmup(self) -> int:
        return 0

    def warmup(self, progress: bool = True) -> None:
        return None

    def arm(self) -> None:
        return None

    def close(self) -> None:
        return None

    def execute(self, batch: StepBatch) -> StepResult:
        return self.collect(self.dispatch(batch))

    def load_lora(self, slot: int, adapter: object) -> None:
        if slot < 1:
            raise ValueError(f"LoRA slot {slot} must be >= 1 (0 is the base model)")
        for p in self._uncollected:
            if slot in p.lora_slots:
                raise AssertionError(f"LoRA slot {slot} reloaded while a dispatched step "
                                     "still reads it")
        self.loras[slot] = adapter
        self.lora_loads.append((slot, adapter))

    def dispatch(self, batch: StepBatch, late_mask: LateMask | None = None) -> FakePending:
        if self._injector is not None:
            self._injector.check(batch)
        if late_mask is not None:  # between the (here, no) forward and the sampler
            bitmask, constrained = late_mask()
            batch = dataclasses.replace(batch, mask=TokenMaskRows(bitmask, constrained))
        result = self._compute(batch)
        now = time.monotonic()
        start = now if self._busy_until is None else max(now, self._busy_until)
        if self._busy_until is not None:
            self.host_gaps.append(start - self._busy_until)
        self._busy_until = start + self.device_time_s
        pending = FakePending(result, self._busy_until,
                              frozenset(np.unique(batch.lora.token_slots).tolist()) - {0})
        self._uncollected.append(pending)
        return pending

    def collect(self, pending: FakePending) -> StepResult:
        self._uncollected = [p for p in self._uncollected if p is not pending]
        wait = pending.ready_at - time.monotonic()
        if wait > 0:
            time.sleep(wait)  # the simulated device is still running the step
        return pending.result

    def _compute(self, batch: StepBatch) -> StepResult:
        f, mask, lp = batch.forward, batch.mask, batch.prompt_logprobs
        fed = f.feed_rows >= 0
        token_ids = f.token_ids.copy()
        token_ids[fed] = self._prev_tokens[f.feed_rows[fed]]
        last = f.logits_indices  # each sampler row's position (several per verifying row)
        tokens = (token_ids[last].astype(np.int64) * 31 + f.positions[last] * 7 + 1
                  + self._offsets(batch.lora.token_slots[last])) % self.vocab_size
        if mask.bitmask is not None:
            tokens = allowed_tokens(tokens, mask.bitmask, mask.constrained, self.vocab_size)
        self._prev_tokens = tokens.astype(np.int32)
        S = batch.num_seqs_bucket
        self.steps += 1
        result = StepResult(tokens=tokens.astype(np.int32), logprob=np.zeros(S, np.float32),
                            top_ids=np.zeros((S, MAX_LOGPROBS), np.int32),
                            top_logprobs=np.zeros((S, MAX_LOGPROBS), np.float32))
        if lp.present:
            result.prompt_logprob, result.prompt_top_ids, result.prompt_top_logprobs = \
                arithmetic_prompt_logprobs(token_ids[lp.indices], lp.targets, self.vocab_size)
        return result


    def _offsets(self, slots: np.ndarray) -> np.ndarray:
        """i64[R]: each sampler row's adapter offset (0 for slot 0, the base model)."""
        out = np.zeros(len(slots), np.int64)
        for i, slot in enumerate(slots.tolist()):
            if slot:
                if slot not in self.loras:
                    raise AssertionError(f"a row reads LoRA slot {slot}, never loaded")
                out[i] = getattr(self.loras[slot], "offset", 0)
        return out


def allowed_tokens(tokens: np.ndarray, bitmask: np.ndarray, constrained: np.ndarray,
                   vocab_size: int) -> np.ndarray:
    """A grammar's say over the arithmetic tokens: a constrained row whose token its bitmask
    (i32[S, W]) forbids takes the next allowed id after it, wrapping around (a row that
    allows nothing keeps its token)."""
    out = tokens.copy()
    for row in np.flatnonzero(constrained):
        bits = np.unpackbits(bitmask[row].view(np.uint8), bitorder="little")[:vocab_size]
        allowed = np.flatnonzero(bits)
        if len(allowed) and not bits[tokens[row]]:
            after = allowed[allowed > tokens[row]]
            out[row] = after[0] if len(after) else allowed[0]
    return out


def arithmetic_prompt_logprobs(fed: np.ndarray, targets: np.ndarray, vocab_size: int
                               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The fake prompt logprobs of scoring `targets` (i32[L]) after the tokens `fed` (i32[L]):
    target logprob -((fed + target) % 13) / 4; top ids fed + 1, fed + 2, ... (mod vocab) with
    logprobs -1, -2, ...: f32[L], i32[L, MAX_LOGPROBS], f32[L, MAX_LOGPROBS]."""
    fed = fed.astype(np.int64)
    lp = (-((fed + targets) % 13) / 4).astype(np.float32)
    ranks = np.arange(1, MAX_LOGPROBS + 1)
    ids = ((fed[:, None] + ranks[None, :]) % vocab_size).astype(np.int32)
    tops = np.broadcast_to(-ranks.astype(np.float32), ids.shape).copy()
    return lp, ids, tops
