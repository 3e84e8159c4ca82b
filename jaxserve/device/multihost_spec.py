"""A speculative drafter over several hosts: process 0's proposal rounds mirrored by the
others, as `multihost.py` mirrors its steps.

Data flow: process 0's engine proposer calls `LeaderDrafter.propose(rnd, ...)` -> under the
leader's lock (`LeaderRunner.announcing`: rounds and steps reach every process in one order)
broadcast header i32[7] = (ROUND, T, S, chain, run, 0, 0) and the round's arrays
(`DraftRound`'s leaves, shapes from (T, S) and the table width) -> the drafter's round here.
Process i (`multihost.follow`): ROUND -> `follow_round`: receive the arrays -> the same
round on its devices, an EAGLE-3 head fed the aux states of the step it ran last. The
drafter's params, pages and rounds are replicated over the global mesh (every process
built the same drafter: `serving.build.build_follower`). At warmup each process compiles
its own rounds, and process 0 announces one round per bucket with run = 0 so every
broadcast shape compiles too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxserve.device.multihost_wire import ROUND, broadcast
from jaxserve.device.spec_draft import DraftRound, empty_round
from jaxserve.device.spec_draft_model import DraftModelProposer
from jaxserve.device.spec_eagle3 import Eagle3Proposer

if TYPE_CHECKING:
    from jaxserve.device.multihost import LeaderRunner

Drafter = DraftModelProposer | Eagle3Proposer


def _send_round(rnd: DraftRound, chain: bool, run: bool) -> None:
    broadcast([np.array([ROUND, len(rnd.token_ids), len(rnd.last_rows), chain, run, 0, 0],
                         np.int32)], True)
    broadcast([np.asarray(a) for a in jax.tree.leaves(rnd)], True)


def _receive_round(drafter: Drafter, num_tokens: int, num_seqs: int) -> DraftRound:
    """The leader's round of this bucket (an empty round of the same shapes is the mold)."""
    mold = empty_round(num_tokens, num_seqs, drafter.max_pages_per_seq,
                       eagle3=isinstance(drafter, Eagle3Proposer))
    leaves, tree = jax.tree.flatten(mold)
    return jax.tree.unflatten(tree, broadcast(leaves, False))


class LeaderDrafter:
    """Process 0's drafter (a draft model's or an EAGLE-3 head's, replicated over the global
    mesh): every proposal round is announced to the followers (ROUND: the bucket, the chain
    flag, then the round's arrays), which run the same round on their devices; the rest is
    the drafter's own (`pack`, `k`, `buckets`, ...)."""

    def __init__(self, drafter: Drafter, leader: "LeaderRunner"):
        self.drafter = drafter
        self.leader = leader

    def __getattr__(self, name: str) -> object:
        return getattr(self.drafter, name)

    def warmup(self) -> None:
        """The drafter's rounds compiled here; every bucket's broadcast on every process
        (announced with run = 0: the followers compiled their rounds before following)."""
        self.drafter.warmup()
        eagle3 = isinstance(self.drafter, Eagle3Proposer)
        for t, s in self.drafter.buckets:
            with self.leader.announcing("proposal round"):
                _send_round(empty_round(t, s, self.drafter.max_pages_per_seq, eagle3), True,
                            False)

    def propose(self, rnd: DraftRound, *args: object, chain: bool = True) -> jax.Array:
        with self.leader.announcing("proposal round"):
            _send_round(rnd, chain, True)
            if isinstance(self.drafter, Eagle3Proposer):
                return self.drafter.propose(rnd, *args, chain=chain)  # type: ignore[arg-type]
            return self.drafter.propose(rnd)



def follow_round(drafter: Drafter | None, num_tokens: int, num_seqs: int, chain: bool,
                 run: bool, aux: Any) -> None:
    """A follower's share of one announced round (`aux`: the last step's aux states)."""
    if drafter is None:
        raise RuntimeError("the leader runs a speculative drafter this process was not built "
                           "with: engines built differently")
    rnd = _receive_round(drafter, num_tokens, num_seqs)
    if run and isinstance(drafter, Eagle3Proposer):
        drafter.propose(rnd, aux, chain=chain)
    elif run:
        drafter.propose(rnd)
