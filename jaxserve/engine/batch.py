"""SchedulerOutput -> StepBatch: one step's inputs, padded to a (token, seq) bucket, grouped
by the feature that reads them.

Plain numpy (no jax); `model_runner` is the only place these cross to the device. For the
T_b padded tokens of the S_b padded sequences of one step, a StepBatch holds one part per
feature, each packed from the scheduled rows by its own packer (`batch_parts.py`, where the
arrays and their shapes are described):
  forward          ForwardInputs      token ids, fed rows, positions, KV slots and block
                                      tables, kv / query lengths, logits indices
  lora             LoraRows           each token's LoRA adapter slot i32[T_b] (0: none)
  sampling         SamplingRows       knob matrix f32[S_b, K], per-row rng keys
  penalties        PenaltyRows        token history i32[S_b, Ph] (Ph = 0: no row penalised)
  bias             LogitBiasRows      logit_bias entries [S_b, B] (B = 0: no row biased)
  mask             TokenMaskRows      grammar / token filter bitmask (`batch_mask.py`)
  prompt_logprobs  PromptLogprobRows  the tokens scored as prompt logprobs, [L] (L = 0: none;
                                      `prompt_logprobs.py`)
A part whose feature no row of the step uses has width 0 (nothing sent, the device variant
without it runs). `empty_batch` builds every part's padding: the batch warmup compiles each
bucket and variant with. `parts` / `leaves` walk the tree generically (the runner's device
placement, the multi-host broadcast), so a new part only needs its line here.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Iterator, Mapping, Sequence

import numpy as np

from jaxserve.engine import batch_spec
from jaxserve.engine.batch_mask import (TokenMaskRows, fill_bitmask, late_bitmask,
                                        pack_token_mask)
from jaxserve.engine.batch_parts import (BIAS_PAD_ID, ForwardInputs, LogitBiasRows,
                                         LoraRows, PenaltyRows, SamplingRows, bias_width,
                                         pack_forward, pack_logit_bias, pack_lora,
                                         pack_penalties, pack_sampling, pad_bias, pad_rows,
                                         rng_key_data)
from jaxserve.engine.prompt_logprobs import PromptLogprobRows, pack_prompt_logprobs
from jaxserve.engine.scheduled import SchedulerOutput
from jaxserve.engine.token_filter import bitmask_words

# Re-exported: where the rest of the engine and the tests have always found them.
__all__ = ["BIAS_PAD_ID", "BatchShape", "StepBatch", "bias_width", "bitmask_words",
           "bucket_for", "build_batch", "default_buckets", "default_token_buckets",
           "empty_batch", "fill_bitmask", "late_bitmask", "leaves", "pad_bias", "pad_rows",
           "parts", "present", "rng_key_data"]


def bucket_for(num_tokens: int, num_seqs: int,
               buckets: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """Smallest compiled (tokens, seqs) bucket holding the step (buckets sorted by tokens)."""
    i = bisect.bisect_left(buckets, (num_tokens, 0))
    for t, s in buckets[i:]:
        if s >= num_seqs:
            return t, s
    raise ValueError(f"a step of {num_tokens} tokens in {num_seqs} sequences exceeds every "
                     f"compiled bucket (largest {buckets[-1]})")


def default_buckets(limit: int, smallest: int) -> tuple[int, ...]:
    """Powers of two from `smallest` up to `limit`, with `limit` itself as the last bucket."""
    out = []
    b = smallest
    while b < limit:
        out.append(b)
        b *= 2
    out.append(limit)
    return tuple(out)


# Default token buckets (`default_token_buckets`): powers of two up to 8, then steps of
# max(8, 1/STEPS_PER_OCTAVE of the octave): 8, 16, 24, ..., 64, 80, ..., 128, 160, ..., 256,
# 320, ... Why (scripts/bench/bench_buckets.py and docs/benchmarks/index.md "Buckets", bundled model
# on a 2-core CPU):
# a step's cost is about a + b*T + r*S (T tokens, S sequence rows) with a fixed part a (the
# weights are read whatever T is) worth ~70 tokens, so below 64 tokens the next multiple of
# 8 costs a decode step under ~12% of its time; above, the cost is nearly linear in T and the
# gap between buckets is the padding: a quarter octave keeps a step with its seqs bucket full
# under ~16% padded (8 per octave: ~12%, for 12 more compiled forwards at a budget of 512
# and a slower start) where powers of two padded up to ~45% (a 257-token step ran as 512).
# Each token bucket is one compile of the whole model (and of the prompt-logprobs pass).
FINE_FROM = 8
FINE_STEP = 8
STEPS_PER_OCTAVE = 4


def default_token_buckets(limit: int, steps_per_octave: int = STEPS_PER_OCTAVE
                          ) -> tuple[int, ...]:
    """Token buckets up to a step budget of `limit` tokens (the last is `limit` itself)."""
    if limit < 1 or steps_per_octave < 1:
        raise ValueError(f"limit={limit} and steps_per_octave={steps_per_octave} must be >= 1")
    out = []
    b = 1
    while b < limit:
        out.append(b)
        if b < FINE_FROM:
            b *= 2
        else:
            octave = 1 << (b.bit_length() - 1)  # the power of two at or below b
            b += max(FINE_STEP, octave // steps_per_octave)
    out.append(limit)
    return tuple(out)


@dataclasses.dataclass
class StepBatch:
    """One step's inputs, one part per feature (`batch_parts.py` has each part's arrays)."""

    forward: ForwardInputs
    lora: LoraRows
    sampling: SamplingRows
    penalties: PenaltyRows
    bias: LogitBiasRows
    mask: TokenMaskRows
    prompt_logprobs: PromptLogprobRows

    @property
    def num_seqs_bucket(self) -> int:
        """S_b, the step's padded sequence count."""
        return len(self.forward.kv_lens)


