"""Several hosts, one engine: process 0 schedules, every process runs the same compiled step.

JAX on several hosts is multi-controller SPMD: each process runs the same program over the
global mesh and feeds it the same inputs, and XLA's collectives (NCCL / ICI / gloo on CPU)
join the devices. jaxserve keeps everything host-side on process 0 (scheduler, allocator,
detokenizer, gRPC / HTTP fronts) and makes the other processes mirror its device calls:

  process 0: Engine.step -> StepBatch -> LeaderRunner.dispatch:
               broadcast header i32[7] = (STEP, T_b, S_b, P, B, L, M)  -- which bucket,
                                                 sampler and prompt logprobs variant; M = 1:
                                                 the step has a grammar bitmask
               broadcast the batch's parts, one broadcast per WIRE group (`batch_parts.py`):
                 "forward" (T_b, S_b)                 -- token ids, block tables, ...
                 "sampler" (S_b, P, B)                -- knob matrix, keys, history, logit
                                                         bias, constrained rows
                 "prompt_logprobs" (L > 0 only)
               ModelRunner.dispatch(batch)  -- M = 1: after the forward is queued, the
                                  engine's late mask (`runner.LateMask`), then broadcast
                                  the grammar bitmask i32[S_b, W] and constrained rows;
                                  the compiled step
             LeaderRunner.collect -> ModelRunner.collect (local: the followers' results
             are the same and stay with them)
  process i: follow(runner): receive the header; STEP -> receive the arrays (shapes from the
             header) -> the same ModelRunner.execute; ROUND -> a speculative drafter's round
             (`multihost_spec.py`); ARM -> arm the compile guard (warmup done); STOP ->
             return.

Broadcasts use `jax.experimental.multihost_utils.broadcast_one_to_all` (a psum over all
devices, compiled once per shape: the header's is fixed, the arrays' are the warmup buckets,
so serving compiles nothing). The forward, sampler and prompt logprobs groups travel
separately because their shapes vary independently (tokens x seqs; seqs x penalty history x
logit bias width; L = 0 or tokens); the parts of a group share one broadcast. Every
process builds the same engine (same config, model, mesh of all processes' devices, and a KV
page count agreed as the minimum over processes: `agree_min`), so the step's shapes and
shardings match.

While process 0 has no work the others wait inside the header broadcast, and process 0
announces a KEEPALIVE every `keepalive_s` idle seconds (gloo gives up on a collective after 30
minutes); when process 0 ends it broadcasts STOP. If any process dies, the next collective
fails at once and JAX's coordination service ends the others after the missed heartbeats, so
no process outlives the job.

Failures: on several hosts every failed step is fatal (`RunnerFailed(fatal=True)`): the
followers may be inside the step's collectives, so announcing anything more would hang both
sides; the engine reports itself dead and the process exits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxserve.config import DistributedConfig
from jaxserve.device.model_runner import ModelPending, ModelRunner, compile_buckets
from jaxserve.device.multihost_spec import Drafter, follow_round
from jaxserve.device.multihost_wire import ARM, KEEPALIVE, ROUND, STEP, STOP, broadcast
from jaxserve.engine.batch import (StepBatch, bitmask_words, empty_batch, leaves, parts,
                                   present)
from jaxserve.engine.runner import LateMask, RunnerFailed, StepResult

log = logging.getLogger(__name__)

# Each StepBatch part travels in the broadcast its WIRE names (`batch_parts.py`), its LATE
# fields apart: "forward" (shapes from tokens x seqs), "sampler" (seqs x penalty history x
# logit bias width) and "prompt_logprobs" (L, sent only when the part is present). One
# broadcast per group, not per part: each is one collective per step.
Leaf = tuple[str, str, np.ndarray]  # (part, field, array)


def _wire(batch: StepBatch) -> dict[str, list[Leaf]]:
    """The batch's arrays that travel with the step, by broadcast group, in walk order (the
    same on every process: the follower walks its mold of the same shapes)."""
    groups: dict[str, list[Leaf]] = {}
    for name, part in parts(batch):
        if present(part):
            late = part.LATE  # type: ignore[attr-defined]
            groups.setdefault(part.WIRE, []).extend(  # type: ignore[attr-defined]
                (name, field, array) for field, array in leaves(part) if field not in late)
    return groups


def initialize(cfg: DistributedConfig) -> None:
    """`jax.distributed.initialize` for this process (before any other JAX call)."""
    if not cfg.enabled:
        return
    log.info("joining %s as process %d of %d", cfg.coordinator, cfg.process_id,
             cfg.num_processes)
    jax.distributed.initialize(coordinator_address=cfg.coordinator,
                               num_processes=cfg.num_processes, process_id=cfg.process_id)
    if jax.process_count() != cfg.num_processes:
        raise RuntimeError(f"jax.distributed reports {jax.process_count()} processes, "
                           f"expected num_processes={cfg.num_processes}")


def agree_min(value: int) -> int:
    """The smallest `value` over all processes (each passes its own)."""
    if jax.process_count() == 1:
        return value
    return int(np.min(multihost_utils.process_allgather(np.array([value], np.int64))))


def _header(op: int, batch: StepBatch | None, is_source: bool, late: bool = False
            ) -> np.ndarray:
    h = np.zeros(7, np.int32)
    if batch is not None:
        h[:] = (op, len(batch.forward.token_ids), batch.num_seqs_bucket,
                batch.penalties.history.shape[1], batch.bias.ids.shape[1],
                len(batch.prompt_logprobs.indices), late or batch.mask.bitmask is not None)
    else:
        h[0] = op
    return broadcast([h], is_source)[0]


def _send_batch(batch: StepBatch, late: bool) -> None:
    _header(STEP, batch, True, late)
    for entries in _wire(batch).values():
        broadcast([array for _, _, array in entries], True)


def _mask_wire(num_seqs: int, vocab_size: int, bitmask: np.ndarray | None,
               constrained: np.ndarray, is_source: bool) -> tuple[np.ndarray, np.ndarray]:
    """Broadcast a step's grammar mask (None: zeros, which no constrained row reads)."""
    if bitmask is None:
        bitmask = np.zeros((num_seqs, bitmask_words(vocab_size)), np.int32)
    got = broadcast([bitmask, constrained], is_source)
    return got[0], got[1]


