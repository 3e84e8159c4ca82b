"""Sliding-window-aware KV on the host: KV groups, freed window pages, cut-back prefix hits.

The scheduler runs a model of global and sliding-window layers (`models/kv_groups.py`) on a
fake runner that stores each token in the page and offset its group's slot mapping names
and reads back, for every query, exactly the keys its group's attention would read: all
earlier positions in a global group, the last `window` in a sliding one, each through that
group's block table. A page freed too early, a table entry left pointing at a reused page or
a prefix hit served without its window pages shows up as a wrong history; the outputs are
then checked against a rollout of the arithmetic "model" on the true token sequence.
No jax.
"""

from __future__ import annotations

import random

import pytest

from jaxserve.config import EngineConfig, SchedulerConfig
from jaxserve.engine.block_allocator import TRASH_PAGE
from jaxserve.engine.sequence import FinishReason, Sequence
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.scheduler import Scheduler, SchedulerOutput
from jaxserve.engine.sizing import plan_engine
from jaxserve.models.config import LayerSpec, ModelConfig
from jaxserve.models.kv_groups import KVGroups, first_live_page, kv_groups

VOCAB = 1000
EOS = 999


def model_config(pattern: tuple[int | None, ...], num_kv_heads: int = 1, head_dim: int = 256,
                 max_pos: int = 32768) -> ModelConfig:
    """A config whose layer i has window pattern[i] (None: global); only the KV shape and
    the windows matter here."""
    return ModelConfig(model_type="gemma3_text", vocab_size=VOCAB, hidden_size=64,
                       intermediate_size=64, num_layers=len(pattern), num_heads=num_kv_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, rms_norm_eps=1e-6,
                       rope_theta=1e4, max_position_embeddings=max_pos,
                       tie_word_embeddings=True, attention_bias=False, qk_norm=True,
                       per_layer=tuple(LayerSpec(sliding_window=w) for w in pattern))


def gemma3_pattern(num_layers: int, window: int) -> tuple[int | None, ...]:
    """Gemma 3's layer pattern: five sliding-window layers, then a global one."""
    return tuple(None if (i + 1) % 6 == 0 else window for i in range(num_layers))


# ------------------------------------------------------------------------------- groups
def test_groups_of_a_gemma3_1b_shape():
    groups = kv_groups(model_config(gemma3_pattern(26, 512)))
    assert groups is not None
    # 22 sliding, 4 global layers: groups of 4 slots, global group first.
    assert groups.slots == 4
    assert groups.windows == (None,) + (512,) * 6
    assert sorted(zip(groups.layer_groups, groups.layer_slots)) == sorted(
        set(zip(groups.layer_groups, groups.layer_slots)))  # no two layers share a slot
    for i, (g, s) in enumerate(zip(groups.layer_groups, groups.layer_slots)):
        assert groups.windows[g] == gemma3_pattern(26, 512)[i] and 0 <= s < 4
    # 8k tokens, pages of 16: 512 global pages, 33 per sliding group.
    assert groups.pages_per_seq(8192, 16) == 512 + 6 * 33


def test_one_window_everywhere_has_no_groups():
    assert kv_groups(model_config((None,) * 4)) is None
    assert kv_groups(model_config((8,) * 4)) is None  # Mistral-style: today's path


def test_planner_fits_more_long_sequences_with_window_pages():
    """The same KV budget holds ~4.7x the 8k sequences of a Gemma-3-1B-shaped model."""
    budget = 8 << 30
    cfg = EngineConfig(max_model_len=8192, page_size=16, max_num_seqs=256,
                       max_num_batched_tokens=2048, kv_cache_memory=budget)
    grouped = plan_engine(cfg, model_config(gemma3_pattern(26, 512)), 2, 0)
    plain = plan_engine(cfg, model_config((None,) * 26), 2, 0)
    per_layer_page = 16 * 2 * 1 * 256 * 2
    assert plain.kv_bytes_per_seq == 26 * 512 * per_layer_page
    assert grouped.kv_bytes_per_seq == 4 * (512 + 6 * 33) * per_layer_page
    fits = budget // grouped.kv_bytes_per_seq, budget // plain.kv_bytes_per_seq
    assert fits[0] >= 4 * fits[1]
    assert grouped.scheduler.kv_groups is not None and plain.scheduler.kv_groups is None


# ------------------------------------------------------------------------------- scheduler
def expected_next(tokens: list[int]) -> int:
    return (sum(tokens) * 31 + len(tokens)) % (VOCAB - 1)  # never EOS


