"""An MoE model's experts packed for the C++ grouped expert kernel (`models/packing.py`,
`kernels_pallas/moe_grouped_cpu.py`) against the unpacked model.

- `expert_mlp` over packed float32 and bfloat16 stacks against the MoE block's tile loop
  on the same (bfloat16-rounded) weights in float32: the same routing, the kernel's grouped
  MLP, the same combine;
- a tiny Qwen3-MoE (a dense layer between sparse ones: two scan groups) with every weight
  packed gives the unpacked model's logits (`decoder.forward`; slow tier);
- plain stacks lowered for TPU / CUDA keep that platform's grouped matmul;
- the engine build packs the experts where `dense_impl` picks the C++ kernels: float32
  models with the dense weights, bfloat16 models the experts alone (in bfloat16), `xla`
  neither. tests/models/test_moe.py runs the packed engine against transformers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import EngineConfig
from jaxserve.kernels_pallas import cpu_build
from jaxserve.kernels_pallas.moe_grouped_cpu import pack_expert_panels
from jaxserve.models import decoder, families, moe, tiny
from jaxserve.models.linear import PackedExperts, PackedWeight
from jaxserve.models.packing import pack_experts, pack_params
from jaxserve.serving import build

pytestmark = pytest.mark.skipif(cpu_build.dense_kernel_target() is None,
                                reason="the CPU kernels could not be built here (see the log)")


@functools.lru_cache(maxsize=None)
def _tiny_moe(dtype: str = "float32"):  # noqa: ANN202 - a LoadedModel (built once per dtype)
    d = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=96,
             hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, intermediate_size=48, num_experts=5,
             num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True,
             mlp_only_layers=[1], max_position_embeddings=128, rms_norm_eps=1e-6,
             rope_theta=1e4, bos_token_id=1, eos_token_id=2)
    cfg = families.config_from_hf(d, "tiny_moe/config.json")
    model = tiny.random_model(cfg, seed=3, scale=0.2)
    if dtype == "float32":
        return model
    return dataclasses.replace(model, params=jax.tree.map(lambda a: a.astype(dtype),
                                                          _tiny_moe().params))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_expert_mlp_packed_matches_tile_loop(dtype: str) -> None:
    rng = np.random.default_rng(1)
    n, hidden, width, e, k = 9, 40, 24, 6, 2
    ws = [np.asarray(jnp.asarray(0.3 * rng.standard_normal(s), dtype).astype(jnp.float32))
          for s in ((e, hidden, width), (e, hidden, width), (e, width, hidden))]
    packed = [PackedExperts(jnp.asarray(pack_expert_panels(w, dtype)), w.shape[-1])
              for w in ws]
    x = jnp.asarray(rng.standard_normal((n, hidden)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(n)]),
                          jnp.int32)
    weights = jnp.asarray(rng.dirichlet(np.ones(k), n), jnp.float32)
    got = jax.jit(moe.expert_mlp)(x, weights, experts, *packed)
    want = moe.expert_mlp(x, weights, experts, *map(jnp.asarray, ws),
                          mlp=moe.grouped_mlp_tiled)
    assert packed[0].num_experts == e
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4,
                               atol=1e-4 * float(jnp.abs(want).max()))
    with pytest.raises(ValueError, match=r"packed \[True, False, True\]: all or none"):
        moe.grouped_mlp(x, jnp.zeros(e, jnp.int32), packed[0], jnp.asarray(ws[1]), packed[2])


@pytest.mark.slow(reason="two whole-model compiles; test_moe.py's engine runs the packed model")
def test_packed_model_matches_unpacked() -> None:
    model = _tiny_moe()
    packed = pack_params(model.params)
    for name in moe.EXPERT_FIELDS:
        assert isinstance(getattr(packed.layers, name), PackedExperts)
    assert isinstance(packed.layers.wq, PackedWeight)
    tokens = np.random.default_rng(0).integers(3, 96, (2, 11)).astype(np.int32)
    lengths = np.array([11, 7], np.int32)
    want = np.asarray(decoder.forward_jit(model.params, tokens, lengths, cfg=model.config))
    got = np.asarray(decoder.forward_jit(packed, tokens, lengths, cfg=model.config))
    scale = float(np.abs(want).max())
    assert scale > 1e-2
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.parametrize("dense_impl,dtype,dense,experts", [
    ("auto", "float32", True, "float32"), ("auto", "bfloat16", False, "bfloat16"),
    ("xla", "float32", False, None),
])
def test_build_packs_experts_where_dense_impl_picks_the_kernels(
        dense_impl: str, dtype: str, dense: bool, experts: str | None) -> None:
    model = _tiny_moe(dtype)
    isa = cpu_build.dense_isas()[-1]  # the config's ISA reaches the experts too
    config = EngineConfig(dense_impl=dense_impl, dense_isa=isa, dtype=dtype)
    params = build._dense_params(config, model.params)  # the build's packing step alone
    assert isinstance(params.layers.wq, PackedWeight) is dense
    for name in moe.EXPERT_FIELDS:
        w = getattr(params.layers, name)
        if experts is None:
            assert isinstance(w, jax.Array)
        else:
            assert isinstance(w, PackedExperts) and w.panels.dtype == experts and w.isa == isa
    with pytest.raises(ValueError, match="no \\(unpacked\\) expert stacks"):
        pack_experts(pack_experts(model.params))


@pytest.mark.parametrize("platform,call", [("tpu", "tpu_custom_call"),
                                           ("cuda", "__gpu$xla.gpu.triton")])
def test_unpacked_experts_still_lower_to_the_platform_kernel_elsewhere(platform: str,
                                                                       call: str) -> None:
    """The C++ kernel only replaces the CPU branch: plain stacks lowered for TPU / CUDA (an
    export from a CPU host) get that platform's grouped matmul, and no CPU custom call."""
    e, hidden, width = 4, 32, 16
    f32 = jnp.float32
    args = (jax.ShapeDtypeStruct((6, hidden), f32), jax.ShapeDtypeStruct((e,), jnp.int32),
            jax.ShapeDtypeStruct((e, hidden, width), f32),
            jax.ShapeDtypeStruct((e, hidden, width), f32),
            jax.ShapeDtypeStruct((e, width, hidden), f32))
    text = jax.jit(moe.grouped_mlp).trace(*args).lower(
        lowering_platforms=(platform,)).as_text()
    assert call in text and "moe_grouped" not in text