def _receive_batch(runner: ModelRunner, num_tokens: int, num_seqs: int, history_len: int,
                   bias_width: int, prompt_lp_len: int) -> StepBatch:
    """The leader's batch of this bucket (an empty batch of the same shapes is the mold)."""
    mold = empty_batch(runner.shape, num_tokens, num_seqs, history_len > 0, bias_width > 0,
                       prompt_lp_len > 0)
    ours = (mold.penalties.history.shape[1], mold.bias.ids.shape[1],
            len(mold.prompt_logprobs.indices))
    if ours != (history_len, bias_width, prompt_lp_len):
        raise RuntimeError(f"the leader's (penalty history length, logit bias width, prompt "
                           f"logprobs length) {(history_len, bias_width, prompt_lp_len)} "
                           f"differs from this process's {ours}: engines built differently")
    got: dict[str, dict[str, np.ndarray]] = {}  # part -> field -> the leader's array
    for entries in _wire(mold).values():
        arrays = broadcast([array for _, _, array in entries], False)
        for (name, field, _), array in zip(entries, arrays):
            got.setdefault(name, {})[field] = array
    return dataclasses.replace(mold, **{name: dataclasses.replace(getattr(mold, name), **fields)
                                        for name, fields in got.items()})


@dataclasses.dataclass
class FollowStats:
    steps: int = 0  # steps run (warmup buckets included)
    keepalives: int = 0  # idle announcements received
    rounds: int = 0  # drafter rounds run


