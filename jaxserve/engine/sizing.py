"""Derive the engine's sizes from its config, the model and the device: pages, buckets, shapes.

Plain Python. `plan_engine` is a pure function of its inputs (the caller measures free memory
and passes it in), so every derived size is a return value that tests can check.

KV budget: `kv_cache_memory` bytes if given; else `kv_cache_memory_fraction` of the free
device memory after the weights (on a CPU host, of the available RAM), never more than
`max_num_seqs` sequences of `max_model_len` tokens need. Pages = budget // bytes per page,
plus the trash page 0. With a draft model (speculative decoding) a page id also holds the
draft's page of every draft layer, so bytes per page add the draft's. Bytes per page count the page dtype's values and, for a quantized
cache, the scales beside them (`kv_scale_bytes` per token, KV head and K-or-V: 4 for int8 /
fp8 pages' f32 scales), so the same budget holds ~2x the tokens of bfloat16 at head dim 64.

KV groups (`models/kv_groups.py`, models with sliding-window and global layers): a page id
holds one page in each of the group size's layer slots (not in every layer), and a sequence
of max_model_len tokens holds all its pages in each global group but only ~window / page_size
in each sliding group, so the same budget holds several times the long sequences
(`EnginePlan.kv_bytes_per_seq`; scripts/bench/bench_window_kv.py measures it).
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from jaxserve.config import EngineConfig, SchedulerConfig
from jaxserve.engine.batch import BatchShape, default_token_buckets
from jaxserve.models.config import ModelConfig
from jaxserve.models.kv_groups import kv_groups

if TYPE_CHECKING:
    import jax

DEFAULT_MAX_MODEL_LEN_CAP = 4096


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    scheduler: SchedulerConfig
    batch_shape: BatchShape
    kv_bytes_per_page: int
    kv_budget_bytes: int
    # KV bytes one sequence of max_model_len tokens holds at most (all its pages, over every
    # KV group: a sliding group's window only).
    kv_bytes_per_seq: int = 0
    # Speculative decoding: steps with this many running sequences or more do not speculate
    # (`speculative_max_running`); 0 without a speculative_config.
    speculative_max_running: int = 0


# Speculative decoding's default back-off (no disable_by_batch_size given): a step stops
# speculating once its running sequences' verification queries, (k + 1) tokens each, would
# exceed this many tokens. At small steps the cost on the 2-core CPU fits
# cpu ms = 15.9 + 1.94 T + 0.33 S (bundled model; scripts/bench/bench_buckets.py --sections
# cost --cost-tokens 1,2,4,8: benchmarks/results/spec_verify_step_cost.json): the fixed part
# is worth only ~8 tokens, so a verifying step of several sequences soon costs more than the
# decode it replaces. Measured (scripts/bench/bench_spec.sh, k = 3, docs/serving/
# speculative.md): concurrency 1 gains 1.2-1.5x, concurrency 8 loses up to a fifth on
# open-ended text; 16 tokens keeps speculation to <= 4 running sequences at k = 3.
SPEC_WEIGHT_BOUND_TOKENS = 16
# Accelerators (GPU, TPU; not measured here, a roofline estimate): a bf16 step reads each
# weight's 2 bytes once and spends 2 FLOPs per token on it, so it stays weight-bound while
# its tokens are fewer than the chip's peak FLOP/s per HBM byte/s: ~206 on an H200, ~295 on
# an H100, ~240 on a TPU v5e, ~560 on a v6e (`jaxserve.cli.bench.perf_model`'s chips). Half
# the smallest leaves room for the attention and KV reads that grow with the batch.
SPEC_WEIGHT_BOUND_TOKENS_ACCELERATOR = 96


def speculative_max_running(k: int, disable_by_batch_size: int | None,
                            platform: str = "cpu") -> int:
    """Running sequences at which a step stops speculating: the user's
    disable_by_batch_size, else the most whose k + 1 token queries fit the weight-bound
    region of the `platform` (jax's name: SPEC_WEIGHT_BOUND_TOKENS on "cpu",
    SPEC_WEIGHT_BOUND_TOKENS_ACCELERATOR elsewhere), at least 2 (one sequence always may)."""
    if disable_by_batch_size is not None:
        return disable_by_batch_size
    bound = SPEC_WEIGHT_BOUND_TOKENS if platform == "cpu" else \
        SPEC_WEIGHT_BOUND_TOKENS_ACCELERATOR
    return max(2, bound // (k + 1) + 1)


def free_device_memory(device: "jax.Device") -> int | None:
    """Bytes the device can still allocate, or None when it does not say (CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def available_host_memory() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 4 << 30


def kv_bytes_per_token(model: ModelConfig, kv_itemsize: int, kv_head_dim: int | None = None,
                       kv_scale_bytes: int = 0, num_layers: int | None = None) -> int:
    """KV bytes one token takes over all layers (or `num_layers` of them: a page id's layer
    slots with KV groups): K and V of every KV head, values + scales."""
    head_dim = kv_head_dim or model.head_dim
    layers = model.num_layers if num_layers is None else num_layers
    return layers * 2 * model.num_kv_heads * (head_dim * kv_itemsize + kv_scale_bytes)


def plan_engine(cfg: EngineConfig, model: ModelConfig, kv_itemsize: int,
                free_memory: int, kv_head_dim: int | None = None,
                kv_scale_bytes: int = 0, draft: ModelConfig | None = None,
                draft_kv_head_dim: int | None = None, platform: str = "cpu",
                fixed_shapes: bool = False) -> EnginePlan:
    """`draft`: a draft model's config (speculative method draft_model): its KV pages are
    indexed by the target's page ids, so every page costs the draft's bytes too.
    `platform`: the devices' (jax's name), for speculation's default back-off.
    `fixed_shapes` (batch-invariant mode over kernels whose rows are not invariant): one
    (max_num_batched_tokens, sampler rows) bucket, so every step's XLA dots and reductions
    have the one shape; token_buckets / seq_buckets given with more is a ValueError."""
    max_model_len = cfg.max_model_len or min(model.max_position_embeddings,
                                             DEFAULT_MAX_MODEL_LEN_CAP)
    if max_model_len > model.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                         f"max_position_embeddings={model.max_position_embeddings}")
    ps = cfg.page_size
    groups = kv_groups(model)
    pages_per_seq = -(-max_model_len // ps)  # a block table's width
    if groups is None:
        per_page = ps * kv_bytes_per_token(model, kv_itemsize, kv_head_dim, kv_scale_bytes)
        held_per_seq = pages_per_seq
        wanted = cfg.max_num_seqs * pages_per_seq
    else:
        per_page = ps * kv_bytes_per_token(model, kv_itemsize, kv_head_dim, kv_scale_bytes,
                                           groups.slots)
        held_per_seq = groups.pages_per_seq(max_model_len, ps)
        # Plus one step's prefill chunks, which each sliding group holds until they slide out.
        wanted = cfg.max_num_seqs * held_per_seq + len(groups.sliding) * (
            -(-cfg.max_num_batched_tokens // ps) + cfg.max_num_seqs)
    if draft is not None:  # one page of each of the draft's layers per page id
        per_page += ps * kv_bytes_per_token(draft, kv_itemsize, draft_kv_head_dim,
                                            kv_scale_bytes)
    if cfg.kv_cache_memory is not None:
        budget = cfg.kv_cache_memory
    else:
        budget = min(int(free_memory * cfg.kv_cache_memory_fraction), wanted * per_page)
    usable = budget // per_page
    if usable < 1:
        raise ValueError(
            f"the KV cache budget of {budget} bytes holds no page of {per_page} bytes; "
            "raise kv_cache_memory (or kv_cache_memory_fraction)")
    decode_budget = None if cfg.decode_token_budget is None else min(
        max(cfg.decode_token_budget, cfg.max_num_seqs), cfg.max_num_batched_tokens)
    sched = SchedulerConfig(max_num_seqs=cfg.max_num_seqs,
                            max_num_batched_tokens=cfg.max_num_batched_tokens,
                            decode_token_budget=decode_budget,
                            max_model_len=max_model_len, page_size=ps, num_pages=usable + 1,
                            enable_prefix_caching=cfg.enable_prefix_caching,
                            kv_groups=groups, ttft_slo=cfg.ttft_slo, itl_slo=cfg.itl_slo,
                            slo_admission=cfg.slo_admission,
                            scheduling_policy=cfg.scheduling_policy)
    # Token buckets: 1, 2, 4, 8, multiples of 8 to 64, then 4 per octave
    # (`batch.default_token_buckets`, where the measurements behind it are). The smallest is
    # 1: a lone stream pays for no padding rows (bundled model, 2-core CPU, decode step of
    # 1 sequence at context 256: 75-117 ms with the smallest bucket at 16, 31.8 ms at 1).
    if fixed_shapes:
        for name in ("token_buckets", "seq_buckets"):
            if getattr(cfg, name) is not None and len(getattr(cfg, name)) > 1:
                raise ValueError(f"{name}={getattr(cfg, name)!r}: batch_invariant=True on "
                                 "this step (not the CPU attention and C++ dense kernels) "
                                 "runs one fixed step shape; give one bucket or none")
    token_buckets = cfg.token_buckets or default_token_buckets(cfg.max_num_batched_tokens)
    if fixed_shapes:
        token_buckets = token_buckets[-1:]
    if token_buckets[-1] < cfg.max_num_batched_tokens:
        raise ValueError(f"token_buckets end at {token_buckets[-1]} < max_num_batched_tokens="
                         f"{cfg.max_num_batched_tokens}")
    # Sampler rows a step may need: one per sequence, k + 1 per speculating one (each
    # verified position samples). A step speculates only below max_running running
    # sequences, so its rows before admission are at most (max_running - 1)(k + 1), and the
    # scheduler admits new sequences only while the rows stay within `rows`: with the
    # default back-off that is max_num_seqs itself, and steps that do not speculate keep
    # the seqs buckets they have without speculation.
    spec = cfg.speculative_config
    max_running = 0 if spec is None else speculative_max_running(
        spec.num_speculative_tokens, spec.disable_by_batch_size, platform)
    rows = cfg.max_num_seqs if spec is None else max(cfg.max_num_seqs, (
        spec.num_speculative_tokens + 1) * min(max_running - 1, cfg.max_num_seqs))
    sched = dataclasses.replace(sched, max_num_rows=rows)
    if fixed_shapes and cfg.seq_buckets is None:
        pairs = [(token_buckets[0], min(token_buckets[0], rows))]  # one shape for every step
    elif cfg.seq_buckets is None:
        pairs = sorted({(t, min(t, rows)) for t in token_buckets})
    else:
        if cfg.seq_buckets[-1] < rows:
            raise ValueError(f"seq_buckets end at {cfg.seq_buckets[-1]} < max_num_seqs="
                             f"{cfg.max_num_seqs}" + ("" if spec is None else
                             f" plus k sampler rows per speculating sequence ({rows})"))
        pairs = sorted((t, s) for t in token_buckets for s in cfg.seq_buckets if s <= t)
    shape = BatchShape(buckets=tuple(pairs),
                       page_size=ps, max_pages_per_seq=pages_per_seq,
                       vocab_size=model.vocab_size, history_len=max_model_len,
                       num_kv_groups=1 if groups is None else groups.num_groups)
    return EnginePlan(scheduler=sched, batch_shape=shape, kv_bytes_per_page=per_page,
                      kv_budget_bytes=usable * per_page,
                      kv_bytes_per_seq=held_per_seq * per_page,
                      speculative_max_running=max_running)
