"""Speculative decoding's device code lowered for TPU and CUDA on this CPU (`jax.export`):
the target step that keeps an EAGLE-3 head's auxiliary hidden states, the head's proposal
round and a draft model's, at Llama-3-8B's shape (a released EAGLE-3 head for it: hidden
4096, 32 / 8 heads of 128, MLP 14336, a draft vocabulary of 32,000 of 128,256) with
abstract bfloat16 weights (nothing allocated), `attention_impl="auto"` resolved as on that
platform. Each exported module must call the platform's attention kernel (the catch-up
and the chain's body) and never trace the jnp reference attention. Shapes: the engine's
token bucket of 256 with 128 sequences, pages of 16.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from jaxserve.config import EngineConfig
from jaxserve.device import model_runner as mr
from jaxserve.device.spec_draft import empty_round
from jaxserve.device.spec_draft_model import draft_model_round_jit
from jaxserve.device.spec_eagle3 import eagle3_round_jit
from jaxserve.engine.sizing import plan_engine
from jaxserve.kernels_pallas import padded_head_dim, select_impl
from jaxserve.kernels_pallas import selector
from jaxserve.models import families, shapes
from jaxserve.models.eagle3 import Eagle3Params, param_shapes
from jaxserve.models.eagle3_config import NUM_AUX, Eagle3Config
from jaxserve.models.paged import kv_cache_shape

SDS = jax.ShapeDtypeStruct
KERNEL_CALL = {"tpu": "tpu_custom_call", "cuda": "mosaic_gpu_v2"}
# Triton calls (the GPU's grouped matmul) are not in jax.export's stable list.
EXPORT_CHECKS = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
TARGET = shapes.llama3_8b()
HEAD = Eagle3Config(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                    intermediate_size=14336, rms_norm_eps=1e-5, rope_theta=500000.0,
                    max_position_embeddings=8192, vocab_size=128256, draft_vocab_size=32000,
                    target_hidden_size=4096)
T, S, PAGE, K = 256, 128, 16, 3


@pytest.fixture(autouse=True)
def no_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the jnp reference attention was traced on an accelerator path")

    monkeypatch.setattr(selector, "ragged_paged_attention_reference", refuse)


def kernel_calls(exported: jax.export.Exported, platform: str) -> int:
    return re.findall(r"custom_call @(\w+)", exported.mlir_module()).count(
        KERNEL_CALL[platform])


def pages(cfg_layers: int, kv_heads: int, head_dim: int, num_pages: int) -> SDS:
    cfg = dataclasses.replace(TARGET, num_layers=cfg_layers, num_kv_heads=kv_heads,
                              head_dim=head_dim)
    return SDS(kv_cache_shape(cfg, num_pages, PAGE, padded_head_dim(head_dim)), jnp.bfloat16)


def abstract_round(max_pages: int, eagle3: bool) -> object:
    rnd = empty_round(T, S, max_pages, eagle3=eagle3)
    return jax.tree.map(lambda a: SDS(a.shape, a.dtype), rnd)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_target_step_with_aux_states_and_eagle3_round_lower(platform: str) -> None:
    impl = select_impl("auto", platform)
    engine = EngineConfig(dtype="bfloat16", max_num_seqs=S, max_num_batched_tokens=1024,
                          max_model_len=4096, kv_cache_memory=8 << 30, page_size=PAGE)
    plan = plan_engine(engine, TARGET, 2, 1 << 40, padded_head_dim(TARGET.head_dim))
    num_pages, width = plan.scheduler.num_pages, plan.batch_shape.max_pages_per_seq
    aux_layers = HEAD.aux_layers(TARGET)
    assert aux_layers == (2, 16, 29)
    params = families.family(TARGET).abstract_params(TARGET, jnp.bfloat16)
    batch = mr.empty_batch(plan.batch_shape, T, S, penalties=False)
    inputs, _, _ = jax.tree.map(lambda a: SDS(a.shape, a.dtype), mr.to_step_inputs(batch))
    feed = SDS((max(s for _, s in plan.batch_shape.buckets),), jnp.int32)
    fwd = jax.export.export(mr.forward_jit, platforms=[platform],
                            disabled_checks=EXPORT_CHECKS)(
        params, pages(TARGET.num_layers, 8, 128, num_pages), inputs, feed, cfg=TARGET,
        attn_impl=impl, aux_layers=aux_layers)
    aux = fwd.out_avals[-1]
    assert (aux.shape, aux.dtype) == ((T, NUM_AUX * 4096), jnp.bfloat16)
    assert kernel_calls(fwd, platform) == 1  # the layers' one scanned body

    shapes_ = param_shapes(HEAD, has_embed=False)
    head = Eagle3Params(**{f: SDS(s, jnp.int32 if f == "d2t" else jnp.bfloat16)
                           for f, s in shapes_.items()})
    exported = jax.export.export(eagle3_round_jit, platforms=[platform],
                                 disabled_checks=EXPORT_CHECKS)(
        head, pages(1, 8, 128, num_pages), abstract_round(width, True),
        SDS((T, NUM_AUX * 4096), jnp.bfloat16), cfg=HEAD, k=K,
        target_embed=params.embed, attn_impl=impl, chain=SDS((), jnp.bool_))
    props = exported.out_avals[0]
    assert (props.shape, props.dtype) == ((S, K), jnp.int32)
    assert kernel_calls(exported, platform) == 2  # the catch-up and the chain's body


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_draft_model_round_lowers(platform: str) -> None:
    """A 2-layer draft of the 8B's width (a truncated copy, as the benchmark's)."""
    impl = select_impl("auto", platform)
    draft = dataclasses.replace(TARGET, num_layers=2)
    params = families.family(draft).abstract_params(draft, jnp.bfloat16)
    width = 4096 // PAGE
    exported = jax.export.export(draft_model_round_jit, platforms=[platform],
                                 disabled_checks=EXPORT_CHECKS)(
        params, pages(2, 8, 128, 1024), abstract_round(width, False), cfg=draft, k=K,
        attn_impl=impl)
    props = exported.out_avals[0]
    assert (props.shape, props.dtype) == ((S, K), jnp.int32)
    assert kernel_calls(exported, platform) == 2