def rollout(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(expected_next(seq))
    return seq[len(prompt):]


def make_req(rid: str, prompt: list[int], max_tokens: int, priority: int = 0,
             sample_index: int = 0) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Sequence(rid, list(prompt), params, eos_token_ids=(EOS,), arrival_time=0.0,
                   priority=priority, max_tokens=max_tokens, sample_index=sample_index)


class WindowKVRunner:
    """Writes each new token into its slot in every group, then reads each query's keys
    as that group's attention would: all of them (global) or the last `window`."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.kv: dict[tuple[int, int], tuple[int, int]] = {}  # (page, offset) -> (tok, pos)
        self.max_live: dict[int, int] = {}  # sliding group -> most pages a seq held

    def run(self, out: SchedulerOutput) -> list[int | None]:
        ps = self.sched.cfg.page_size
        windows = self.sched.cfg.kv_windows
        sampled: list[int | None] = []
        for s in out.seqs:
            req = s.sequence
            tables = self.sched.kv.tables(req)
            end = s.start + s.num_new_tokens
            for table in tables:
                assert len(table) * ps >= end, "pages missing for scheduled tokens"
                for pos in range(s.start, end):
                    page = table[pos // ps]
                    assert page != TRASH_PAGE, "a new token's slot is the trash page"
                    self.kv[(page, pos % ps)] = (req.all_token_ids[pos], pos)
            for q in range(s.start, end):
                for table, w in zip(tables, windows):
                    lo = 0 if w is None else max(0, q - w + 1)
                    got = [self.kv.get((table[p // ps], p % ps)) for p in range(lo, q + 1)]
                    want = [(req.all_token_ids[p], p) for p in range(lo, q + 1)]
                    assert got == want, f"{req.request_id}: group of window {w} at query {q}"
            sampled.append(expected_next(req.all_token_ids[:end]) if s.samples else None)
        return sampled

    def check_bounds(self) -> None:
        """Between steps every running sequence holds at most ceil(w / ps) + 1 pages in each
        sliding group."""
        ps = self.sched.cfg.page_size
        for req in self.sched.running:
            for g, w in enumerate(self.sched.cfg.kv_windows):
                if w is None:
                    continue
                live = self.sched.kv.num_live_pages(req, g)
                self.max_live[g] = max(self.max_live.get(g, 0), live)
                assert live <= -(-w // ps) + 1, (req.request_id, g, live)


def drive(sched: Scheduler, runner: WindowKVRunner, max_steps: int = 20_000) -> int:
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, runner.run(out))
        runner.check_bounds()
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return steps


def sched_config(pattern: tuple[int | None, ...], **kw: object) -> SchedulerConfig:
    base = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=512, page_size=4,
                num_pages=200, enable_prefix_caching=True,
                kv_groups=kv_groups(model_config(pattern)))
    base.update(kw)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


PATTERNS = {
    "gemma3-like": (6, 6, 6, 6, 6, None),       # one global group, sliding groups of 1 slot
    "two-windows": (4, None, 8, 4, None, 8),    # two windows, slots of 2
    "window-5": (5, None, 5, None),             # a window that is no multiple of the page
}


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("budget,num_pages,caching", [
    (16, 400, True),   # chunked prefill, prefix hits
    (64, 400, False),  # chunks longer than the windows
    (8, 60, True),     # tight: preemptions, hits on recompute
])
def test_window_kv_random_workload(pattern, budget, num_pages, caching):
    rng = random.Random(budget * 31 + num_pages + len(pattern))
    cfg = sched_config(PATTERNS[pattern], max_num_batched_tokens=budget, num_pages=num_pages,
                       enable_prefix_caching=caching)
    sched = Scheduler(cfg)
    runner = WindowKVRunner(sched)
    shared = [rng.randrange(VOCAB - 1) for _ in range(30)]  # ~5 windows shared
    reqs = []
    for i in range(16):
        prompt = (shared if i % 2 == 0 else []) + [
            rng.randrange(VOCAB - 1) for _ in range(rng.randint(20, 60))]
        r = make_req(f"r{i}", prompt, max_tokens=rng.randint(1, 30),
                     priority=rng.choice([0, 1]))
        reqs.append(r)
        sched.add_request(r)
    drive(sched, runner)
    for r in reqs:
        assert r.finish_reason is FinishReason.LENGTH
        assert r.output_token_ids == rollout(r.prompt_token_ids, r.max_tokens), r.request_id
    assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages  # no leaks
    # The bound was reached, not vacuous: long sequences filled their windows.
    assert runner.max_live and all(v >= 2 for v in runner.max_live.values())
    if caching:
        assert sched.allocator.prefix_hits > 0
    if num_pages <= 80:
        assert sched.num_preemptions > 0


def test_aborts_and_finishes_leave_no_page_behind():
    sched = Scheduler(sched_config(PATTERNS["gemma3-like"]))
    runner = WindowKVRunner(sched)
    reqs = [make_req(f"r{i}", list(range(i, i + 40)), max_tokens=20) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(6):  # mid-prefill and mid-decode
        out = sched.schedule()
        sched.update(out, runner.run(out))
    sched.abort([reqs[0].seq_id, reqs[2].seq_id])
    drive(sched, runner)
    assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages
    assert reqs[1].output_token_ids == rollout(reqs[1].prompt_token_ids, 20)


def _evict_oldest_cached(sched: Scheduler, n: int) -> None:
    """Allocate (then free) every truly free page and `n` more: the allocator evicts the `n`
    least recently freed cached pages, which are the pages that slid out first."""
    alloc = sched.allocator
    pages = alloc.allocate(alloc.num_free_pages - len(alloc._evictable) + n)
    alloc.free(pages)


@pytest.mark.parametrize("evict", ["none", "slid", "all"])
def test_prefix_hit_needs_the_window_pages(evict):
    """A finished sequence's prefix is matched again. With its window pages still cached
    the hit is served whole. Once the pages that slid out of the windows are evicted (they
    were freed first; the global pages, freed at the finish, are still cached), the global
    group alone could serve the whole prefix but the sliding groups cannot: the hit is cut
    back (to 0 here) and counted. With every page evicted there is no hit at all. The
    output is the rollout's every time."""
    pattern = PATTERNS["gemma3-like"]  # window 6, five sliding groups, pages of 4
    sched = Scheduler(sched_config(pattern, num_pages=400))
    runner = WindowKVRunner(sched)
    prefix = list(range(100, 160))  # 60 tokens: 10 windows
    first = make_req("first", prefix, max_tokens=12)  # its window slides past the prompt
    sched.add_request(first)
    drive(sched, runner)
    # 71 tokens computed: pages 0..15 of each sliding group slid out (first_live_page).
    slid = 5 * first_live_page(6, 71, 4)
    assert slid == 80
    _evict_oldest_cached(sched, {"none": 0, "slid": slid,
                                 "all": len(sched.allocator._evictable)}[evict])
    again = make_req("again", prefix + [7, 8, 9], max_tokens=5)
    sched.add_request(again)
    out = sched.schedule()
    hit = again.metrics.num_cached_tokens
    sched.update(out, runner.run(out))
    drive(sched, runner)
    assert again.output_token_ids == rollout(again.prompt_token_ids, 5)
    full = 60  # 15 full pages before the prompt's last token
    if evict == "none":
        assert hit == full and sched.kv.window_cut_pages == 0
    elif evict == "slid":
        assert hit == 0 and sched.kv.window_cut_pages == 15
    else:
        assert hit == 0 and sched.kv.window_cut_pages == 0
    # Hit rate as the engine reports it: served pages over queried pages.
    assert sched.allocator.prefix_hits == (15 if evict == "none" else 0)
    assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages


def test_fork_shares_only_when_the_parent_still_holds_the_window():
    """n > 1 samples: children share the parent's prompt pages when its sliding groups
    still hold the window before the shared prefix's end, else compute it themselves;
    either way every output is the rollout's."""
    sched = Scheduler(sched_config(PATTERNS["gemma3-like"], max_num_batched_tokens=64,
                                   enable_prefix_caching=False))
    runner = WindowKVRunner(sched)
    prompt = list(range(200, 243))  # 43 tokens, one chunk: the window is still held
    parent = make_req("p", prompt, max_tokens=6)
    kids = [make_req("p", prompt, max_tokens=6, sample_index=i) for i in (1, 2)]
    sched.add_request(parent)
    for k in kids:
        sched.add_request(k, fork_of=parent)
    drive(sched, runner)
    for r in [parent, *kids]:
        assert r.output_token_ids == rollout(prompt, 6)
    assert all(k.metrics.num_cached_tokens == 40 for k in kids)  # 10 shared pages
    assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages


def test_group_tables_keep_their_width_with_trash_below_the_window():
    sched = Scheduler(sched_config(PATTERNS["gemma3-like"]))
    runner = WindowKVRunner(sched)
    r = make_req("r", list(range(50)), max_tokens=3)
    sched.add_request(r)
    while r.num_computed_tokens < 50:
        out = sched.schedule()
        sched.update(out, runner.run(out))
    tables = sched.kv.tables(r)
    assert len(tables) == 6 and all(len(t) == len(tables[0]) for t in tables)
    assert TRASH_PAGE not in tables[0]
    for t in tables[1:]:  # window 6, pages of 4: the next query (50) reads 45..49
        assert t[:11] == [TRASH_PAGE] * 11 and TRASH_PAGE not in t[11:]
    sched.abort([r.seq_id])
    assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages


def test_groups_planner_sizing_fields():
    groups = kv_groups(model_config(PATTERNS["two-windows"]))
    assert isinstance(groups, KVGroups) and groups.slots == 2
    assert groups.windows == (None, 4, 8)
