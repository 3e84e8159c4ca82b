"""Speculative decoding's part of the build (`build.py` calls it): the draft model of method
draft_model, loaded, checked and turned into the engine's proposer.

Data flow (`build.build_engine`): `load_draft(config, target)` -> the draft checkpoint named
by speculative_config.model, loaded with the target's loader (HF safetensors directory, GGUF,
Orbax), dtype and weight quantization, packed as the target is (`prepare`), checked against
the target (same vocabulary; a family the drafter runs) -> the build sizes the KV pages
with the draft's bytes per page (`sizing.plan_engine(draft=...)`: the draft's KV pages use
the target's page ids) -> `draft_proposer(...)`: a `DraftModelProposer` (the draft's params
and KV pages, rounds compiled per (tokens, seqs) bucket, `round_buckets`) behind the
engine's Proposer protocol (`draft_proposer.DraftModelEngineProposer`), warmed up (`build.warm_up`) before
the compile guard is armed -> `Engine(..., proposer=...)`.

Refused by name (ValueError): a draft model with tensor parallelism, several processes or
data parallelism (the drafter runs unsharded on the first local device), and a target with
KV groups (sliding-window layers: its sequences' pages are per group; the drafter reads one
block table).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from jaxserve.config import EngineConfig
from jaxserve.device.spec_draft import check_draft_config, round_buckets
from jaxserve.device.spec_draft_model import DraftModelProposer
from jaxserve.engine.sizing import EnginePlan
from jaxserve.models.config import ConfigError, ModelConfig
from jaxserve.models.kv_groups import kv_groups
from jaxserve.models.loading import LoadedModel, load_model
from jaxserve.models.quant import WeightQuant
from jaxserve.serving.draft_proposer import DraftModelEngineProposer


def wants_draft(config: EngineConfig) -> bool:
    spec = config.speculative_config
    return spec is not None and spec.method == "draft_model"


def check_supported(config: EngineConfig) -> None:
    """Refuse (ValueError naming the option) a draft model where the build cannot run one."""
    if not wants_draft(config):
        return
    why = ("tensor_parallel_size > 1" if config.tensor_parallel_size > 1 else
           "data_parallel_size > 1" if config.data_parallel_size > 1 else
           "several processes (jax.distributed)" if jax.process_count() > 1 else None)
    if why is not None:
        raise ValueError(f"speculative_config method 'draft_model' is not supported with "
                         f"{why}: the draft model runs unsharded on one device")


def load_draft(config: EngineConfig, target_model: LoadedModel, quant: WeightQuant,
               prepare: Callable[[Any], Any]) -> LoadedModel | None:
    """The draft model of a draft_model speculative_config (None for any other config),
    loaded as the target was (`config.dtype`, `quant`) and its params `prepare`d (the
    build's packing for the CPU kernel). ValueError naming the draft's path when it does not
    load or does not fit the target."""
    check_supported(config)
    if not wants_draft(config):
        return None
    path = config.speculative_config.model  # type: ignore[union-attr]
    target, target_name = target_model.config, str(target_model.source)
    if kv_groups(target) is not None:
        raise ValueError(f"speculative_config method 'draft_model': the target "
                         f"{target_name} has KV groups (sliding-window layers), which a draft "
                         "model does not support")
    try:
        draft = load_model(path, config.dtype, quant=quant)
    except (ValueError, OSError) as e:
        raise ValueError(f"speculative_config model={path!r}: the draft model does not load: "
                         f"{e}") from e
    try:
        check_draft_config(draft.config, target)
    except ConfigError as e:
        raise ValueError(f"speculative_config model={path!r} cannot draft for the target "
                         f"{target_name}: {e}") from e
    return dataclasses.replace(draft, params=prepare(draft.params))


def draft_buckets(plan: EnginePlan, k: int) -> tuple[tuple[int, int], ...]:
    """The rounds' (tokens, seqs) buckets: the engine's token buckets, each with at most as
    many sequences as may speculate in one step (the step's sampler rows are more), plus
    `round_buckets`' small-seqs pairs."""
    most = max(1, min(plan.speculative_max_running - 1, plan.scheduler.max_num_seqs))
    pairs = sorted({(t, min(t, most)) for t, _ in plan.batch_shape.buckets})
    return round_buckets(pairs, k)


def draft_proposer(config: EngineConfig, plan: EnginePlan, draft: LoadedModel,
                   target: ModelConfig, kv_dtype: Any, attn_impl: str,
                   kv_head_dim: int | None) -> DraftModelEngineProposer:
    """The engine's proposer over `draft` (KV pages: the target's count and page size);
    `build.warm_up` compiles its rounds (`Engine.warmup_proposer`) before arming the
    compile guard."""
    k = config.speculative_config.num_speculative_tokens  # type: ignore[union-attr]
    shape = plan.batch_shape
    drafter = DraftModelProposer(draft.config, draft.params, plan.scheduler.num_pages,
                                 shape.page_size, kv_dtype, k, draft_buckets(plan, k),
                                 shape.max_pages_per_seq, attn_impl=attn_impl,
                                 target_cfg=target, kv_head_dim=kv_head_dim)
    return DraftModelEngineProposer(drafter)
