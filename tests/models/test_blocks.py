"""The shared blocks a Gemma layer composes, against transformers' Gemma 3 modules.

The Llama family's parity tests cover the blocks as Llama composes them; Gemma's pieces
(RMSNorm's (1 + w) scale, the GeGLU MLP, qk-norm with that scale, query_pre_attn_scalar,
the sandwich norms around attention and MLP, a layer's own rope base and sliding window)
are checked here one layer at a time: `decoder.decoder_layer` with a Gemma-shaped
`LayerSpec` against `Gemma3DecoderLayer` (eager attention, the mask built by hand), a
sliding-window layer and a global one, on the same random weights. Not the Gemma family
(issue #31 part 2): no config mapping or loader, just the blocks it will be made of.
"""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve.models import decoder  # noqa: E402
from jaxserve.models.blocks import causal_mask, masked_attention, rms_norm  # noqa: E402
from jaxserve.models.config import LayerSpec, ModelConfig  # noqa: E402
from jaxserve.models.tiny import tiny_config  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, SCALAR, WINDOW, T = 32, 4, 2, 16, 24, 4, 11


def gemma3_config():  # noqa: ANN201 - a Gemma3TextConfig
    cfg = transformers.Gemma3TextConfig(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        query_pre_attn_scalar=SCALAR, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"])
    cfg._attn_implementation = "eager"
    return cfg


def our_config() -> ModelConfig:
    return tiny_config(hidden_size=HIDDEN, intermediate_size=64, num_heads=HEADS,
                       num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-6,
                       norm_offset=1.0)


def spec_of(layer_type: str) -> LayerSpec:
    """What the Gemma family's config mapping will give each of Gemma 3's layer kinds."""
    local = layer_type == "sliding_attention"
    return LayerSpec(sliding_window=WINDOW if local else None,
                     rope_theta=10000.0 if local else 1e6, query_scale=SCALAR ** -0.5,
                     qk_norm=True, mlp_activation="gelu_pytorch_tanh", norm_offset=1.0,
                     post_norms=True)


def params_of(layer) -> types.SimpleNamespace:  # noqa: ANN001 - a Gemma3DecoderLayer
    """The layer's weights under the blocks' field names, linears [in, out]."""
    def t(p) -> jnp.ndarray:  # noqa: ANN001
        return jnp.asarray(p.detach().numpy())

    a, m = layer.self_attn, layer.mlp
    return types.SimpleNamespace(
        attn_norm=t(layer.input_layernorm.weight),
        post_attn_norm=t(layer.post_attention_layernorm.weight),
        mlp_norm=t(layer.pre_feedforward_layernorm.weight),
        post_mlp_norm=t(layer.post_feedforward_layernorm.weight),
        wq=t(a.q_proj.weight).T, wk=t(a.k_proj.weight).T, wv=t(a.v_proj.weight).T,
        wo=t(a.o_proj.weight).T, q_norm=t(a.q_norm.weight), k_norm=t(a.k_norm.weight),
        w_gate=t(m.gate_proj.weight).T, w_up=t(m.up_proj.weight).T,
        w_down=t(m.down_proj.weight).T, bq=None, bk=None, bv=None)


@pytest.mark.parametrize("layer_idx", [0, 1], ids=["sliding", "global"])
def test_decoder_layer_matches_gemma3(layer_idx: int) -> None:
    from transformers.models.gemma3 import modeling_gemma3 as g

    hf_cfg = gemma3_config()
    torch.manual_seed(layer_idx)
    layer = g.Gemma3DecoderLayer(hf_cfg, layer_idx).eval()
    with torch.no_grad():  # norms start at 0 in HF ((1 + w) = 1): perturb every weight
        for p in layer.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    layer_type = hf_cfg.layer_types[layer_idx]
    x = torch.randn(1, T, HIDDEN)
    pos = torch.arange(T)[None]
    rope = g.Gemma3RotaryEmbedding(hf_cfg)(x, pos, layer_type)
    allowed = (pos[0][None, :] <= pos[0][:, None])
    if layer_type == "sliding_attention":
        allowed &= pos[0][None, :] > pos[0][:, None] - WINDOW
    mask = torch.where(allowed, 0.0, float("-inf"))[None, None]
    with torch.no_grad():
        want = layer(x, position_embeddings=rope, attention_mask=mask, position_ids=pos)
    want = (want[0] if isinstance(want, tuple) else want).numpy()

    spec = spec_of(layer_type)
    positions = jnp.arange(T, dtype=jnp.int32)[None]

    def attn(q, k, v, state, s):  # noqa: ANN001, ANN202 - the AttnFn protocol
        m = causal_mask(positions, positions, jnp.ones((1, T), bool), s.sliding_window)
        return masked_attention(q, k, v, m, s.query_scale, s.soft_cap), state

    got, _ = decoder.decoder_layer(our_config(), spec, params_of(layer),
                                   jnp.asarray(x.numpy()), positions, attn, None)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_gemma_rms_norm_scale() -> None:
    from transformers.models.gemma3 import modeling_gemma3 as g

    norm = g.Gemma3RMSNorm(HIDDEN, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(HIDDEN))
    x = torch.randn(3, HIDDEN)
    with torch.no_grad():
        want = norm(x).numpy()
    got = rms_norm(jnp.asarray(x.numpy()), jnp.asarray(norm.weight.detach().numpy()), 1e-6, 1.0)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
