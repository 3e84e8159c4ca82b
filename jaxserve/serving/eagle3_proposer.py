"""The engine's side of an EAGLE-3 head: which rows of the last target step the head reads,
and one proposal round per engine step (the engine's `speculation.Proposer`).

Data flow around target step N (the Speculator drives it; `observes_every_step`):
  `observe(out, pending)` (when step N is applied: its sequences' tokens now hold what it
    produced): keep N's rows, `_StepRows` (per sequence its first position, its count and
    its first row in N's flat token axis), and N's auxiliary hidden states
    (`ModelPending.aux`, f[T, 3 * Ht], left on the device) ->
  `propose(seqs)` (before step N + 1 is scheduled, after `KVManager.reserve` held the pages
    the chain writes): every row of N whose next token is now known and verified becomes a
    head row pairing the target's state at position p with the token at p + 1 (vLLM's
    shift): a prefill chunk's every row, a decode's one, a verification's rows up to the
    last accepted proposal (the rejected ones' rows are dropped: their inputs were wrong) ->
    `DraftSeq`s -> `Eagle3Proposer.pack` in N's token bucket (the aux rows index N's axis)
    -> one device round (catch-up over all of them, then the greedy chain of k) ->
    proposals i32[S, k] to the host -> k proposals for each asked sequence whose last head
    row pairs its newest token ("caught up"; one that was not in step N gets none this step).

Why every step is read, speculating or not: the head attends over its own K/V of every
earlier position, written only from the target's aux states of the step that computed the
position; those states are gone after that step. So the round runs after every applied
step (the catch-up alone, `chain=False`, when nobody speculates next: backed off, opted
out, prefill only), and the overlapped pipeline applies each step before scheduling the
next (`Speculator.wants_host_tokens`). The head's pages then hold valid K/V wherever the
target's do, so a prefix-cache hit's pages are trusted as the target's are; preemption
recomputes from position 0 through ordinary steps. Stale rows (a sequence finished or
preempted since it was scheduled) are skipped. A step that failed is never observed: its
rows are recomputed or their sequences failed.

Positions the chain writes (num_tokens - 1 .. num_tokens + k - 3) hold the head's own
hidden, not the target's: the next round rewrites them from the target's aux states as the
target computes them, before any later row reads them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence as GenericSequence

from jaxserve.device.spec_draft import DraftSeq, proposals_to_host
from jaxserve.device.spec_eagle3 import Eagle3Proposer
from jaxserve.engine.scheduled import SchedulerOutput
from jaxserve.engine.sequence import Sequence


@dataclasses.dataclass(frozen=True)
class _Row:
    seq: Sequence
    epoch: int  # `Sequence.epoch` when scheduled: a row of an older one is stale
    start: int  # position of its first token
    n: int  # its tokens in the step
    flat: int  # its first row in the step's flat token axis


@dataclasses.dataclass(frozen=True)
class _StepRows:
    rows: tuple[_Row, ...]
    aux: Any  # f[T, 3 * Ht] on the device: the step's aux hidden states
    num_tokens: int  # T, the step's token bucket


class Eagle3EngineProposer:
    """An `Eagle3Proposer` behind the engine's Proposer protocol (see the module doc)."""

    # The Speculator calls `observe` after every applied step and `propose` before every
    # schedule, with no sequences when none speculates (the round then only catches up).
    observes_every_step = True

    def __init__(self, drafter: Eagle3Proposer):
        self.drafter = drafter
        self.k = drafter.k
        # Pages held past num_tokens before a round: the chain writes positions up to
        # num_tokens + k - 3, the verify step reaches num_tokens + k - 1 (held by then).
        self.lookahead = max(drafter.k - 1, 0)
        self._step: _StepRows | None = None
        self.num_rounds = 0  # device rounds run (catch-up only or with the chain)

    def warmup(self) -> None:
        self.drafter.warmup()

    def observe(self, out: SchedulerOutput, pending: Any) -> None:
        """Step `out` was applied; `pending` (the runner's `ModelPending`) holds its aux."""
        aux = getattr(pending, "aux", None)
        if aux is None:
            raise ValueError("the EAGLE-3 proposer needs the target step's auxiliary hidden "
                             "states: the runner was built without aux_layers")
        rows, flat = [], 0
        for s in out.seqs:
            rows.append(_Row(s.sequence, s.epoch, s.start, s.num_new_tokens, flat))
            flat += s.num_new_tokens
        self._step = _StepRows(tuple(rows), aux, int(aux.shape[0]))

    def propose(self, sequences: GenericSequence[Sequence]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in sequences]
        step, self._step = self._step, None
        if step is None:
            return out
        draft: list[DraftSeq] = []
        caught_up: dict[int, int] = {}  # id(sequence) -> its index in the round
        for r in step.rows:
            seq = r.seq
            if seq.is_finished or seq.epoch != r.epoch:
                continue
            # Rows whose next token is known and verified: p + 1 < num_tokens.
            c = min(r.n, seq.num_tokens - 1 - r.start)
            if c <= 0:
                continue
            if r.start + c == seq.num_tokens - 1:
                caught_up[id(seq)] = len(draft)
            draft.append(DraftSeq(seq.all_token_ids[r.start + 1:r.start + 1 + c], r.start,
                                  list(seq.pages), tuple(range(r.flat, r.flat + c))))
        if not draft:
            return out
        asked = [(i, caught_up[id(s)]) for i, s in enumerate(sequences) if id(s) in caught_up]
        rnd = self.drafter.pack(draft, step.num_tokens)
        proposals = self.drafter.propose(rnd, step.aux, chain=bool(asked))
        self.num_rounds += 1
        if asked:
            host = proposals_to_host(proposals)
            for i, j in asked:
                out[i] = host[j].tolist()
        return out
