"""The `eagle3` drafter: an EAGLE-3 head (`models/eagle3.py`) proposes k tokens greedily.

Data flow of one proposal round (`eagle3_round`, jitted once per (tokens, seqs) bucket, k
static, the head's KV donated): the target step's auxiliary hidden states aux f[T, 3 * Ht]
(`paged_hidden(..., aux_layers=cfg.aux_layers(target))`, left on the device) and a
`DraftRound` (spec_draft.py) whose row at position p pairs the token at p + 1 with
`aux[aux_rows[row]]`, the target's state at p (vLLM's shift) -> catch-up: `eagle3_fuse` of
the gathered aux rows -> `eagle3_hidden` over all rows through the head's pages (the target's
page ids) -> `eagle3_logits` at each sequence's last row -> argmax -> `draft_to_target`:
proposal 1 -> chain (`lax.fori_loop`, k - 1 steps): one row per sequence at the next
position, its token proposal j (a target id) and its hidden the previous row's output
(the pre-norm stream), -> proposal j + 1 -> (proposals i32[S, k] in target ids, updated KV).

The round's token bucket T is the target step's (the aux rows index its flat token axis, and
every catch-up row is a row of that step), so its compiled shapes are the engine's buckets.
The chain's rows hold the head's own hidden, not the target's: the next round re-runs the
head from the first position the target computed (rows with its aux states), overwriting them.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding

from jaxserve.device.model_runner import place_inputs
from jaxserve.device.spec_draft import (DraftRound, DraftSeq, chain_step_metadata,
                                        empty_round, pack_round)
from jaxserve.kernels_pallas import KVPages
from jaxserve.models.eagle3 import (Eagle3Params, draft_to_target, eagle3_fuse, eagle3_hidden,
                                    eagle3_logits, init_eagle3_kv)
from jaxserve.models.eagle3_config import NUM_AUX, Eagle3Config


def eagle3_round(params: Eagle3Params, kv_pages: KVPages, rnd: DraftRound, aux: jax.Array,
                 cfg: Eagle3Config, k: int, target_embed: Any = None,
                 attn_impl: str = "reference", chain: jax.Array | bool = True
                 ) -> tuple[jax.Array, KVPages]:
    """aux f[T_target, 3 * Ht] -> (proposals i32[S, k] target ids, updated kv_pages). Pure;
    jit with cfg, k, attn_impl static. `chain` (bool[], traced): False runs the catch-up
    only (the head's KV of the step's rows; proposals 2..k are then 0): what the engine runs
    after a step no sequence will speculate after, so the head's pages stay complete."""
    page_size = kv_pages.shape[2]
    S = rnd.last_rows.shape[0]
    live = jnp.arange(S) < rnd.md.num_seqs[0]

    def propose(out: jax.Array) -> jax.Array:
        logits = eagle3_logits(params, out, cfg, target_embed)
        return draft_to_target(params, jnp.argmax(logits, axis=-1).astype(jnp.int32))

    hidden = eagle3_fuse(params, aux[rnd.aux_rows])
    out, kv_pages = eagle3_hidden(params, kv_pages, rnd.token_ids, hidden, rnd.positions,
                                  rnd.md, cfg, target_embed, attn_impl)
    h = out[rnd.last_rows]
    # Catch-up only: no draft logits either (the lm_head over S rows is most of a small
    # round's cost); an XLA conditional runs one branch.
    first = jax.lax.cond(chain, propose, lambda h: jnp.zeros(S, jnp.int32), h)
    proposals = jnp.zeros((S, k), jnp.int32).at[:, 0].set(first)
    pos0 = rnd.positions[rnd.last_rows] + 1

    def chain_step(j: jax.Array, carry: tuple[jax.Array, jax.Array, KVPages]
                   ) -> tuple[jax.Array, jax.Array, KVPages]:
        proposals, h, kv = carry
        pos = pos0 + j - 1
        md = chain_step_metadata(rnd.md, pos, live, page_size)
        token = jax.lax.dynamic_index_in_dim(proposals, j - 1, axis=1, keepdims=False)
        h, kv = eagle3_hidden(params, kv, token, h, pos, md, cfg, target_embed, attn_impl)
        nxt = propose(h)
        return jax.lax.dynamic_update_index_in_dim(proposals, nxt, j, axis=1), h, kv

    steps = jnp.where(chain, k, 1)  # a traced bound: one executable for both
    proposals, _, kv_pages = jax.lax.fori_loop(1, steps, chain_step, (proposals, h, kv_pages))
    return jnp.where(live[:, None], proposals, 0), kv_pages


