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

Method eagle3, the same way: `load_head(config, target)` -> the EAGLE-3 head named by
speculative_config.model (`models/eagle3.py`: config.json + safetensors), in the target's
dtype, checked against the target (hidden size, vocabulary, aux layers) -> `aux_layers`: the
target runner keeps those layers' inputs of every step on the device (`ModelPending.aux`) ->
the build sizes the KV pages with the head's one layer per page id (`kv_config`) ->
`proposer(...)`: an `Eagle3Proposer` (rounds compiled per token bucket of the engine's: the
aux rows index the target step's token axis) behind `eagle3_proposer.Eagle3EngineProposer`.

Under tensor parallelism the drafter is not split: its params, pages and rounds are
replicated over the target's mesh (every device runs the whole draft or head; the target
step's aux output is made replicated too); each data-parallel replica gets its own copy on
its devices; over several processes every process builds the same drafter
(`build.build_follower`) and process 0 announces each round (`device/multihost_spec.py`).
Refused by name (ValueError): a target with KV groups (sliding-window layers: its
sequences' pages are per group; the drafter reads one block table).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, Sharding

from jaxserve.config import EngineConfig
from jaxserve.device.spec_draft import check_draft_config, round_buckets
from jaxserve.device.spec_draft_model import DraftModelProposer
from jaxserve.device.spec_eagle3 import Eagle3Proposer
from jaxserve.engine.sizing import EnginePlan
from jaxserve.models import placement
from jaxserve.models.blocks import embed
from jaxserve.models.config import ConfigError, ModelConfig
from jaxserve.models.eagle3 import Eagle3Params, load_eagle3
from jaxserve.models.eagle3_config import Eagle3Config
from jaxserve.models.kv_groups import kv_groups
from jaxserve.models.loading import LoadedModel, load_model
from jaxserve.models.quant import WeightQuant
from jaxserve.serving.draft_proposer import DraftModelEngineProposer
from jaxserve.serving.eagle3_proposer import Eagle3EngineProposer


@dataclasses.dataclass(frozen=True)
class LoadedHead:
    """An EAGLE-3 head checkpoint, loaded."""

    cfg: Eagle3Config
    params: Eagle3Params
    source: str


Drafter = LoadedModel | LoadedHead  # what a draft_model / eagle3 config loads
Proposer = DraftModelEngineProposer | Eagle3EngineProposer


def wants_draft(config: EngineConfig) -> bool:
    spec = config.speculative_config
    return spec is not None and spec.method == "draft_model"


def wants_head(config: EngineConfig) -> bool:
    spec = config.speculative_config
    return spec is not None and spec.method == "eagle3"




def load_drafter(config: EngineConfig, target_model: LoadedModel, quant: WeightQuant,
                 prepare: Callable[[Any], Any]) -> Drafter | None:
    """The draft model or EAGLE-3 head of the speculative_config (None for ngram or none)."""
    return load_head(config, target_model) if wants_head(config) else \
        load_draft(config, target_model, quant, prepare)


def load_head(config: EngineConfig, target_model: LoadedModel) -> LoadedHead | None:
    """The EAGLE-3 head of an eagle3 speculative_config (None for any other config), in the
    target's dtype. ValueError naming the head's path when it does not load or does not fit
    the target."""
    if not wants_head(config):
        return None
    path, target, target_name = _target_checked(config, target_model)
    try:
        cfg, params = load_eagle3(path, config.dtype)
    except (ValueError, OSError) as e:
        raise ValueError(f"speculative_config model={path!r}: the EAGLE-3 head does not load: "
                         f"{e}") from e
    try:
        cfg.check_target(target, params.embed is not None)
        cfg.aux_layers(target)
    except ConfigError as e:
        raise ValueError(f"speculative_config model={path!r} cannot draft for the target "
                         f"{target_name}: {e}") from e
    return LoadedHead(cfg, params, str(path))


def kv_config(drafter: Drafter | None) -> ModelConfig | None:
    """The drafter's KV layers as a model config (what sizing and the attention choice
    read): a draft model's own, an EAGLE-3 head's one layer."""
    if drafter is None:
        return None
    return drafter.cfg.layer_config if isinstance(drafter, LoadedHead) else drafter.config


def aux_layers(drafter: Drafter | None, target: ModelConfig) -> tuple[int, ...]:
    """The target layers whose inputs every step keeps for the drafter (an EAGLE-3 head's)."""
    return drafter.cfg.aux_layers(target) if isinstance(drafter, LoadedHead) else ()


def proposer(config: EngineConfig, plan: EnginePlan, drafter: Drafter | None,
             target: ModelConfig, target_params: Any, kv_dtype: Any, attn_impl: str | None,
             kv_head_dim: int | None, mesh: Mesh | None = None) -> Proposer | None:
    """The engine's proposer over `drafter` (KV pages: the target's count and page size),
    placed beside the target: replicated over its `mesh` (tensor parallelism, and every
    data-parallel replica, whose devices are a mesh), else on the default device; None
    without a drafter. `build.warm_up` compiles its rounds (`Engine.warmup_proposer`)."""
    if drafter is None or attn_impl is None:
        return None
    sharding = None if mesh is None else placement.replicated(mesh)
    if isinstance(drafter, LoadedModel):
        return draft_proposer(config, plan, drafter, target, kv_dtype, attn_impl, kv_head_dim,
                              sharding)
    k = config.speculative_config.num_speculative_tokens  # type: ignore[union-attr]
    shape = plan.batch_shape
    pairs = eagle3_buckets(plan, k)
    # The aux states' dtype is the step's activations': the embedding's output.
    aux_dtype = jax.eval_shape(lambda p: embed(p, jnp.zeros(1, jnp.int32), target.embed_scale),
                               target_params).dtype
    head = Eagle3Proposer(drafter.cfg, drafter.params, plan.scheduler.num_pages,
                          shape.page_size, kv_dtype, k, pairs,
                          shape.max_pages_per_seq, target_embed=target_params.embed,
                          attn_impl=attn_impl, kv_head_dim=kv_head_dim, aux_dtype=aux_dtype,
                          sharding=sharding)
    return Eagle3EngineProposer(head)


def _target_checked(config: EngineConfig, target_model: LoadedModel
                    ) -> tuple[str, ModelConfig, str]:
    """(the drafter's path, the target's config, its name), once the build and the target
    are ones a drafter runs beside (ValueError naming the method otherwise)."""
    spec = config.speculative_config
    assert spec is not None and spec.model is not None
    target, target_name = target_model.config, str(target_model.source)
    if kv_groups(target) is not None:
        raise ValueError(f"speculative_config method {spec.method!r}: the target "
                         f"{target_name} has KV groups (sliding-window layers), which a draft "
                         "model or head does not support")
    return spec.model, target, target_name


def load_draft(config: EngineConfig, target_model: LoadedModel, quant: WeightQuant,
               prepare: Callable[[Any], Any]) -> LoadedModel | None:
    """The draft model of a draft_model speculative_config (None for any other config),
    loaded as the target was (`config.dtype`, `quant`) and its params `prepare`d (the
    build's packing for the CPU kernel). ValueError naming the draft's path when it does not
    load or does not fit the target."""
    if not wants_draft(config):
        return None
    path, target, target_name = _target_checked(config, target_model)
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


def eagle3_buckets(plan: EnginePlan, k: int) -> tuple[tuple[int, int], ...]:
    """An EAGLE-3 round's (tokens, seqs) buckets: every token bucket of the target's step
    (the aux rows index its token axis) with its own seqs bucket, plus, for each power of
    two s below the back-off (`speculative_max_running`: more sequences never speculate),
    s paired with the token buckets up to the first that holds s speculating rows of
    k + 1 tokens: a round of a few speculating sequences then runs its chain and draft
    logits over s rows, not over the step's widest seqs bucket (a step of one decode
    verifying 3 proposals is a bucket of 8 rows, and the chain costs per row)."""
    widest = dict(sorted(plan.batch_shape.buckets))  # token bucket -> its largest seqs
    pairs = set(widest.items())
    s = 1
    while s < plan.speculative_max_running:
        for t in sorted(widest):
            if s < widest[t]:
                pairs.add((t, s))
            if t >= s * (k + 1):
                break
        s *= 2
    return tuple(sorted(pairs))


def draft_buckets(plan: EnginePlan, k: int) -> tuple[tuple[int, int], ...]:
    """The rounds' (tokens, seqs) buckets: the engine's token buckets, each with at most as
    many sequences as may speculate in one step (the step's sampler rows are more), plus
    `round_buckets`' small-seqs pairs."""
    most = max(1, min(plan.speculative_max_running - 1, plan.scheduler.max_num_seqs))
    pairs = sorted({(t, min(t, most)) for t, _ in plan.batch_shape.buckets})
    return round_buckets(pairs, k)


def draft_proposer(config: EngineConfig, plan: EnginePlan, draft: LoadedModel,
                   target: ModelConfig, kv_dtype: Any, attn_impl: str,
                   kv_head_dim: int | None, sharding: Sharding | None = None
                   ) -> DraftModelEngineProposer:
    """The engine's proposer over `draft` (KV pages: the target's count and page size);
    `build.warm_up` compiles its rounds (`Engine.warmup_proposer`) before arming the
    compile guard."""
    k = config.speculative_config.num_speculative_tokens  # type: ignore[union-attr]
    shape = plan.batch_shape
    drafter = DraftModelProposer(draft.config, draft.params, plan.scheduler.num_pages,
                                 shape.page_size, kv_dtype, k, draft_buckets(plan, k),
                                 shape.max_pages_per_seq, attn_impl=attn_impl,
                                 target_cfg=target, kv_head_dim=kv_head_dim,
                                 sharding=sharding)
    return DraftModelEngineProposer(drafter)