class LeaderRunner:
    """Process 0's runner: every call is announced to the followers, then run here.

    While no step runs for `keepalive_s` seconds a KEEPALIVE is announced: the followers wait
    inside a collective, which gloo (CPU) abandons after 30 minutes. One lock orders every
    announcement and step, so the processes always see the same sequence of collectives.
    """

    def __init__(self, runner: ModelRunner, keepalive_s: float = 60.0) -> None:
        if keepalive_s <= 0:
            raise ValueError(f"keepalive_s={keepalive_s} must be > 0")
        self.runner = runner
        self.keepalive_s = keepalive_s
        self.keepalives = 0
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._stopped = False
        self._broken = False  # a step failed after it was announced
        self._closing = threading.Event()
        self._keeper = threading.Thread(target=self._keep_alive, name="jaxserve-keepalive",
                                        daemon=True)
        self._keeper.start()

    @property
    def compiles_after_warmup(self) -> int:
        return self.runner.compiles_after_warmup

    def warmup(self, progress: bool = True) -> None:
        # Through `execute`, so the followers compile every bucket (and every broadcast) too;
        # then a step per seqs bucket with a (zero) late mask: its broadcast's shapes.
        compile_buckets(self.runner, self.execute, progress)
        smallest = {s: t for t, s in reversed(self.runner.shape.buckets)}
        for s, t in sorted(smallest.items()):
            no_rows = np.zeros(s, bool)
            self.collect(self.dispatch(empty_batch(self.runner.shape, t, s, False),
                                       late_mask=lambda: (None, no_rows)))

    def arm(self) -> None:
        with self._lock:
            self._check()
            _header(ARM, None, True)
            self.runner.arm()
            self._last = time.monotonic()

    def execute(self, batch: StepBatch) -> StepResult:
        return self.collect(self.dispatch(batch))

    def collect(self, pending: ModelPending) -> StepResult:
        try:
            return self.runner.collect(pending)
        except BaseException:
            self._broken = True
            raise

    def _late(self, batch: StepBatch, late_mask: LateMask | None) -> LateMask | None:
        """The late mask the followers also get (M = 1): the engine's, or the batch's own."""
        if late_mask is None and batch.mask.bitmask is None:
            return None
        S, vocab = batch.num_seqs_bucket, self.runner.shape.vocab_size

        def send() -> tuple[np.ndarray | None, np.ndarray]:
            bitmask, constrained = late_mask() if late_mask is not None else \
                (batch.mask.bitmask, batch.mask.constrained)
            _mask_wire(S, vocab, bitmask, constrained, True)
            return bitmask, constrained
        return send

    def dispatch(self, batch: StepBatch, late_mask: LateMask | None = None) -> ModelPending:
        with self.announcing("step"):
            _send_batch(batch, late_mask is not None)
            late = self._late(batch, late_mask)
            return self.runner.dispatch(batch) if late is None else \
                self.runner.dispatch(batch, late_mask=late)

    @contextlib.contextmanager
    def announcing(self, what: str) -> Iterator[None]:
        """Hold the lock that orders every announcement (a step, a drafter's round:
        `multihost_spec.LeaderDrafter`) and run one. A failure inside ends the job
        (RunnerFailed, fatal): the followers may be inside its collectives, so announcing
        anything more would hang both sides; JAX's coordination service ends the others
        once this process exits."""
        with self._lock:
            try:
                self._check()
            except RuntimeError as e:
                raise RunnerFailed(str(e), fatal=True) from e
            try:
                yield
            except BaseException as e:
                self._broken = True
                if isinstance(e, Exception):
                    raise RunnerFailed(f"a multi-host {what} failed: {e}", fatal=True) from e
                raise
            self._last = time.monotonic()

    def close(self) -> None:
        """Release the followers (they return from `follow`); idempotent. After a failed
        step nothing is announced (see `execute`)."""
        self._closing.set()
        self._keeper.join()
        with self._lock:
            if not self._stopped and not self._broken:
                _header(STOP, None, True)
            self._stopped = True
        self.runner.close()

    def _check(self) -> None:
        if self._broken or self._stopped:
            raise RuntimeError("the multi-host job is "
                               + ("broken by a failed step" if self._broken else "stopped"))

    def _keep_alive(self) -> None:
        while not self._closing.wait(self.keepalive_s / 4):
            with self._lock:
                if self._stopped or self._broken or \
                        time.monotonic() - self._last < self.keepalive_s:
                    continue
                try:
                    _header(KEEPALIVE, None, True)
                except Exception:  # noqa: BLE001 - a process died; the next step reports it
                    log.exception("keepalive to the other processes failed")
                    self._broken = True
                    return
                self.keepalives += 1
                self._last = time.monotonic()


@dataclasses.dataclass
class Follower:
    """A process > 0's share of the engine (`serving.build.build_follower`): the step runner
    and, when the engine speculates with a draft model or an EAGLE-3 head, the same drafter
    (replicated over the global mesh), whose rounds process 0 announces."""

    runner: ModelRunner
    drafter: Drafter | None = None

    @property
    def compiles_after_warmup(self) -> int:
        return self.runner.compiles_after_warmup


def follow(follower: Follower | ModelRunner) -> FollowStats:
    """Mirror the leader's device calls until it says STOP. An EAGLE-3 head reads the aux
    states of the step this process ran last, kept here."""
    if isinstance(follower, ModelRunner):
        follower = Follower(follower)
    runner, drafter = follower.runner, follower.drafter
    stats = FollowStats()
    if drafter is not None:
        drafter.warmup()  # compiled before the leader's first round (and its ARM)
    aux = None
    while True:
        op, t, s, p, b, lp, m = (int(x) for x in _header(0, None, False))
        if op == STEP:
            batch = _receive_batch(runner, t, s, p, b, lp)
            late = (lambda: _mask_wire(s, runner.shape.vocab_size, None,
                                       batch.mask.constrained, False)) if m else None
            pending = runner.dispatch(batch, late_mask=late)
            runner.collect(pending)
            aux = pending.aux
            stats.steps += 1
        elif op == ROUND:  # t, s: the bucket; p: the chain flag; b: run it (0: warmup)
            follow_round(drafter, t, s, bool(p), bool(b), aux)
            stats.rounds += b
        elif op == KEEPALIVE:
            stats.keepalives += 1
        elif op == ARM:
            runner.arm()
        elif op == STOP:
            log.info("leader stopped after %d steps", stats.steps)
            runner.close()
            return stats
        else:
            raise RuntimeError(f"unknown operation {op} from the leader")
