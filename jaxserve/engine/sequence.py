"""One sequence's state machine: its status, tokens, finish reason and timings.

Plain Python (no jax). A `Sequence` is what the scheduler runs; the user's request is a
`group.Group` of `n` of them (its `n` parallel samples of one prompt), which share the
client's `request_id` (child 0 prefills the prompt; the others fork its full prompt pages,
see `forks.py`).

Identity: `request_id` is the client's label and is never used as a key below the Engine;
`seq_id` is an integer the Scheduler assigns when the sequence is queued (unique for the
scheduler's life), and every scheduler / allocator structure is keyed by it, so no client
string can collide with another request's sequences.

State: WAITING -> RUNNING -> FINISHED, with RUNNING -> WAITING on preemption (its pages are
freed and its tokens recomputed later). Each preemption bumps `epoch`, the staleness key of
the rows scheduled for it (`ScheduledSeq.epoch`: a row of an older epoch is skipped by
`Scheduler.update` / `unschedule`); `metrics.num_preemptions` only counts them.

Progress counters (the one place their invariant is stated). `all_token_ids` = prompt +
generated tokens known on the host (`num_tokens`); overlapped steps (the engine dispatches
step N+1 before it applies step N's results) add tokens known only on the device:
  num_computed_tokens <= num_scheduled_tokens <= num_tokens + num_in_flight
- `num_computed_tokens`: positions whose K/V are in pages, from steps whose results were
  applied (what the prefix cache, the forks and a WAITING sequence's next chunk read);
- `num_scheduled_tokens`: also the positions of steps dispatched but not yet applied (what
  `schedule()` plans the next chunk from; vLLM v1's `num_computed_tokens` under async
  scheduling);
- `num_in_flight`: tokens those dispatched steps sample, not on the host yet (vLLM v1's
  `num_output_placeholders`); a position >= `num_tokens` is one of them, which the device
  feeds from the previous step's sampler output.
With no step in flight for it (always, without overlap; and after a preemption, which zeroes
all three) computed == scheduled and `num_in_flight` is 0. They stay three counters rather
than vLLM's two because the prefix cache and the forks must not see positions a failed or
stale step may never write.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import TYPE_CHECKING

import numpy as np

from jaxserve.engine.lora_request import LoraBinding
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.token_filter import TokenFilter

if TYPE_CHECKING:  # the grammar library loads only where a compiler is built
    from jaxserve.engine.grammar import SequenceGrammar


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop_token_id was generated, or the output's grammar reached its end
    LENGTH = "length"  # max_tokens (or max_model_len) reached
    EOS = "eos"  # the model's end-of-sequence token
    STOP_STRING = "stop_string"  # a stop string appeared in the text
    ABORT = "abort"  # aborted by the caller, a disconnect, or shutdown
    ERROR = "error"  # a step failed on this request (`Sequence.error` says why)


@dataclasses.dataclass
class RequestMetrics:
    """Wall-clock times (time.monotonic) of one sequence's life; None until they happen."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache / a fork
    # Speculative decoding: tokens proposed for this sequence and those the target accepted.
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # Gaps between consecutive generated tokens (seconds), for ITL percentiles.
    inter_token_latencies: list[float] = dataclasses.field(default_factory=list)

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def token_arrived(self, now: float) -> None:
        """Tokens reached the host at `now` (one step's: a verification's arrive together, one
        gap as a stream sees it): the first token's time, or one more inter-token gap."""
        if self.first_token_time is None:
            self.first_token_time = now
        else:
            self.inter_token_latencies.append(now - (self.last_token_time or now))
        self.last_token_time = now


