"""The `draft_model` drafter: a small model of a served family proposes k tokens greedily.

Data flow of one proposal round (`draft_model_round`, jitted once per (tokens, seqs) bucket,
k static, the drafter's KV donated): `DraftRound` (spec_draft.py) -> catch-up:
`paged.paged_hidden` of the draft model over the round's rows through its own KV pages (the
target's page ids) -> `lm_logits` at each sequence's last row -> argmax: proposal 1 -> chain
(`lax.fori_loop`, k - 1 steps): proposal j as one row per sequence at the next position
(slots from the block tables on the device), `paged_hidden` + `lm_logits` + argmax ->
proposal j + 1 -> (proposals i32[S, k], updated KV). Padding sequences' rows are 0.

`DraftModelProposer` holds the draft's params and KV pages (one run of `num_pages` per layer,
`paged.init_kv_cache`: the target's page count, so the same page ids), compiles every bucket
up front (`warmup`) and runs rounds (`propose`); the engine packs a round with
`pack_round` (numpy, from per-sequence `DraftSeq`s). The draft is not split: under a
tensor-parallel target it runs replicated over the target's mesh (`sharding`).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Sharding

from jaxserve.device.model_runner import place_inputs
from jaxserve.device.spec_draft import (DraftRound, DraftSeq, check_draft_config,
                                        chain_step_metadata, empty_round, pack_round)
from jaxserve.kernels_pallas import KVPages
from jaxserve.models.blocks import lm_logits
from jaxserve.models.config import ModelConfig
from jaxserve.models.paged import init_kv_cache, paged_hidden


def _greedy(logits: jax.Array) -> jax.Array:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def draft_model_round(params: Any, kv_pages: KVPages, rnd: DraftRound, cfg: ModelConfig,
                      k: int, attn_impl: str = "reference") -> tuple[jax.Array, KVPages]:
    """-> (proposals i32[S, k], updated kv_pages). Pure; jit with cfg, k, attn_impl static."""
    page_size = kv_pages.shape[2]
    S = rnd.last_rows.shape[0]
    live = jnp.arange(S) < rnd.md.num_seqs[0]
    hidden, kv_pages = paged_hidden(params, kv_pages, rnd.token_ids, rnd.positions, rnd.md,
                                    cfg, attn_impl)
    first = _greedy(lm_logits(cfg, params, hidden[rnd.last_rows]))
    proposals = jnp.zeros((S, k), jnp.int32).at[:, 0].set(first)
    pos0 = rnd.positions[rnd.last_rows] + 1  # the chain's first row: proposal 1's position

    def chain(j: jax.Array, carry: tuple[jax.Array, KVPages]) -> tuple[jax.Array, KVPages]:
        proposals, kv = carry
        pos = pos0 + j - 1
        md = chain_step_metadata(rnd.md, pos, live, page_size)
        token = jax.lax.dynamic_index_in_dim(proposals, j - 1, axis=1, keepdims=False)
        h, kv = paged_hidden(params, kv, token, pos, md, cfg, attn_impl)
        nxt = _greedy(lm_logits(cfg, params, h))
        return jax.lax.dynamic_update_index_in_dim(proposals, nxt, j, axis=1), kv

    proposals, kv_pages = jax.lax.fori_loop(1, k, chain, (proposals, kv_pages))
    return jnp.where(live[:, None], proposals, 0), kv_pages


draft_model_round_jit = jax.jit(draft_model_round, static_argnames=("cfg", "k", "attn_impl"),
                                donate_argnames=("kv_pages",))


class DraftModelProposer:
    """A draft model's params and KV pages, and its compiled proposal rounds."""

    def __init__(self, cfg: ModelConfig, params: Any, num_pages: int, page_size: int,
                 kv_dtype: Any, k: int, buckets: Sequence[tuple[int, int]],
                 max_pages_per_seq: int, attn_impl: str = "reference",
                 target_cfg: ModelConfig | None = None, kv_head_dim: int | None = None,
                 sharding: Sharding | None = None):
        """`num_pages`, `page_size`, `max_pages_per_seq`, `buckets`: the target runner's
        (`BatchShape`); `k`: num_speculative_tokens; `kv_head_dim`: the attention
        implementation's page head dim (`selector.page_head_dim`), None: the model's;
        `sharding`: replicated over the target's mesh (its tensor-parallel devices, or a
        data-parallel replica's: every device runs the whole draft); None: the default
        device."""
        if k < 1:
            raise ValueError(f"num_speculative_tokens={k} must be at least 1")
        check_draft_config(cfg, target_cfg)
        self.cfg, self.params, self.k = cfg, place_inputs(params, sharding), k
        self.sharding = sharding
        self.page_size, self.max_pages_per_seq = page_size, max_pages_per_seq
        self.buckets = tuple(sorted(buckets))
        self.attn_impl = attn_impl
        self.kv_pages: KVPages = place_inputs(
            init_kv_cache(cfg, num_pages, page_size, kv_dtype, kv_head_dim), sharding)

    def pack(self, seqs: Sequence[DraftSeq]) -> DraftRound:
        """Per-sequence catch-up rows -> the round's numpy inputs (smallest bucket)."""
        return pack_round(seqs, self.buckets, self.page_size, self.max_pages_per_seq)

    def propose(self, rnd: DraftRound) -> jax.Array:
        """Run one round (queued, not waited for): -> proposals i32[S, k] on the device (row
        i: the i-th sequence packed); the KV pages are updated."""
        proposals, self.kv_pages = draft_model_round_jit(
            self.params, self.kv_pages, place_inputs(rnd, self.sharding), cfg=self.cfg,
            k=self.k,
            attn_impl=self.attn_impl)
        return proposals

    def warmup(self) -> None:
        """Compile the round of every bucket (ahead of time, without running), with the
        arguments `propose` passes, so that serving compiles nothing."""
        for t, s in self.buckets:
            rnd = place_inputs(empty_round(t, s, self.max_pages_per_seq), self.sharding)
            draft_model_round_jit.lower(self.params, self.kv_pages, rnd, cfg=self.cfg,
                                        k=self.k, attn_impl=self.attn_impl).compile()
