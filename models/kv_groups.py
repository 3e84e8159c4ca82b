"""KV cache groups: which layers share a block table, and how their pages are laid out.

Plain Python (no jax): the engine's planner, allocator and batch builder read it as well as
the model's step (`models/paged.py`).

Why groups: a sliding-window layer only ever reads the last `window` tokens, so it needs only
the pages under its window; a full-attention (global) layer needs every page. Layers that
keep the same pages share one block table per sequence: a KV group is a set of layers of
the same window (None for global layers). The scheduler frees a sliding group's pages once
they slide out of the window (`engine/kv_manager.py`), so a sequence holds
ceil(window / page_size) + 1 of them however long it is.

Layout (vLLM's hybrid KV cache manager, not SGLang's separate SWA pool): every group has the
same number of layers, `slots`; the KV array is `[slots * num_pages, 2 * Hkv, page_size, D]`,
one run of `num_pages` pages per slot, and a page id names the same page in every slot. The
layer at slot s of group g reads page p of its sequence's group-g table at array page
`s * num_pages + p`. One pool of page ids serves every group, so its split between global and
sliding pages is never fixed in advance: short sequences use pages in every group alike
(as many bytes as without groups), long ones hold all their global pages and a window of
sliding ones. A separate pool per window would have to fix that split from max_model_len at
start-up and would run out of sliding pages on short prompts first.

Group size: `slots` = the smallest layer count of any window (vLLM's rule), each window's
layers cut into groups of that many in layer order (the last one padded: its empty slots
hold pages nobody reads, the waste the bytes figures count). Gemma 3 1B (22 sliding, 4
global layers): 4 slots, 6 sliding groups (2 slots padding) and 1 global group: 7 block
tables a step. A smaller group size wastes less but sends a block table per group each step.

A model whose layers all share one window (every Llama, Mistral's all-sliding layers) has no
`KVGroups` (None): one block table and one page per layer, the engine's path from before
groups existed, unchanged (Mistral then keeps its whole context, as before).
"""

from __future__ import annotations

import dataclasses

from .config import ModelConfig


@dataclasses.dataclass(frozen=True)
class KVGroups:
    """The model's KV groups; hashable, a static argument of the jitted step.

    Group 0 is always a global group, so a sequence's group-0 table (`Request.pages`) holds
    every page it computed, as without groups.
    """

    windows: tuple[int | None, ...]  # per group: its layers' window (None: global)
    layer_groups: tuple[int, ...]  # per layer: its group
    layer_slots: tuple[int, ...]  # per layer: its slot in [0, slots)
    slots: int  # layers per group: the KV array holds `slots` pages per page id

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def sliding(self) -> tuple[int, ...]:
        """The sliding groups' indices."""
        return tuple(g for g, w in enumerate(self.windows) if w is not None)

    def pages_per_seq(self, num_tokens: int, page_size: int) -> int:
        """Page ids one sequence of up to `num_tokens` tokens holds at most while it decodes,
        over all groups: what the planner sizes for (`group_pages`)."""
        return sum(group_pages(w, num_tokens, page_size) for w in self.windows)


def group_pages(window: int | None, num_tokens: int, page_size: int) -> int:
    """Pages of one group a decoding sequence of up to `num_tokens` tokens holds at most:
    all of them in a global group; in a sliding group the pages under the window of the
    token being computed, which spans at most ceil(window / page_size) + 1 pages (a prefill
    chunk holds more for one step: the chunk's own pages, freed once they slide out)."""
    full = -(-num_tokens // page_size)
    if window is None:
        return full
    return min(full, -(-window // page_size) + 1)


def first_live_page(window: int, num_tokens: int, page_size: int) -> int:
    """The first page a sliding group still needs once `num_tokens` tokens are computed:
    pages before it hold only keys older than the next query's window (the query at
    position `num_tokens` reads keys > num_tokens - window)."""
    return max(0, num_tokens - window + 1) // page_size


def kv_groups(cfg: ModelConfig) -> KVGroups | None:
    """The model's KV groups, or None when every layer has the same window (one group: the
    layout and block table of a model without groups).

    Layers that reuse an earlier layer's K/V (Gemma 4's `num_kv_shared_layers`,
    `LayerSpec.kv_reuse`) get no pages of their own: they take the storing layer's group and
    slot, so they read the very pages it wrote (and write the same K/V into them again, a
    no-op by value). Only the other layers are cut into groups."""
    specs = cfg.layer_specs
    windows = [s.sliding_window for s in specs]
    owners = [i for i, s in enumerate(specs) if s.kv_reuse is None]
    own_windows = [windows[i] for i in owners]
    if len(set(windows)) == 1 or None not in own_windows:
        # One window everywhere; or sliding layers of several windows with no global layer
        # (no model ships that; group 0 must be global): keep the plain layout.
        return None
    kinds = [None] + [w for w in dict.fromkeys(own_windows) if w is not None]
    layers_of = {k: [i for i in owners if windows[i] == k] for k in kinds}
    slots = min(len(v) for v in layers_of.values())
    group_windows: list[int | None] = []
    layer_groups = [0] * len(specs)
    layer_slots = [0] * len(specs)
    for k in kinds:
        layers = layers_of[k]
        for start in range(0, len(layers), slots):
            g = len(group_windows)
            group_windows.append(k)
            for s, i in enumerate(layers[start:start + slots]):
                layer_groups[i], layer_slots[i] = g, s
    store = {s.kv_store: i for i, s in enumerate(specs) if s.kv_store is not None}
    for i, spec in enumerate(specs):
        if spec.kv_reuse is not None:
            src = store.get(spec.kv_reuse)
            if src is None or src >= i or windows[src] != windows[i]:
                raise ValueError(f"layer {i} reuses K/V slot {spec.kv_reuse}, which no earlier "
                                 "layer of its window stores")
            layer_groups[i], layer_slots[i] = layer_groups[src], layer_slots[src]
    return KVGroups(tuple(group_windows), tuple(layer_groups), tuple(layer_slots), slots)


def kv_layer_slots(cfg: ModelConfig) -> int:
    """Pages the KV array holds per page id: the group size, or every layer without groups."""
    groups = kv_groups(cfg)
    return cfg.num_layers if groups is None else groups.slots
