"""What `Scheduler.schedule` hands the step: its rows, in batch order.

Plain Python (no jax). A `ScheduledSeq` is one sequence's share of a step (a prefill chunk, a
decode, or a decode that verifies proposed tokens); a `SchedulerOutput` is the whole step.
The batch builder packs them (`batch.py`), the step core applies their results through
`Scheduler.update`. LoRA (`lora_slots.py`): each row's adapter slot, the slots the step's rows
use (held until the step is collected) and the slot loads the runner gets before the step.
"""

from __future__ import annotations

import dataclasses

from jaxserve.engine.lora_request import LoraBinding
from jaxserve.engine.sequence import Sequence


@dataclasses.dataclass
class ScheduledSeq:
    sequence: Sequence
    start: int  # position of the first new token (= num_scheduled_tokens before the step)
    num_new_tokens: int
    samples: bool  # this chunk reaches the end of the sequence: sample its next token
    # The chunk's (single) token is still in flight: sampled by the step dispatched before
    # this one, on the device only; the batch feeds it from that step's sampler output.
    fed: bool = False
    epoch: int = 0  # `Sequence.epoch` when scheduled (a row of an older epoch is stale: skipped)
    # Speculative decoding: the proposed tokens this decode row verifies (its query is the
    # last token then these, num_new_tokens = 1 + len; the step samples every position).
    spec_token_ids: tuple[int, ...] = ()
    lora_slot: int = 0  # the device slot of its adapter this step (0: the base model)


@dataclasses.dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq]  # batch row order: decodes first, then prefill chunks
    num_tokens: int
    preempted: list[Sequence]
    # (slot, adapter) pairs the runner loads before this step (`Runner.load_lora`), and the
    # slots its rows use, held against refills until the step is collected (`lora_slots.py`).
    lora_loads: list[tuple[int, LoraBinding]] = dataclasses.field(default_factory=list)
    lora_slots: tuple[int, ...] = ()

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_rows(self) -> int:
        """Sampler rows of the step: one per sequence, plus one per proposed token (each
        verified position samples; `batch_spec.py`)."""
        return len(self.seqs) + sum(len(s.spec_token_ids) for s in self.seqs)