@dataclasses.dataclass(eq=False)
class Sequence:
    request_id: str  # the client's id (a label: shared by the n samples of one request)
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    arrival_time: float
    priority: int = 0
    sample_index: int = 0  # which of the n samples this is
    max_tokens: int = 1  # resolved from sampling_params and max_model_len
    seed: int = 0  # effective sampling seed (drawn by the engine when the caller gave none)
    seq_id: int = -1  # assigned by `Scheduler.add_request`; the key of every scheduler table
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None  # why the sequence finished with ERROR
    num_computed_tokens: int = 0
    num_scheduled_tokens: int = 0  # >= num_computed_tokens: includes dispatched steps
    num_in_flight: int = 0  # tokens sampled by dispatched steps, not yet applied
    epoch: int = 0  # bumped by each preemption: rows scheduled before it are stale
    pages: list[int] = dataclasses.field(default_factory=list)  # KV group 0's block table
    # The block tables of KV groups 1.. (`models/kv_groups.py`; empty for a model without
    # groups). A sliding group's table keeps its length (one entry per page of the
    # sequence) with the trash page 0 where pages slid out of the window were freed.
    group_pages: list[list[int]] = dataclasses.field(default_factory=list)
    page_hashes: list[bytes] = dataclasses.field(default_factory=list)  # of full pages
    num_registered_pages: int = 0  # pages already entered into the prefix cache
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    all_token_ids: list[int] = dataclasses.field(default_factory=list)
    # Top-N logprobs per generated token: [(token_logprob, [(id, logprob), ...]), ...]
    output_logprobs: list[tuple[float, list[tuple[int, float]]]] = dataclasses.field(
        default_factory=list)
    # With prompt_logprobs (sample 0 only): one entry per prompt token, filled as the prefill
    # chunks compute them (`engine.prompt_logprobs.unpack`); entry 0 stays None (no context).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: RequestMetrics = dataclasses.field(default_factory=lambda: RequestMetrics(0.0))
    # Its position in its structured_outputs grammar (None: unconstrained). It advances as
    # tokens are applied and is kept across preemption (the output tokens are kept too).
    grammar: "SequenceGrammar | None" = None
    # Its allowed_token_ids / bad_words (None: neither), compiled at admission and shared by
    # the request's samples (it keeps no state: `fill` reads the output tokens).
    token_filter: TokenFilter | None = None
    # Speculative decoding: the tokens proposed to follow this sequence's last token, set by
    # the proposer right before a step is scheduled and consumed by that step's schedule
    # (`speculation.Speculator`); the step verifies them (a (1 + k)-token query).
    spec_token_ids: list[int] = dataclasses.field(default_factory=list)
    # Its LoRA adapter (None: the base model; shared by the n samples of a request) and, while
    # RUNNING, the device slot it pins (`lora_slots.LoraSlots`; 0 otherwise).
    lora: LoraBinding | None = None
    lora_slot: int = 0

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        if self.metrics.arrival_time == 0.0:
            self.metrics.arrival_time = self.arrival_time

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @functools.cached_property
    def logit_bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(i32[k], f32[k]): this request's logit_bias as the step's bias row wants it, packed
        once (SamplingParams is frozen) instead of from Python tuples every step."""
        entries = self.sampling_params.logit_bias
        return (np.array([t for t, _ in entries], np.int32),
                np.array([b for _, b in entries], np.float32))

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether this sequence's prefill scores its prompt: the request asked for prompt
        logprobs and this is sample 0 (the other samples fork its prompt pages)."""
        return self.sampling_params.prompt_logprobs is not None and self.sample_index == 0

    @property
    def masks_tokens(self) -> bool:
        """Whether the steps that sample it send a token mask (a grammar, a token filter)."""
        return self.grammar is not None or self.token_filter is not None

    @property
    def mask_follows_output(self) -> bool:
        """Whether that mask depends on the tokens generated so far (so a step behind one in
        flight fills it late, see `pipeline.Pipeline`)."""
        return self.grammar is not None or (self.token_filter is not None
                                            and self.token_filter.follows_output)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def record_logprobs(self, logprob: float, top_ids: np.ndarray, top_logprobs: np.ndarray,
                        index: int = -1) -> None:
        """Output token `index`'s logprobs entry (entries are recorded in output order: a
        step that emits several tokens records each): its own logprob, then the top
        `sampling_params.logprobs` (ids already listed keep their first value)."""
        k = self.sampling_params.logprobs or 0
        entry = {int(self.output_token_ids[index]): float(logprob)}
        for tid, lp in zip(top_ids[:k], top_logprobs[:k]):
            entry.setdefault(int(tid), float(lp))
        self.output_logprobs.append((float(logprob), list(entry.items())))

    def take_proposals(self, start: int, budget: int, max_model_len: int) -> tuple[int, ...]:
        """The proposals this sequence's decode row verifies in a step that schedules it from
        `start` with `budget` tokens left (consumed either way): only a plain decode (its last
        token on the host, nothing in flight), cut to what the budget, max_tokens and
        max_model_len leave (a row of 1 + j tokens emits up to j + 1)."""
        spec, self.spec_token_ids = self.spec_token_ids, []
        if not spec or self.num_in_flight or start != self.num_tokens - 1:
            return ()
        j = min(len(spec), budget - 1, self.max_tokens - self.num_output_tokens - 1,
                max_model_len - self.num_tokens - 1)
        return tuple(spec[:j]) if j > 0 else ()

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def token_stop(self, token: int, max_model_len: int) -> FinishReason | None:
        """The finish reason the token just appended gives this sequence (None: it goes on):
        EOS / a stop token id once min_tokens are out, then max_tokens / max_model_len."""
        sp = self.sampling_params
        if self.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token in self.eos_token_ids:
                return FinishReason.EOS
            if token in sp.stop_token_ids:
                return FinishReason.STOP
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop the output tokens after the first `num_output_tokens` (and their logprobs):
        a step that emitted several tokens (speculative decoding) whose run a stop string or
        the grammar's end cut short. Only for a sequence about to finish: its pages and
        computed counts are not rolled back."""
        drop = self.num_output_tokens - num_output_tokens
        if drop <= 0:
            return
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[len(self.all_token_ids) - drop:]
        del self.output_logprobs[num_output_tokens:]
