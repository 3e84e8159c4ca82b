"""The engine's step with adapter slots, lowered for TPU and CUDA on this CPU host (`jax.export`).

The step exactly as `ModelRunner` jits it (`forward_jit` with the LoRA stacks and per-token
slots) at a Llama-3-8B shape in bfloat16 (abstract weights: nothing allocated), 8 adapter
slots of rank 16 over every attention and MLP projection, for a decode bucket and a prefill
bucket, on one device and under tensor parallelism over an abstract 8-device mesh (each
delta split as its projection: `linear.LoraWeight._sharded`). The attention kernel's custom
call must still be there once per layer body, and the step's outputs keep their shapes.
Lowering the LoRA kernels themselves per backend: tests/kernels/test_lora_delta.py.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, NamedSharding

from support.tiers import grid

from jaxserve.config import EngineConfig
from jaxserve.device import model_runner as mr
from jaxserve.engine.sizing import plan_engine
from jaxserve.kernels_pallas import padded_head_dim, select_impl
from jaxserve.models import families, placement, shapes
from jaxserve.models.lora import LoraStacks, lora_specs, lora_targets
from jaxserve.models.paged import kv_cache_shape

SDS = jax.ShapeDtypeStruct
KERNEL_CALL = {"tpu": "tpu_custom_call", "cuda": "mosaic_gpu_v2"}
TRITON_CALL = "__gpu$xla.gpu.triton"
SLOTS, RANK = 9, 16  # 8 adapters + slot 0
ENGINE = EngineConfig(dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=512,
                      max_model_len=4096, kv_cache_memory=8 << 30)


def abstract_stacks(cfg, sharding=None) -> LoraStacks:  # noqa: ANN001
    targets = lora_targets(cfg)
    stacks = LoraStacks(
        a={f: SDS((L, SLOTS, i, RANK), jnp.bfloat16) for f, (L, i, o) in targets.items()},
        b={f: SDS((L, SLOTS, RANK, o), jnp.bfloat16) for f, (L, i, o) in targets.items()})
    if sharding is None:
        return stacks
    return jax.tree.map(lambda a, spec: SDS(a.shape, a.dtype, sharding=sharding(spec)),
                        stacks, lora_specs(cfg))


@pytest.mark.parametrize("platform,tp", grid(
    [[("tpu", "tpu"), ("cuda", "cuda")], [("tp1", 1), ("tp8", 8)]], {"tpu-tp1", "cuda-tp8"},
    "each platform at the other TP size too"))
def test_lora_step_lowers_for_platform(platform: str, tp: int) -> None:
    cfg = shapes.llama3_8b()
    impl = select_impl("auto", platform)
    plan = plan_engine(ENGINE, cfg, 2, 1 << 40, padded_head_dim(cfg.head_dim), 0)
    run_cfg, mesh = cfg, None
    params = families.family(cfg).abstract_params(cfg, jnp.bfloat16)
    stacks = abstract_stacks(cfg)
    kv_shape = kv_cache_shape(cfg, plan.scheduler.num_pages, plan.scheduler.page_size,
                              padded_head_dim(cfg.head_dim))
    kv = SDS(kv_shape, jnp.bfloat16)

    def placed(a):  # noqa: ANN001, ANN202
        return SDS(a.shape, a.dtype)

    if tp > 1:
        mesh = AbstractMesh((tp,), (placement.MODEL_AXIS,))
        run_cfg = placement.tp_model_config(cfg, tp)
        run = families.family(cfg).abstract_params(run_cfg, jnp.bfloat16)
        params = jax.tree.map(lambda a, spec: SDS(a.shape, a.dtype,
                                                  sharding=NamedSharding(mesh, spec)),
                              run, placement.param_specs(cfg, tp, run))
        stacks = abstract_stacks(run_cfg, lambda spec: NamedSharding(mesh, spec))
        kv_shape = kv_cache_shape(run_cfg, plan.scheduler.num_pages,
                                  plan.scheduler.page_size, padded_head_dim(cfg.head_dim))
        kv = SDS(kv_shape, jnp.bfloat16, sharding=placement.kv_sharding(mesh))
        rep = placement.replicated(mesh)

        def placed(a):  # noqa: ANN001, ANN202, F811
            return SDS(a.shape, a.dtype, sharding=rep)

    buckets = list(plan.batch_shape.buckets)
    feed_len = max(s for _, s in buckets)
    for t, s in (buckets[0], buckets[-1]):  # a decode bucket, the largest prefill one
        batch = mr.empty_batch(plan.batch_shape, t, s, penalties=False)
        inputs, _, _ = jax.tree.map(placed, mr.to_step_inputs(batch, lora=True))
        assert inputs.lora_slots is not None and inputs.lora_slots.shape == (t,)
        fwd = jax.export.export(
            mr.forward_jit, platforms=[platform],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(
            params, kv, inputs, placed(SDS((feed_len,), jnp.int32)), cfg=run_cfg,
            attn_impl=impl, mesh=mesh, lora=stacks)
        calls = re.findall(r"custom_call @(\w+)", fwd.mlir_module())
        assert KERNEL_CALL[platform] in calls, calls
        assert fwd.out_avals[0].shape == kv_shape
        assert fwd.out_avals[1].shape == (s, cfg.vocab_size)
