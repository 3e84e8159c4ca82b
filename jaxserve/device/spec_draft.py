"""A proposal round's inputs, shared by the drafters (`spec_draft_model`, `spec_eagle3`).

Speculative decoding (issue 33) proposes k tokens per speculating sequence with one device
call per engine step, a "proposal round", after the target step's tokens are known:
  (a) catch-up: one ragged forward of the drafter over the rows whose drafter KV is not
      computed yet, prefill chunks and decodes end to end as in the target's step;
  (b) greedy chain: from each sequence's last catch-up row, argmax -> proposal 1, then k - 1
      single-row drafter steps (row j at the next position, its token proposal j), in one
      `lax.fori_loop` inside the same jitted function (k static).
Greedy drafts are point masses for the acceptance rule, so the target's distribution stays
exact whatever the drafter proposes.

Host -> device data flow: the engine lists, per speculating sequence, a `DraftSeq` (rows to
catch up: their tokens, the first row's position, the block table; EAGLE-3 also the target
step's aux row of each) -> `pack_round` (numpy, padded to a (tokens, seqs) bucket of the
engine's bucket list, `engine.batch.bucket_for`) -> `DraftRound` -> the drafter's jitted
round -> proposals i32[S, k] (target vocabulary ids) on the device, drafter KV updated in
place (donated).

Rows: catch-up row r of a sequence is at position `start + r`; the chain's row j (1 <= j < k)
is at position last + j (last: the sequence's last catch-up position) and writes its K/V
there. Its slot comes from the block table on the device (`chain_metadata`): page
`table[pos // page_size]`, offset `pos % page_size`. The drafter's KV pages are indexed by the
target's page ids (same block tables), so they are freed and preempted with the target's; the
host allocates the pages the chain writes before the round (the next verify step writes those
positions anyway). A chain position whose table entry is 0 (not allocated) or lies past the
table writes to the trash page: its proposal is then junk but harmless (verification rejects
what the target disagrees with). The chain's K/V at positions past the next catch-up's start
are stale but never read: attention reads only up to `kv_lens`, and the next round rewrites
from its start.

`truncated_draft(params, cfg, n)` -> (cfg, params): an honestly labelled draft made of a
model's first `n` layers (the issue's benchmark draft: the bundled model cut to its first
layers).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxserve.engine.batch import bucket_for
from jaxserve.kernels_pallas import AttentionMetadata
from jaxserve.models.config import ConfigError, ModelConfig
from jaxserve.models.kv_groups import kv_groups
from jaxserve.models.linear import PACKED_STACKS


@struct.dataclass
class DraftRound:
    """One round's device inputs; T catch-up rows, S sequences (a bucket), W table width."""

    token_ids: jax.Array  # i32[T] catch-up tokens of the live sequences end to end, then 0s
    positions: jax.Array  # i32[T] position of each catch-up row (padding: 0)
    md: AttentionMetadata  # slot_mapping i32[T], block_tables i32[S, W], kv_lens i32[S],
    #                        cu_q_lens i32[S + 1], num_seqs i32[1] (padding as batch.py's)
    last_rows: jax.Array  # i32[S] each sequence's last catch-up row (padding: 0)
    aux_rows: jax.Array  # i32[T] EAGLE-3: the target step's aux row of each catch-up row
    #                      (padding: 0); i32[0] for a draft model


@dataclasses.dataclass(frozen=True)
class DraftSeq:
    """One speculating sequence's catch-up rows, as the engine knows them.

    token_ids: a draft model: the tokens at positions start, start + 1, ... (the ones the
      target just computed or verified, then the newly sampled one); EAGLE-3: the token
      paired with each row, i.e. the token at position p + 1 for the row at p (vLLM's shift;
      the last one the newly sampled token).
    start: position of the first row (every row before it has valid drafter KV).
    block_table: the sequence's page ids (the target's), covering the chain's positions.
    aux_rows: EAGLE-3 only: for each row, its row in the target step's flat token axis
      (where the target's auxiliary hidden state of that position is).
    """

    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int]
    aux_rows: Sequence[int] = ()


