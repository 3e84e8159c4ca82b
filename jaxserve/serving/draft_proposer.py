"""The engine's side of a draft model: which tokens the drafter still has to compute, per
sequence, and one proposal round per engine step (the engine's `speculation.Proposer`).

Data flow of `propose(seqs)` (the Speculator calls it right before scheduling, after holding
each sequence's pages for num_tokens + k tokens, `KVManager.reserve`):
  per sequence, its `_Drafted` state (keyed by seq_id, restarted when `Sequence.epoch`
  changed: a preempted sequence recomputes everything) says up to where the drafter's KV is
  valid (`computed`) -> the rows still to compute, positions computed .. num_tokens - 1,
  the last one the newest token, taken in running order while the round's token budget
  lasts (a longer catch-up is split over rounds; a sequence not caught up gets no
  proposals this step) -> `DraftSeq`s -> `DraftModelProposer.pack` / `.propose` (one device
  round: catch-up + greedy chain of k) -> proposals i32[S, k] to the host -> per sequence
  the k proposals, and the state: valid up to num_tokens, and the chain's tokens.

Why the chain's KV is reused: the chain writes proposal j's K/V at position num_tokens + j
- 1 (j < k). At the next round those positions are valid exactly as far as the sequence's
tokens there equal the proposals (an accepted proposal is the same token at the same
position after the same prefix), so the catch-up restarts at the first position that
differs (never later than the newest token, which always is a row: the first proposal
follows it).

Why the drafter never trusts a prefix-cache hit: a cached page's drafter KV was written only
if the sequence that computed it also speculated that far, so a new sequence starts from
position 0 (it rewrites the same values into shared pages). State of finished and preempted
sequences is dropped at the next round (the dict holds at most the running sequences plus
those that ended since).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence as GenericSequence

from jaxserve.device.spec_draft import DraftSeq, proposals_to_host
from jaxserve.device.spec_draft_model import DraftModelProposer
from jaxserve.engine.sequence import Sequence, SequenceStatus


@dataclasses.dataclass
class _Drafted:
    seq: Sequence
    epoch: int
    computed: int = 0  # positions 0 .. computed - 1 hold valid drafter KV
    chain: list[int] = dataclasses.field(default_factory=list)  # the last round's proposals,
    #                                                             the first at `computed`


class DraftModelEngineProposer:
    """A `DraftModelProposer` behind the engine's Proposer protocol (see the module doc)."""

    def __init__(self, drafter: DraftModelProposer):
        self.drafter = drafter
        self.k = drafter.k
        # Tokens past num_tokens whose pages must be held before a round: the catch-up
        # writes the newest token's KV, the chain positions num_tokens .. + k - 2, and the
        # verify step then reaches num_tokens + k - 1: hold that step's pages up front.
        self.lookahead = drafter.k
        self.max_round_tokens = max(t for t, _ in drafter.buckets)
        self.max_round_seqs = max(s for _, s in drafter.buckets)
        self._state: dict[int, _Drafted] = {}

    def warmup(self) -> None:
        self.drafter.warmup()

    def propose(self, sequences: GenericSequence[Sequence]) -> list[list[int]]:
        self._forget()
        out: list[list[int]] = [[] for _ in sequences]
        rows: list[tuple[int, _Drafted, DraftSeq]] = []
        budget = self.max_round_tokens
        for i, seq in enumerate(sequences):
            if budget == 0 or len(rows) == self.max_round_seqs:
                break
            st = self._advance(seq)
            take = min(seq.num_tokens - st.computed, budget)
            tokens = seq.all_token_ids[st.computed:st.computed + take]
            rows.append((i, st, DraftSeq(tokens, st.computed, list(seq.pages))))
            budget -= take
        if not rows:
            return out
        rnd = self.drafter.pack([r[2] for r in rows])
        proposals = proposals_to_host(self.drafter.propose(rnd))
        for j, (i, st, ds) in enumerate(rows):
            st.computed = ds.start + len(ds.token_ids)
            caught_up = st.computed == st.seq.num_tokens
            st.chain = proposals[j].tolist() if caught_up else []
            out[i] = list(st.chain)
        return out

    def _advance(self, seq: Sequence) -> _Drafted:
        """`seq`'s state, its valid KV extended over the last chain's accepted tokens."""
        st = self._state.get(seq.seq_id)
        if st is None or st.seq is not seq or st.epoch != seq.epoch:
            st = self._state[seq.seq_id] = _Drafted(seq, seq.epoch)
        tokens = seq.all_token_ids
        # The chain wrote proposals 1 .. k - 1 (the k-th never went in).
        for t in st.chain[:self.k - 1]:
            if st.computed >= len(tokens) or tokens[st.computed] != t:
                break
            st.computed += 1
        st.chain = []
        st.computed = min(st.computed, seq.num_tokens - 1)  # the newest token is a row
        return st

    def _forget(self) -> None:
        for sid in [sid for sid, st in self._state.items()
                    if st.seq.status is not SequenceStatus.RUNNING or st.epoch != st.seq.epoch]:
            del self._state[sid]

    @property
    def num_tracked(self) -> int:
        return len(self._state)
