"""The shared blocks every model family composes its layers from: pure functions.

Norms (`rms_norm`, with Gemma's (offset + w) scale), rotary embeddings (`rope_inv_freq`,
`apply_rope`: default / linear / llama3 / proportional / YaRN frequencies at the layer's own
base),
the attention block (`attention`: q/k/v projections with optional bias, qk-norm, the value
norm or V = K where the spec asks, RoPE, then the caller's `AttnFn` with the layer's window,
soft-cap, query scale and attention sinks, then the output projection (with its bias where
the family has one); a layer narrower than the model computes
at its own head size inside the model's padded one), the
gated MLP (`gated_mlp`: SwiGLU or GeGLU), the embeddings (`embed`: optionally scaled, tied
or not) and the LM head (`lm_logits`: final norm, projection, optional final soft-cap). What a
layer is made of comes from its `LayerSpec` (`models/config.py`); `decoder.decoder_layer`
composes them. The dense masked attention at the end is the full-sequence oracle's attention.

A block reads the weights it needs off the family's layer params by field name (`attn_norm`,
`wq` ... `w_down`, and the optional `bq`/`bk`/`bv`, `q_norm`/`k_norm`, `post_attn_norm`,
`post_mlp_norm` where the spec asks for them), unstacked (one layer's slice, or a packed stack
with its layer index set).
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from .config import LayerSpec, ModelConfig, RopeScaling
from .linear import PackedWeight, linear
from .quant import QuantizedWeight


class AttnFn(Protocol):
    """Attention over one layer. q: [..., T, Hq, D], k/v: [..., T, Hkv, D] -> [..., T, Hq, D].

    `layer_state` is whatever per-layer state the caller scans alongside the params (a KV
    cache slice, pages, or None); `spec` gives the layer's window, soft-cap and query scale.
    The function returns its output and the updated state. Layers with
    `spec.attention_sinks` also pass `sinks=` f32[Hq] (the layer's sink logits); others do
    not, so an AttnFn of a model without sinks need not take the keyword.
    """

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, layer_state: object,
                 spec: LayerSpec) -> tuple[jax.Array, object]: ...


# ------------------------------------------------------------------------------------- norms
def row_sum(v: jax.Array) -> jax.Array:
    """sum over the last axis [..., n] -> [..., 1], in one fixed order whatever the leading
    shape: zero-padded to a power of two, then halved (first half + second half) down to one.

    Why not `jnp.sum`: XLA may order a reduction's adds by the whole array's shape, so a row's
    sum could change in its last bit with the number of rows in the step's bucket (a decode
    of one token vs a speculative verification of several, or with padding rows). Greedy
    decoding must not depend on that: with int8 activations or bfloat16 K/V, one bit of
    difference can flip a rounding and grow into another token. Elementwise adds of slices
    are never reassociated, so each row is summed the same way in every shape."""
    n = v.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        v = jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, width - n)])
    while width > 1:
        width //= 2
        v = v[..., :width] + v[..., width:]
    return v


def log_softmax(x: jax.Array, invariant: bool = False) -> jax.Array:
    """log_softmax over the last axis; `invariant` (batch-invariant mode): the exponentials
    summed by `row_sum`, so a row's logprobs keep their bits whatever the number of rows
    (XLA:CPU fused jax.nn.log_softmax with the LM head into a reduction whose order changed
    with the rows: 16 vs 64 prompt positions moved a logprob in its last bit). The max is
    exact in any order; the rest is elementwise. Else jax.nn.log_softmax (one pass fewer)."""
    if not invariant:
        return jax.nn.log_softmax(x, axis=-1)
    shifted = x - jax.lax.stop_gradient(x.max(axis=-1, keepdims=True))
    return shifted - jnp.log(row_sum(jnp.exp(shifted)))


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float,
             offset: float = 0.0) -> jax.Array:
    """RMSNorm computed in float32 (as HF does), scaled by (offset + weight), in x's dtype;
    weight None: no scale (Gemma 4's value norm). The mean of squares is `row_sum`'s: a row
    normalises to the same bits whatever the other rows of the step."""
    xf = x.astype(jnp.float32)
    ms = row_sum(xf * xf) * jnp.float32(1.0 / x.shape[-1])
    xf = xf * jax.lax.rsqrt(ms + eps)
    if weight is None:
        return xf.astype(x.dtype)
    w = weight.astype(jnp.float32)
    return ((w if offset == 0.0 else offset + w) * xf).astype(x.dtype)


# ------------------------------------------------------------------------------------- RoPE
def rope_inv_freq(head_dim: int, theta: float, rs: RopeScaling) -> np.ndarray:
    """Per-pair inverse frequencies f32[head_dim // 2], with linear / llama3 scaling applied.

    Computed on the host in float64 so it is a trace-time constant identical to HF's.
    """
    d = head_dim
    inv = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if rs.rope_type == "proportional":
        # transformers' proportional RoPE: the first int(factor * d // 2) pairs keep their
        # default frequency (exponents over the whole head dim), the rest get frequency 0 (a
        # rotation by 0: cos 1, sin 0), then all are divided by `factor`.
        rotated = int(rs.partial_rotary_factor * d // 2)
        inv = np.where(np.arange(d // 2) < rotated, inv, 0.0) / rs.factor
    elif rs.rope_type == "linear":
        inv = inv / rs.factor
    elif rs.rope_type == "yarn":
        inv = _yarn_inv_freq(inv, d, theta, rs)
    elif rs.rope_type == "llama3":
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * np.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def _yarn_inv_freq(inv: np.ndarray, d: int, theta: float, rs: RopeScaling) -> np.ndarray:
    """YaRN (transformers' _compute_yarn_parameters): pairs rotating fewer than beta_slow
    times over the original context are interpolated (divided by factor), those rotating more
    than beta_fast times kept, a linear ramp between (bounds floored / ceiled if truncate)."""
    def dim_of(rotations: float) -> float:
        return d * np.log(rs.original_max_position_embeddings / (rotations * 2 * np.pi)) / (
            2 * np.log(theta))

    low, high = dim_of(rs.beta_fast), dim_of(rs.beta_slow)
    if rs.truncate:
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the extrapolation weight
    return inv / rs.factor * (1 - keep) + inv * keep


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray,
               scale: float = 1.0) -> jax.Array:
    """Rotate-half RoPE (HF layout). x: [..., T, H, D], positions: i32[..., T]; `scale`
    multiplies cos and sin (YaRN's attention_factor)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., T, D/2]
    cos = jnp.cos(angles)[..., None, :]
    sin = jnp.sin(angles)[..., None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : x.shape[-1] // 2], xf[..., x.shape[-1] // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# -------------------------------------------------------------------------------- attention
def attention(cfg: ModelConfig, spec: LayerSpec, lp: Any, h: jax.Array, positions: jax.Array,
              attn: AttnFn, layer_state: object, shared_kv: jax.Array | None = None
              ) -> tuple[jax.Array, object, jax.Array | None]:
    """The attention block on normed input h [..., T, hidden] -> ([..., T, hidden], state,
    shared_kv). `shared_kv` [slots, 2, ..., T, Hkv, D]: the K/V that layers storing them
    (`spec.kv_store`) hand to later layers reusing them (`spec.kv_reuse`); None without.

    A layer narrower than the model (`spec.head_dim` < `cfg.head_dim`) has its heads stored
    zero-padded to `cfg.head_dim`: its q/k/v are cut to the layer's width before the norms
    and RoPE (which depend on the width) and zero-padded after, so the attention's scores
    (zeros add nothing to q.k) and its output's real columns are the layer's own, and the
    pages keep one width. The padded rows of `wo` are zero."""
    lead = h.shape[:-1]
    bias = spec.attention_bias
    D, d = cfg.head_dim, spec.head_dim or cfg.head_dim
    pad = [(0, 0)] * (len(lead) + 1) + [(0, D - d)]
    inv_freq = rope_inv_freq(d, spec.rope_theta, spec.rope_scaling)
    rope_scale = spec.rope_scaling.attention_factor
    q = linear(h, lp.wq, lp.bq if bias else None).reshape(*lead, cfg.num_heads, D)[..., :d]
    if spec.qk_norm:
        q = rms_norm(q, lp.q_norm[..., :d], cfg.rms_norm_eps, spec.norm_offset)
    q = apply_rope(q, positions, inv_freq, rope_scale)
    if spec.kv_reuse is not None:  # an earlier layer's K/V, as that layer attended to them
        k, v = shared_kv[spec.kv_reuse, 0], shared_kv[spec.kv_reuse, 1]  # type: ignore[index]
    else:
        k = linear(h, lp.wk, lp.bk if bias else None).reshape(*lead, cfg.num_kv_heads,
                                                              D)[..., :d]
        if spec.v_from_k:  # the raw key projection, before k-norm and RoPE
            v = k
        else:
            v = linear(h, lp.wv, lp.bv if bias else None).reshape(*lead, cfg.num_kv_heads,
                                                                  D)[..., :d]
        if spec.qk_norm:
            k = rms_norm(k, lp.k_norm[..., :d], cfg.rms_norm_eps, spec.norm_offset)
        if spec.v_norm:
            v = rms_norm(v, None, cfg.rms_norm_eps)
        k = apply_rope(k, positions, inv_freq, rope_scale)
        if d < D:
            k, v = jnp.pad(k, pad), jnp.pad(v, pad)
    if d < D:
        q = jnp.pad(q, pad)
    if spec.kv_store is not None:
        shared_kv = shared_kv.at[spec.kv_store].set(  # type: ignore[union-attr]
            jnp.stack([k, v]).astype(shared_kv.dtype))  # type: ignore[union-attr]
    if spec.attention_sinks:
        o, layer_state = attn(q, k, v, layer_state, spec, sinks=lp.sinks.astype(jnp.float32))
    else:
        o, layer_state = attn(q, k, v, layer_state, spec)
    # An output-projection bias: families whose attention_bias covers o_proj too (Gemma 4)
    # have a `bo` field; Qwen2's bias stops at q/k/v.
    bo = getattr(lp, "bo", None) if bias else None
    return linear(o.reshape(*lead, cfg.q_size), lp.wo, bo), layer_state, shared_kv


# -------------------------------------------------------------------------------------- MLP
def gated_mlp(activation: str, lp: Any, h: jax.Array) -> jax.Array:
    """down(act(gate(h)) * up(h)): SwiGLU (silu) or GeGLU (gelu, tanh approximation)."""
    gate = linear(h, lp.w_gate)
    if activation == "silu":
        act = jax.nn.silu(gate)
    elif activation == "gelu_pytorch_tanh":
        act = jax.nn.gelu(gate, approximate=True)
    else:  # ModelConfig validates the names; a family passing another is a bug
        raise ValueError(f"unknown MLP activation {activation!r}")
    return linear(act * linear(h, lp.w_up), lp.w_down)


# ------------------------------------------------------- per-layer inputs (Gemma 4's PLE)
def per_layer_inputs(cfg: ModelConfig, params: Any, tokens: jax.Array,
                     x: jax.Array) -> jax.Array:
    """[L, ..., T, P]: each layer's extra input per token, from the token's row of
    `params.embed_per_layer` [V', L * P] times sqrt(P) and the embeddings x (already scaled)
    projected by `per_layer_proj` [hidden, L * P] times hidden ** -0.5, RMS-normed per layer
    by `per_layer_proj_norm` [P]; their sum times 2 ** -0.5 (transformers' Gemma 4). Layer
    first: `decoder.scan_layers` scans it beside the layers."""
    L, P = cfg.num_layers, cfg.per_layer_input_size
    lead = tokens.shape
    tok = jnp.take(params.embed_per_layer, tokens, axis=0).astype(x.dtype)
    tok = (tok * jnp.asarray(P ** 0.5, x.dtype)).reshape(*lead, L, P)
    proj = linear(x, params.per_layer_proj) * jnp.asarray(cfg.hidden_size ** -0.5, x.dtype)
    proj = rms_norm(proj.reshape(*lead, L, P), params.per_layer_proj_norm, cfg.rms_norm_eps,
                    cfg.norm_offset)
    out = (proj + tok) * jnp.asarray(2 ** -0.5, x.dtype)
    return jnp.moveaxis(out, -2, 0)


def per_layer_input_block(cfg: ModelConfig, activation: str, lp: Any, x: jax.Array,
                          inp: jax.Array) -> jax.Array:
    """What a layer adds from its per-layer input inp [..., T, P]: the gated projection
    post_norm(proj(act(gate(x)) * inp)) (weights `ple_gate` [hidden, P], `ple_proj`
    [P, hidden], `ple_post_norm` [hidden])."""
    g = linear(x, lp.ple_gate)
    g = jax.nn.gelu(g, approximate=True) if activation == "gelu_pytorch_tanh" else jax.nn.silu(g)
    return rms_norm(linear(g * inp.astype(x.dtype), lp.ple_proj), lp.ple_post_norm,
                    cfg.rms_norm_eps, cfg.norm_offset)


# ------------------------------------------------------------------------- embeddings, head
def embed(params: Any, tokens: jax.Array, scale: float | None = None) -> jax.Array:
    """Token embeddings [..., hidden] in the norms' dtype, times `scale` if given (Gemma
    scales by sqrt(hidden), rounded to the activations' dtype as HF does)."""
    dtype = params.final_norm.dtype
    # Packed or quantized, the embedding is stored transposed (as the tied lm_head) and its
    # rows come back in f32: cast to the activations' dtype, the norms'.
    if isinstance(params.embed, PackedWeight):
        x = params.embed.rows(tokens).astype(dtype)
    elif isinstance(params.embed, QuantizedWeight):
        x = params.embed.columns(tokens).astype(dtype)
    else:
        x = jnp.take(params.embed, tokens, axis=0)
    return x if scale is None else x * jnp.asarray(scale, x.dtype)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else cap * jnp.tanh(x / cap)


def lm_logits(cfg: ModelConfig, params: Any, hidden: jax.Array) -> jax.Array:
    """Final norm + vocabulary projection, logits in float32. hidden: [..., hidden]."""
    h = rms_norm(hidden, params.final_norm, cfg.rms_norm_eps, cfg.norm_offset)
    head = params.embed if params.lm_head is None else params.lm_head
    if isinstance(head, (PackedWeight, QuantizedWeight)):  # a tied embedding: transposed
        logits = head.matmul(h.astype(jnp.float32))
    elif params.lm_head is None:
        logits = jnp.einsum("...h,vh->...v", h, params.embed.astype(h.dtype),
                            preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("...h,hv->...v", h, params.lm_head.astype(h.dtype),
                            preferred_element_type=jnp.float32)
    return soft_cap(logits.astype(jnp.float32), cfg.final_soft_cap)


# ------------------------------------------------------------ dense attention (the oracle's)
def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                     sm_scale: float, cap: float | None = None,
                     sinks: jax.Array | None = None) -> jax.Array:
    """Dense GQA attention. q: [B, T, Hq, D], k/v: [B, S, Hkv, D], mask: bool[B, T, S];
    sinks f32[Hq]: one more logit per head in each row's softmax, with no value."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    qg = q.reshape(B, T, Hkv, Hq // Hkv, D)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = soft_cap(scores * sm_scale, cap)
    scores = jnp.where(mask[:, None, None, :, :], scores, -jnp.inf)
    # A fully masked row (padding query) would give NaN; keep it finite, it is never read.
    scores = jnp.where(jnp.any(mask, axis=-1)[:, None, None, :, None], scores, 0.0)
    if sinks is not None:  # the sink column joins the softmax, then is dropped
        col = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(Hkv, Hq // Hkv, 1, 1),
                               (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, col], axis=-1), axis=-1)[..., :-1]
        probs = probs.astype(v.dtype)
    else:
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(B, T, Hq, D).astype(q.dtype)


def causal_mask(q_pos: jax.Array, k_pos: jax.Array, k_valid: jax.Array,
                sliding_window: int | None) -> jax.Array:
    """bool[B, T, S]: key s visible to query t (causal, valid, inside the window)."""
    m = (k_pos[:, None, :] <= q_pos[:, :, None]) & k_valid[:, None, :]
    if sliding_window is not None:
        m &= k_pos[:, None, :] > q_pos[:, :, None] - sliding_window
    return m