def proposals_to_host(proposals: jax.Array | np.ndarray) -> np.ndarray:
    """A round's proposals i32[S, k] on the host. Over several processes the array is
    replicated on every device of the global mesh: this process's copy is read."""
    if isinstance(proposals, jax.Array) and not proposals.is_fully_addressable:
        return np.asarray(proposals.addressable_data(0))
    return np.asarray(proposals)


def round_buckets(buckets: Sequence[tuple[int, int]], k: int) -> tuple[tuple[int, int], ...]:
    """The engine's (tokens, seqs) buckets plus, for each of its seqs buckets s, s paired with
    every token bucket from s up to the first that holds s * (k + 1) rows (a decode round's
    most: k accepted proposals and the bonus token per sequence), sorted. Why: the engine
    pairs each token bucket with one seqs bucket (min(tokens, max_num_seqs)), so a round of
    one sequence catching up 6 tokens would run its k - 1 chain steps over 8 rows; the chain
    costs per sequence row, the catch-up per token row. More compiles at warmup, each a
    small model's."""
    tokens = sorted({t for t, _ in buckets})
    out = set(buckets)
    for s in sorted({s for _, s in buckets}):
        for t in tokens:
            if t >= s:
                out.add((t, s))
            if t >= s * (k + 1):
                break
    return tuple(sorted(out))


