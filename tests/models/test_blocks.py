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
from jaxserve.models.config import LayerSpec, ModelConfig, RopeScaling  # noqa: E402
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

    got, *_ = decoder.decoder_layer(our_config(), spec, params_of(layer),
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


# ------------------------------------------------ layers narrower than the model (Gemma 4)
def test_padded_heads_view_reads_any_box() -> None:
    """`PaddedHeads`: each of 2 heads of 3 entries repeated twice and zero-padded to 5, on
    either axis; every box reads what the explicitly built array holds."""
    from jaxserve.models.host_arrays import PaddedHeads

    base = np.arange(6 * 4, dtype=np.float32).reshape(6, 4) + 1
    heads = base.reshape(2, 3, 4)
    want = np.zeros((2, 2, 5, 4), np.float32)
    want[:, :, :3] = heads[:, None]
    want = want.reshape(20, 4)
    for axis, b, w in ((0, base, want), (1, base.T, want.T)):
        view = PaddedHeads(b, axis, 2, 2, 5)
        assert view.shape == w.shape
        for lo, hi in ((0, 20), (3, 4), (2, 17), (5, 10), (9, 10)):
            box = (slice(lo, hi), slice(1, 3)) if axis == 0 else (slice(1, 3), slice(lo, hi))
            np.testing.assert_array_equal(view[box], w[box])


def test_narrow_layer_in_a_wide_stack_is_its_own_layer() -> None:
    """A layer of head_dim 8 and one KV head (`LayerSpec.head_dim` / `num_kv_heads`) stored
    in a model of head_dim 16 and two KV heads (its heads zero-padded, its KV head repeated:
    what `PaddedHeads` gives the loader) computes what the same layer does in a model of its
    own shape, with qk-norm, the value norm, K = V and the layer scalar on. The padded run
    adds exact zeros to the same sums: the bound is the reordering of the head-dim and
    projection sums (numerics.reordered_chain_bound) on the output's magnitude."""
    from support.numerics import reordered_chain_bound

    from jaxserve.models.host_arrays import PaddedHeads, read_all

    d, D, H = 8, 16, HIDDEN
    rng = np.random.default_rng(0)
    def near_one(n: int) -> np.ndarray:
        return 1 + 0.1 * rng.standard_normal(n)

    own = dict(attn_norm=near_one(H), post_attn_norm=near_one(H), mlp_norm=near_one(H),
               post_mlp_norm=near_one(H),
               wq=rng.standard_normal((H, HEADS * d)) * 0.3, wk=rng.standard_normal((H, d)) * 0.3,
               wv=np.zeros((H, d)), wo=rng.standard_normal((HEADS * d, H)) * 0.3,
               q_norm=near_one(d), k_norm=near_one(d),
               w_gate=rng.standard_normal((H, 64)) * 0.3, w_up=rng.standard_normal((H, 64)) * 0.3,
               w_down=rng.standard_normal((64, H)) * 0.3, layer_scalar=np.array([0.7]))
    heads = {"wq": (1, HEADS, 1), "wk": (1, 1, 2), "wv": (1, 1, 2), "wo": (0, HEADS, 1),
             "q_norm": (0, 1, 1), "k_norm": (0, 1, 1)}
    wide = {k: (read_all(PaddedHeads(v, *heads[k][:1], heads[k][1], heads[k][2], D))
                if k in heads else v) for k, v in own.items()}

    def run(p: dict, cfg: ModelConfig, spec: LayerSpec) -> np.ndarray:
        lp = types.SimpleNamespace(**{k: jnp.asarray(v, jnp.float32) for k, v in p.items()},
                                   bq=None, bk=None, bv=None)
        positions = jnp.arange(T, dtype=jnp.int32)[None]

        def attn(q, k, v, state, s):  # noqa: ANN001, ANN202 - the AttnFn protocol
            m = causal_mask(positions, positions, jnp.ones((1, T), bool), s.sliding_window)
            return masked_attention(q, k, v, m, s.query_scale, s.soft_cap), state

        x = jnp.asarray(np.random.default_rng(1).standard_normal((1, T, H)), jnp.float32)
        return np.asarray(decoder.decoder_layer(cfg, spec, lp, x, positions, attn, None)[0])

    base = dict(query_scale=1.0, qk_norm=True, mlp_activation="gelu_pytorch_tanh",
                post_norms=True, v_norm=True, v_from_k=True, layer_scalar=True,
                rope_scaling=RopeScaling("proportional", partial_rotary_factor=0.5))
    small = tiny_config(hidden_size=H, intermediate_size=64, num_heads=HEADS, num_kv_heads=1,
                        head_dim=d, rms_norm_eps=1e-6)
    big = tiny_config(hidden_size=H, intermediate_size=64, num_heads=HEADS, num_kv_heads=2,
                      head_dim=D, rms_norm_eps=1e-6)
    want = run(own, small, LayerSpec(**base))
    got = run(wide, big, LayerSpec(**base, head_dim=d, num_kv_heads=1))
    tol = reordered_chain_bound([D, HEADS * D, H]) * np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)


def test_proportional_rope_matches_transformers() -> None:
    """Gemma 4's proportional RoPE: the first quarter of the pairs rotate at the frequencies
    of the whole head dim, the rest not at all; as transformers computes it."""
    from transformers.models.gemma4 import modeling_gemma4 as g

    from jaxserve.models.blocks import rope_inv_freq

    cfg = transformers.Gemma4TextConfig(num_hidden_layers=2, head_dim=16, global_head_dim=32,
                                        hidden_size_per_layer_input=0,
                                        layer_types=["sliding_attention", "full_attention"])
    rope = g.Gemma4TextRotaryEmbedding(cfg)
    for kind, dim, rs in (("full_attention", 32, RopeScaling("proportional",
                                                             partial_rotary_factor=0.25)),
                          ("sliding_attention", 16, RopeScaling())):
        want = getattr(rope, f"{kind}_inv_freq").numpy()
        theta = cfg.rope_parameters[kind]["rope_theta"]
        # Ours: float64 then rounded once; torch's: a float32 pow, a few ulps (u = 6e-8) off.
        np.testing.assert_allclose(rope_inv_freq(dim, theta, rs), want, rtol=1e-6)
