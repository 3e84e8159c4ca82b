"""Prompt logprobs on device: the LM head over the prompt positions a step computed.

Data flow: the forward keeps every token's last hidden state ([T_b, hidden], before the final
norm; `models.paged.paged_hidden`). On a step where some row asked for prompt logprobs, the
engine's batch names which of those tokens to score (`indices`, flat token index) and the
prompt token that follows each (`targets`); `prompt_logprobs` runs final norm + LM head +
log_softmax on them, `CHUNK` positions at a time, and returns each target's logprob and the
top MAX_LOGPROBS (id, logprob) pairs: the raw model distribution, as the sampler reports
generated tokens' logprobs (no temperature, penalty or bias).

Cost: a step without such a row runs nothing here (the runner skips the call). A step with
them pays one [CHUNK, vocab] LM head per CHUNK scored positions, only for the chunks that
hold real entries (a `fori_loop` with a traced trip count: padding chunks never run), so the
[T_b, vocab] logits of a whole prefill are never materialised (T_b = 8192 x 49152 vocab would
be 1.6 GB in f32). Compiled once per token bucket at warmup.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxserve.engine.sampling_params import MAX_LOGPROBS
from jaxserve.models.config import ModelConfig
from jaxserve.models.blocks import lm_logits, log_softmax
from jaxserve.models.families import ModelParams

CHUNK = 128  # scored positions per LM-head pass: [CHUNK, vocab] f32 logits live at a time


@struct.dataclass
class PromptLogprobsInputs:
    indices: jax.Array  # i32[T_b] flat token index of each scored position (padding: 0)
    targets: jax.Array  # i32[T_b] the prompt token that follows it (padding: 0)
    num: jax.Array  # i32[1] how many leading entries are real


@struct.dataclass
class PromptLogprobsOutput:
    logprob: jax.Array  # f32[T_b] each target's logprob (padding entries: garbage)
    top_ids: jax.Array  # i32[T_b, MAX_LOGPROBS]
    top_logprobs: jax.Array  # f32[T_b, MAX_LOGPROBS]


def prompt_logprobs(params: ModelParams, hidden: jax.Array, inputs: PromptLogprobsInputs,
                    cfg: ModelConfig, invariant: bool = False) -> PromptLogprobsOutput:
    """Score `inputs.num[0]` positions of `hidden` ([T, hidden]). Pure; jit it. `invariant`
    (static; batch-invariant mode): `blocks.log_softmax`'s fixed-order sum."""
    T = inputs.indices.shape[0]
    if T == 0:
        raise ValueError("prompt_logprobs: the batch has no prompt logprobs arrays (T_b = 0)")
    if hidden.shape[0] != T:
        raise ValueError(f"prompt_logprobs: hidden has {hidden.shape[0]} rows for a token "
                         f"bucket of {T}")
    C = min(CHUNK, T)
    padded = -(-T // C) * C
    indices = jnp.pad(inputs.indices, (0, padded - T))
    targets = jnp.pad(inputs.targets, (0, padded - T))
    K = MAX_LOGPROBS

    def chunk(i: jax.Array, acc: tuple[jax.Array, jax.Array, jax.Array]
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
        lp, ids, tops = acc
        start = i * C
        rows = jax.lax.dynamic_slice(indices, (start,), (C,))
        tgt = jax.lax.dynamic_slice(targets, (start,), (C,))
        logp = log_softmax(lm_logits(cfg, params, hidden[rows]), invariant)  # f32[C, V]
        chosen = jnp.take_along_axis(logp, tgt[:, None], axis=1)[:, 0]
        top_lp, top_ids = jax.lax.top_k(logp, K)
        return (jax.lax.dynamic_update_slice(lp, chosen, (start,)),
                jax.lax.dynamic_update_slice(ids, top_ids.astype(jnp.int32), (start, 0)),
                jax.lax.dynamic_update_slice(tops, top_lp, (start, 0)))

    num_chunks = (jnp.clip(inputs.num[0], 0, T) + C - 1) // C
    init = (jnp.zeros(padded, jnp.float32), jnp.zeros((padded, K), jnp.int32),
            jnp.zeros((padded, K), jnp.float32))
    lp, ids, tops = jax.lax.fori_loop(0, num_chunks, chunk, init)
    return PromptLogprobsOutput(logprob=lp[:T], top_ids=ids[:T], top_logprobs=tops[:T])
