"""Batch-invariant mode's step lowered for TPU and CUDA with `jax.export` (no device here).

What the mode builds on an accelerator: `attention_impl="auto"` resolves to the platform's
Pallas kernel, which the mode replaces by the jnp reference with uniform tiles
('reference_invariant', `serving/batch_invariant.py`); `plan_engine(fixed_shapes=True)`
gives one (tokens, seqs) bucket; the sampler and the prompt logprobs pass sum their
log_softmax by `row_sum` (`invariant=True`). Each is exported for the platform exactly as
`ModelRunner` jits it, at a small Llama shape in bfloat16 (abstract weights), and must hold
no Pallas kernel call. That these lowered steps are bit-invariant on the device is not shown
here (no device in this suite); docs/batch-invariance.md says what is and is not checked.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from jaxserve.config import EngineConfig
from jaxserve.device import model_runner as mr
from jaxserve.device.prompt_logprobs import PromptLogprobsInputs
from jaxserve.engine.batch import bitmask_words
from jaxserve.engine.sizing import plan_engine
from jaxserve.kernels_pallas import select_impl
from jaxserve.models import families, tiny
from jaxserve.models.paged import kv_cache_shape
from jaxserve.serving import batch_invariant

SDS = jax.ShapeDtypeStruct
CFG = tiny.tiny_config(vocab_size=4096, hidden_size=256, intermediate_size=512, num_heads=4,
                       num_kv_heads=2, head_dim=64, num_layers=2, max_position_embeddings=2048)
ENGINE = EngineConfig(dtype="bfloat16", max_num_seqs=16, max_num_batched_tokens=128,
                      max_model_len=1024, kv_cache_memory=64 << 20, batch_invariant=True)


@pytest.mark.parametrize("platform", ("tpu", "cuda"))
def test_invariant_step_lowers_for_platform(platform: str) -> None:
    impl = batch_invariant.attention_impl(ENGINE, select_impl("auto", platform))
    assert impl == "reference_invariant"
    plan = plan_engine(ENGINE, CFG, 2, 1 << 40, None, 0, platform=platform, fixed_shapes=True)
    assert plan.batch_shape.buckets == ((128, 16),)
    (t, s), = plan.batch_shape.buckets
    params = families.family(CFG).abstract_params(CFG, jnp.bfloat16)
    kv = SDS(kv_cache_shape(CFG, plan.scheduler.num_pages, plan.scheduler.page_size),
             jnp.bfloat16)
    batch = mr.empty_batch(plan.batch_shape, t, s, penalties=False)
    inputs, sampling, _ = jax.tree.map(lambda a: SDS(a.shape, a.dtype),
                                       mr.to_step_inputs(batch))
    fwd = jax.export.export(mr.forward_jit, platforms=[platform])(
        params, kv, inputs, SDS((s,), jnp.int32), cfg=CFG, attn_impl=impl)
    calls = re.findall(r"custom_call @(\w+)", fwd.mlir_module())
    assert not {"tpu_custom_call", "mosaic_gpu_v2"} & set(calls), calls
    assert fwd.out_avals[1].shape == (s, CFG.vocab_size)
    sampling = sampling.with_mask(SDS((s, bitmask_words(CFG.vocab_size)), jnp.int32))
    sample = jax.export.export(mr.sample_jit, platforms=[platform])(
        SDS((s, CFG.vocab_size), jnp.float32), sampling, apply_penalty=False, feed_len=s,
        invariant=True)
    assert sample.out_avals[-1].shape == (s,)
    plp = PromptLogprobsInputs(SDS((t,), jnp.int32), SDS((t,), jnp.int32), SDS((1,), jnp.int32))
    scored = jax.export.export(mr.prompt_logprobs_jit, platforms=[platform])(
        params, SDS((t, CFG.hidden_size), jnp.bfloat16), plp, cfg=CFG, invariant=True)
    assert scored.out_avals[0].shape == (t,)