eagle3_round_jit = jax.jit(eagle3_round, static_argnames=("cfg", "k", "attn_impl"),
                           donate_argnames=("kv_pages",))


class Eagle3Proposer:
    """An EAGLE-3 head's params and KV pages, and its compiled proposal rounds."""

    def __init__(self, cfg: Eagle3Config, params: Eagle3Params, num_pages: int, page_size: int,
                 kv_dtype: Any, k: int, buckets: Sequence[tuple[int, int]],
                 max_pages_per_seq: int, target_embed: Any = None,
                 attn_impl: str = "reference", kv_head_dim: int | None = None,
                 aux_dtype: Any = jnp.float32, sharding: Sharding | None = None):
        """As `DraftModelProposer`; `target_embed`: the target's embedding (`params.embed`),
        used when the head has none (`load_eagle3` then gives `params.embed` None);
        `aux_dtype`: the dtype of the target step's aux output (the target's activations);
        `sharding`: replicated over the target's mesh (its tensor-parallel devices, or a
        data-parallel replica's): the head's params, pages and rounds, and the target
        step's aux output (`model_runner.forward_step`); None: the default device."""
        if k < 1:
            raise ValueError(f"num_speculative_tokens={k} must be at least 1")
        if params.embed is None and target_embed is None:
            raise ValueError("the EAGLE-3 head has no embed_tokens.weight: pass the target's "
                             "embedding as target_embed")
        self.cfg, self.params, self.k = cfg, place_inputs(params, sharding), k
        self.sharding = sharding
        self.target_embed = None if params.embed is not None else target_embed
        self.page_size, self.max_pages_per_seq = page_size, max_pages_per_seq
        self.buckets = tuple(sorted(buckets))
        self.attn_impl = attn_impl
        self.aux_dtype = aux_dtype
        self.kv_pages: KVPages = place_inputs(
            init_eagle3_kv(cfg, num_pages, page_size, kv_dtype, kv_head_dim), sharding)

    def pack(self, seqs: Sequence[DraftSeq], num_tokens: int) -> DraftRound:
        """Per-sequence rows (with their aux rows) -> numpy inputs in the token bucket
        `num_tokens`: the target step's (the aux output's rows)."""
        return pack_round(seqs, self.buckets, self.page_size, self.max_pages_per_seq,
                          eagle3=True, num_tokens=num_tokens)

    def propose(self, rnd: DraftRound, aux: jax.Array, chain: bool = True) -> jax.Array:
        """Run one round (queued): aux f[T, 3 * Ht] the target step's aux output on the
        device -> proposals i32[S, k] (target ids) on the device; the KV pages updated.
        `chain` False: the catch-up only (`eagle3_round`)."""
        if aux.shape[0] != rnd.token_ids.shape[0]:
            raise ValueError(f"aux has {aux.shape[0]} rows; the round was packed for the token "
                             f"bucket {rnd.token_ids.shape[0]}")
        proposals, self.kv_pages = eagle3_round_jit(
            self.params, self.kv_pages, place_inputs(rnd, self.sharding), aux, cfg=self.cfg,
            k=self.k,
            target_embed=self.target_embed, attn_impl=self.attn_impl,
            chain=np.bool_(chain))
        return proposals

    def warmup(self) -> None:
        """Compile the round of every bucket ahead of time, as `propose` calls it."""
        width = NUM_AUX * self.cfg.target_hidden_size
        for t, s in self.buckets:
            rnd = place_inputs(empty_round(t, s, self.max_pages_per_seq, eagle3=True),
                               self.sharding)
            aux = jax.ShapeDtypeStruct((t, width), self.aux_dtype, sharding=self.sharding)
            eagle3_round_jit.lower(self.params, self.kv_pages, rnd, aux, cfg=self.cfg,
                                   k=self.k, target_embed=self.target_embed,
                                   attn_impl=self.attn_impl, chain=np.bool_(True)).compile()