def parts(batch: StepBatch) -> Iterator[tuple[str, object]]:
    """(name, part) of each part of `batch`, in declaration order."""
    for f in dataclasses.fields(batch):
        yield f.name, getattr(batch, f.name)


def leaves(part: object) -> Iterator[tuple[str, np.ndarray | None]]:
    """(name, array) of each array field of a part, in declaration order (the LATE ones
    included; an absent optional array is None)."""
    for f in dataclasses.fields(part):  # type: ignore[arg-type]
        yield f.name, getattr(part, f.name)


def present(part: object) -> bool:
    """Whether the step sends and runs `part` (a part may say it is off, see
    `PromptLogprobRows.present`; a zero-width part is still sent, its shape selects the
    device variant)."""
    return getattr(part, "present", True)


@dataclasses.dataclass(frozen=True)
class BatchShape:
    # (tokens, seqs) pairs compiled at warmup, sorted; by default one sequence bucket per
    # token bucket, min(tokens, max_num_seqs): a step cannot hold more sequences than tokens.
    buckets: tuple[tuple[int, int], ...]
    page_size: int
    max_pages_per_seq: int
    vocab_size: int
    history_len: int  # Ph when penalties are on (max_model_len)
    num_kv_groups: int = 1  # G: block tables per sequence (`models/kv_groups.py`)


def build_batch(out: SchedulerOutput, shape: BatchShape,
                prev_rows: Mapping[int, int] | None = None,
                fill_grammars: bool = True) -> StepBatch:
    """Pack one scheduled step; rows follow `out.seqs` order. `prev_rows`: seq_id -> batch
    row in the step dispatched before this one, for the sequences it sampled (the source of
    each fed row's token; ValueError when a fed row's sequence is not there).
    `fill_grammars=False`: the masked rows are only marked `constrained`, and the runner
    gets their mask late (`late_bitmask`, once the previous step's tokens are in)."""
    T, S = bucket_for(out.num_tokens, out.num_rows, shape.buckets)
    forward = pack_forward(out, shape, T, S, prev_rows)
    batch = StepBatch(forward=forward, lora=pack_lora(out, T, forward.cu_q_lens),
                      sampling=pack_sampling(out, S),
                      penalties=pack_penalties(out, S, shape.history_len),
                      bias=pack_logit_bias(out, S),
                      mask=pack_token_mask(out, S, shape.vocab_size, fill_grammars),
                      prompt_logprobs=pack_prompt_logprobs(out, T, forward.cu_q_lens))
    if out.num_rows > out.num_seqs:  # rows that verify proposals: a sampler row a position
        batch_spec.expand(batch, out)
    return batch


def empty_batch(shape: BatchShape, num_tokens: int, num_seqs: int, penalties: bool,
                bias: bool = False, prompt_lp: bool = False) -> StepBatch:
    """An all-padding batch of one bucket (no live sequence): what warmup compiles with;
    `penalties` / `bias` / `prompt_lp` give it the history / logit bias / prompt logprobs
    arrays of a step that uses them."""
    S = num_seqs
    return StepBatch(forward=ForwardInputs.padding(shape, num_tokens, S),
                     lora=LoraRows.padding(num_tokens),
                     sampling=SamplingRows.padding(S),
                     penalties=PenaltyRows.padding(S, shape.history_len if penalties else 0),
                     bias=LogitBiasRows.padding(S, bias), mask=TokenMaskRows.padding(S),
                     prompt_logprobs=PromptLogprobRows.padding(num_tokens if prompt_lp else 0))
