"""Speculative decoding on the host: who speculates, the proposals, and their verification.

Plain Python / numpy (no jax). The step core owns one `Speculator` when the engine is built
with a `speculative_config`. Data flow around one step:
  `propose(running)` (right before `Scheduler.schedule`): for each running sequence that may
    speculate (a plain decode with its last token on the host, `SamplingParams.speculative`
    on) the proposer's tokens, cut where its grammar refuses one or ends, go into
    `Sequence.spec_token_ids`; nothing when the step is too big to gain (`active`). The
    proposer gets the `Sequence`s (n-gram lookup reads their tokens, `OnTokens`; a draft
    model, `serving/draft_proposer.py`, their block tables too, after `reserve` held the
    pages its round writes);
  `Scheduler.schedule` turns them into a (1 + j)-token verification row (cut to the budget,
    max_tokens and max_model_len), `batch_spec.expand` gives each position a sampler row;
  `verify(row, sampled)` (when the step is applied): the accepted proposals plus the
    target's own token, which `Scheduler.update` appends (`batch_spec.py` states the rule and
    why it keeps the target's distribution).
The proposals need the previous step's tokens on the host, so while speculation is active
(`wants_host_tokens`) the overlapped pipeline applies each step before it schedules the next.
An EAGLE-3 head (`serving/eagle3_proposer.py`, a `StepObserver`) reads every applied step
(`observe`, from `StepCore.apply`: the step's rows and its hidden states on the device) and
is asked every step, with no sequences while none speculates, so its own K/V stays complete.

Backing off: a step with `max_running` or more running sequences does not speculate (vLLM's
`disable_by_batch_size`; `engine.sizing.speculative_max_running` gives the default when the
user sets none: the batch at which a step of (k + 1) tokens a sequence stops being
weight-bound and verification would cost more than it saves).

Counters (vLLM's spec_decode metrics, `EngineStats`): drafts (rows that verified at least one
proposal), draft tokens, accepted tokens, and how many drafts emitted 1..k+1 tokens.
"""

from __future__ import annotations

from collections.abc import Sequence as GenericSequence
from typing import Callable, Protocol

import numpy as np

from jaxserve.engine.runner import PendingStep
from jaxserve.engine.scheduled import ScheduledSeq, SchedulerOutput
from jaxserve.engine.sequence import Sequence, SequenceStatus


class Proposer(Protocol):
    """Proposes for whole sequences: a draft model needs each one's block table (`pages`),
    and keeps per-sequence state keyed by (seq_id, epoch). `lookahead` (optional, default
    0): for how many tokens past `num_tokens` the sequence must hold pages before it
    proposes (a draft model writes KV up to position num_tokens + k - 2 before the verify
    step is scheduled: k, the verify step's own need); the Speculator holds them first
    (`reserve`) and proposes only for the sequences that got them."""

    def propose(self, sequences: GenericSequence[Sequence]) -> list[list[int]]:
        """Up to k proposed tokens to follow each sequence's tokens (empty: none)."""


class StepObserver(Protocol):
    """A proposer that reads every applied step (an EAGLE-3 head reads the target step's
    hidden states, which exist only on the device and only until the next step): its
    `observes_every_step` is True; the Speculator calls `observe` with every applied step
    and `propose` before every schedule, with no sequences when none may speculate (the
    proposer still updates its own state), and asks the pipeline for each step's tokens."""

    observes_every_step: bool

    def observe(self, out: SchedulerOutput, pending: PendingStep) -> None:
        """Step `out` was applied; `pending` is what the runner dispatched it as."""


class TokenListProposer(Protocol):
    def propose(self, sequences: GenericSequence[GenericSequence[int]]) -> list[list[int]]:
        """Up to k proposed tokens to follow each token list (empty: none)."""


class OnTokens:
    """A proposer of token lists (n-gram lookup, test oracles) as a `Proposer`."""

    lookahead = 0

    def __init__(self, inner: TokenListProposer):
        self.inner = inner

    def propose(self, sequences: GenericSequence[Sequence]) -> list[list[int]]:
        return self.inner.propose([s.all_token_ids for s in sequences])