def pack_round(seqs: Sequence[DraftSeq], buckets: Sequence[tuple[int, int]], page_size: int,
               max_pages_per_seq: int, eagle3: bool = False,
               num_tokens: int | None = None) -> DraftRound:
    """The round's numpy inputs, padded to the smallest (tokens, seqs) bucket of `buckets`
    (sorted, as `BatchShape.buckets`) that holds them; `num_tokens`: that token bucket
    exactly (EAGLE-3 passes the target step's, whose aux output the rows index), with its
    smallest seqs bucket that holds the sequences. Refuses (ValueError) an empty row list, a table wider than
    `max_pages_per_seq` or not covering the rows, aux rows that do not match the tokens."""
    if not seqs:
        raise ValueError("a proposal round needs at least one sequence")
    n_rows = sum(len(s.token_ids) for s in seqs)
    if num_tokens is None:
        T, S = bucket_for(n_rows, len(seqs), buckets)
    else:
        T, S = num_tokens, min((s for t, s in buckets if t == num_tokens and s >= len(seqs)),
                               default=0)
        if S < len(seqs) or n_rows > T:
            raise ValueError(f"{n_rows} rows in {len(seqs)} sequences do not fit the token "
                             f"bucket {num_tokens} (buckets {list(buckets)})")
    i32 = np.int32
    token_ids, positions = np.zeros(T, i32), np.zeros(T, i32)
    slots, aux_rows = np.zeros(T, i32), np.zeros(T if eagle3 else 0, i32)
    tables = np.zeros((S, max_pages_per_seq), i32)
    kv_lens, cu = np.zeros(S, i32), np.zeros(S + 1, i32)
    last_rows = np.zeros(S, i32)
    off = 0
    for i, s in enumerate(seqs):
        n = len(s.token_ids)
        if n == 0:
            raise ValueError(f"sequence {i} of the round has no row to catch up (the newly "
                             "sampled token is always one)")
        table = np.asarray(s.block_table, i32)
        if len(table) > max_pages_per_seq or -(-(s.start + n) // page_size) > len(table):
            raise ValueError(f"sequence {i}: block table of {len(table)} pages (at most "
                             f"{max_pages_per_seq}) does not cover positions up to "
                             f"{s.start + n - 1} at page size {page_size}")
        pos = np.arange(s.start, s.start + n, dtype=i32)
        token_ids[off:off + n] = s.token_ids
        positions[off:off + n] = pos
        slots[off:off + n] = table[pos // page_size] * page_size + pos % page_size
        if eagle3:
            if len(s.aux_rows) != n:
                raise ValueError(f"sequence {i}: {len(s.aux_rows)} aux rows for {n} tokens")
            aux_rows[off:off + n] = s.aux_rows
        elif len(s.aux_rows):
            raise ValueError("aux_rows are for an EAGLE-3 round; a draft model reads none")
        tables[i, :len(table)] = table
        kv_lens[i] = s.start + n
        off += n
        cu[i + 1] = off
        last_rows[i] = off - 1
    cu[len(seqs) + 1:] = T  # padding rows belong to no live sequence, as batch.py pads
    md = AttentionMetadata(slot_mapping=slots, block_tables=tables, kv_lens=kv_lens,
                           cu_q_lens=cu, num_seqs=np.array([len(seqs)], i32))
    return DraftRound(token_ids=token_ids, positions=positions, md=md, last_rows=last_rows,
                      aux_rows=aux_rows)


def empty_round(T: int, S: int, max_pages_per_seq: int, eagle3: bool = False) -> DraftRound:
    """An all-padding round of one bucket (what warmup compiles with)."""
    i32 = np.int32
    md = AttentionMetadata(slot_mapping=np.zeros(T, i32),
                           block_tables=np.zeros((S, max_pages_per_seq), i32),
                           kv_lens=np.zeros(S, i32), cu_q_lens=np.zeros(S + 1, i32),
                           num_seqs=np.zeros(1, i32))
    return DraftRound(token_ids=np.zeros(T, i32), positions=np.zeros(T, i32), md=md,
                      last_rows=np.zeros(S, i32), aux_rows=np.zeros(T if eagle3 else 0, i32))


def chain_step_metadata(md: AttentionMetadata, positions: jax.Array, live: jax.Array,
                        page_size: int) -> AttentionMetadata:
    """Metadata of one chain step: one row per sequence (S rows) at `positions` i32[S], slots
    from the catch-up's block tables; padding sequences, and positions past the table, write
    to the trash page 0; reads never go past the table."""
    S, W = md.block_tables.shape
    idx = positions // page_size
    page = jnp.take_along_axis(md.block_tables, jnp.minimum(idx, W - 1)[:, None], axis=1)[:, 0]
    page = jnp.where(live & (idx < W), page, 0)
    rows = jnp.arange(S + 1, dtype=jnp.int32)
    return AttentionMetadata(
        slot_mapping=page * page_size + positions % page_size,
        block_tables=md.block_tables,
        kv_lens=jnp.where(live, jnp.minimum(positions + 1, W * page_size), 0),
        cu_q_lens=jnp.where(rows <= md.num_seqs[0], rows, S), num_seqs=md.num_seqs)


def check_draft_config(draft: ModelConfig, target: ModelConfig | None) -> None:
    """Refuse (ConfigError) a draft model this round cannot run beside `target`."""
    if target is not None and draft.vocab_size != target.vocab_size:
        raise ConfigError(f"speculative draft model: vocab_size={draft.vocab_size} differs from "
                          f"the target's {target.vocab_size} (the draft must share the "
                          "target's tokenizer and vocabulary)")
    if kv_groups(draft) is not None or draft.kv_share_slots or draft.per_layer_input_size:
        raise ConfigError(f"speculative draft model {draft.model_type!r}: layers with KV groups "
                          "(sliding-window), shared K/V or per-layer inputs are not supported "
                          "as a draft")


def truncated_draft(params: Any, cfg: ModelConfig, num_layers: int
                    ) -> tuple[ModelConfig, Any]:
    """(cfg, params) of the model cut to its first `num_layers` layers: the same embedding,
    final norm and head, the layer stacks sliced (a labelled truncated copy, not a trained
    draft). Packed (CPU-repacked) layer weights are refused: slice before packing."""
    if not 0 < num_layers <= cfg.num_layers:
        raise ValueError(f"num_layers={num_layers} must be in [1, {cfg.num_layers}]")
    layers = params.layers
    for f in dataclasses.fields(layers):
        if isinstance(getattr(layers, f.name), PACKED_STACKS):
            raise ValueError(f"layer weight {f.name!r} is packed; truncate the unpacked params")
    sliced = jax.tree.map(lambda a: a[:num_layers], layers)
    per_layer = cfg.per_layer[:num_layers] if cfg.per_layer else ()
    return (dataclasses.replace(cfg, num_layers=num_layers, per_layer=per_layer),
            params.replace(layers=sliced))