# Holds a sequence's pages for its first n tokens without preempting anyone; False: no room.
Reserve = Callable[[Sequence, int], bool]


class Speculator:
    def __init__(self, proposer: Proposer, num_speculative_tokens: int, max_running: int,
                 reserve: Reserve | None = None):
        if num_speculative_tokens < 1 or max_running < 2:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} must be >= 1 "
                             f"and max_running={max_running} >= 2")
        self.proposer = proposer
        self.every_step = bool(getattr(proposer, "observes_every_step", False))
        self.reserve = reserve  # needed by a proposer with a lookahead
        self.k = num_speculative_tokens
        self.max_running = max_running  # steps with this many running sequences do not
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.acceptance_counts = [0] * (num_speculative_tokens + 1)

    # ----------------------------------------------------------------------- proposing
    def active(self, running: GenericSequence[Sequence]) -> bool:
        return len(running) < self.max_running

    @staticmethod
    def may_speculate(seq: Sequence) -> bool:
        """A running plain decode whose tokens are all on the host, not opted out."""
        return (seq.status is SequenceStatus.RUNNING and seq.sampling_params.speculative
                and not seq.num_in_flight and seq.num_scheduled_tokens == seq.num_tokens - 1)

    def wants_host_tokens(self, running: GenericSequence[Sequence]) -> bool:
        """Whether the next step may speculate, so the step in flight must be applied
        before it is scheduled (the proposals follow its tokens); always, with a proposer
        that reads every step (`StepObserver`)."""
        if self.every_step:
            return bool(running)
        return self.active(running) and any(s.sampling_params.speculative for s in running)

    def observe(self, out: SchedulerOutput, pending: PendingStep) -> None:
        """Step `out` was applied (a `StepObserver` proposer reads it)."""
        if self.every_step:
            self.proposer.observe(out, pending)  # type: ignore[attr-defined]

    def propose(self, running: GenericSequence[Sequence]) -> None:
        """Fill `spec_token_ids` of the running sequences that may speculate this step."""
        seqs = [s for s in running if self.may_speculate(s)] if self.active(running) else []
        ahead = getattr(self.proposer, "lookahead", 0)
        if ahead and seqs:  # the proposer writes KV up to there now; the verify step would
            if self.reserve is None:
                raise ValueError("a proposer with a lookahead needs the Speculator's reserve")
            seqs = [s for s in seqs if self.reserve(s, s.num_tokens + ahead)]
        if not seqs and not self.every_step:
            return
        for seq, tokens in zip(seqs, self.proposer.propose(seqs)):
            seq.spec_token_ids = _grammar_prefix(seq, tokens[:self.k])

    # ----------------------------------------------------------------------- verifying
    def verify(self, row: ScheduledSeq, sampled: np.ndarray) -> list[int]:
        """The tokens a verification row emits, from its sampler rows' tokens `sampled`
        (i32[1 + j]: y_m sampled after the prefix with proposals p_1..p_m): p_{m+1} is
        accepted while y_m == p_{m+1}; then the first y_m that differs, or y_j (the bonus
        token) when all were accepted."""
        proposed = row.spec_token_ids
        ys = [int(y) for y in sampled[:len(proposed) + 1]]
        a = 0
        while a < len(proposed) and ys[a] == proposed[a]:
            a += 1
        self.num_drafts += 1
        self.num_draft_tokens += len(proposed)
        self.num_accepted_tokens += a
        self.acceptance_counts[a] += 1
        m = row.sequence.metrics
        m.spec_num_draft_tokens += len(proposed)
        m.spec_num_accepted_tokens += a
        return ys[:a + 1]


def _grammar_prefix(seq: Sequence, tokens: list[int]) -> list[int]:
    """`tokens` cut before the first one `seq`'s grammar refuses or that ends it (no mask
    follows a finished grammar; the target samples that last token itself)."""
    if seq.grammar is None or not tokens:
        return tokens
    g = seq.grammar.copy()
    for i, t in enumerate(tokens):
        if not g.accept(t) or g.finished:
            return tokens[:i]
    return tokens
