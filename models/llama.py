"""Functional Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM).

Data flow: token ids -> `embed` -> `num_layers` x `decoder_layer` (scanned over the stacked
per-layer params) -> final RMSNorm -> `lm_head` logits. Everything is a pure function of a
typed params pytree (`LlamaParams`, a flax.struct dataclass); the model config is a frozen,
hashable `ModelConfig` passed as a static argument. Attention is pluggable: the layer computes
q/k/v (with bias, q/k norm and RoPE as the architecture asks) and hands them to an `AttnFn`, so
the same layer code serves the full-sequence oracle forward below and the paged engine step
(`models/paged.py`); the tests add a contiguous-cache generation loop on it.

Linear weights are stored `[in_features, out_features]` (x @ w), stacked over layers on axis 0.
Quantized, they are `QuantizedWeight`s (`models/quant.py`; a quantized tied embedding is
stored transposed, as the lm_head it also is). On a CPU host the engine may hold them packed
instead (`PackedWeight`, `models/packing.py`): `_linear` then runs the C++ dense kernel, and
`scan_layers` hands each layer the whole stack and its index rather than a slice (a slice is a
copy of the layer's weights every step).
"""

from __future__ import annotations

from typing import Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ..kernels_pallas.dense_cpu import PANEL, dense_packed
from ..kernels_pallas.dense_quant_cpu import QuantPanels, dense_quant_packed, dequantize_columns
from .config import ModelConfig
from .quant import QuantizedWeight


@struct.dataclass
class PackedWeight:
    """A linear weight W [in, out] (or a stack of them) in the CPU dense kernel's 16-column
    panels (`kernels_pallas.dense_cpu`), float or quantized (`dense_quant_cpu`); `x @ W`
    runs that kernel."""

    panels: jax.Array | QuantPanels  # f32[(L,) ceil(out / 16), in, 16] or quantized panels
    out_features: int = struct.field(pytree_node=False)
    layer: jax.Array | None = None  # i32[]: the layer of a stack (set by scan_layers)
    # The kernel's instruction set (cpu_build.dense_isas(); None: the best this CPU runs).
    isa: str | None = struct.field(pytree_node=False, default=None)

    def matmul(self, x: jax.Array) -> jax.Array:
        if isinstance(self.panels, QuantPanels):
            return dense_quant_packed(x.astype(jnp.float32), self.panels, self.layer,
                                      self.out_features, isa=self.isa).astype(x.dtype)
        return dense_packed(x, self.panels, self.layer, self.out_features, isa=self.isa)

    def rows(self, ids: jax.Array) -> jax.Array:
        """W^T[ids] -> [..., in]: rows of the transposed weight (a tied embedding's lookup)."""
        if isinstance(self.panels, QuantPanels):
            return dequantize_columns(self.panels, ids)
        return self.panels[ids // PANEL, :, ids % PANEL]


Weight = jax.Array | PackedWeight | QuantizedWeight


@struct.dataclass
class LayerParams:
    """Per-layer weights stacked on a leading layer axis L (scanned)."""

    attn_norm: jax.Array  # f[L, hidden]
    wq: Weight  # f[L, hidden, num_heads * head_dim]
    wk: Weight  # f[L, hidden, num_kv_heads * head_dim]
    wv: Weight  # f[L, hidden, num_kv_heads * head_dim]
    wo: Weight  # f[L, num_heads * head_dim, hidden]
    mlp_norm: jax.Array  # f[L, hidden]
    w_gate: Weight  # f[L, hidden, intermediate]
    w_up: Weight  # f[L, hidden, intermediate]
    w_down: Weight  # f[L, intermediate, hidden]
    bq: jax.Array | None = None  # f[L, num_heads * head_dim]   (attention_bias)
    bk: jax.Array | None = None  # f[L, num_kv_heads * head_dim] (attention_bias)
    bv: jax.Array | None = None  # f[L, num_kv_heads * head_dim] (attention_bias)
    q_norm: jax.Array | None = None  # f[L, head_dim] (qk_norm)
    k_norm: jax.Array | None = None  # f[L, head_dim] (qk_norm)


@struct.dataclass
class LlamaParams:
    """All weights of one model. `lm_head` is None when the embeddings are tied."""

    embed: Weight  # f[vocab, hidden]; packed: its transpose [hidden, vocab] (tied lm_head)
    layers: LayerParams
    final_norm: jax.Array  # f[hidden]
    lm_head: Weight | None = None  # f[hidden, vocab]


class AttnFn(Protocol):
    """Attention over one layer. q: [..., T, Hq, D], k/v: [..., T, Hkv, D] -> [..., T, Hq, D].

    `layer_state` is whatever per-layer state the caller scans alongside the params (a KV
    cache slice, pages, or None); the function returns its output and the updated state.
    """

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array,
                 layer_state: object) -> tuple[jax.Array, object]: ...


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of every LlamaParams/LayerParams field for `cfg` (None: absent)."""
    L, H, I = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "embed": (cfg.vocab_size, H),
        "final_norm": (H,),
        "layers.attn_norm": (L, H),
        "layers.wq": (L, H, cfg.q_size),
        "layers.wk": (L, H, cfg.kv_size),
        "layers.wv": (L, H, cfg.kv_size),
        "layers.wo": (L, cfg.q_size, H),
        "layers.mlp_norm": (L, H),
        "layers.w_gate": (L, H, I),
        "layers.w_up": (L, H, I),
        "layers.w_down": (L, I, H),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (H, cfg.vocab_size)
    if cfg.attention_bias:
        shapes.update({"layers.bq": (L, cfg.q_size), "layers.bk": (L, cfg.kv_size),
                       "layers.bv": (L, cfg.kv_size)})
    if cfg.qk_norm:
        shapes.update({"layers.q_norm": (L, cfg.head_dim), "layers.k_norm": (L, cfg.head_dim)})
    return shapes


def abstract_params(cfg: ModelConfig, dtype: jnp.dtype) -> LlamaParams:
    """A LlamaParams of jax.ShapeDtypeStruct leaves (restore targets, memory estimates)."""
    shapes = param_shapes(cfg)

    def leaf(name: str) -> jax.ShapeDtypeStruct | None:
        return jax.ShapeDtypeStruct(shapes[name], dtype) if name in shapes else None

    layer_fields = {f: leaf(f"layers.{f}") for f in LayerParams.__dataclass_fields__}
    return LlamaParams(embed=leaf("embed"), layers=LayerParams(**layer_fields),
                       final_norm=leaf("final_norm"), lm_head=leaf("lm_head"))


def init_random_params(cfg: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.float32,
                       scale: float = 0.02) -> LlamaParams:
    """Random weights (tests, benchmarks); norms start near 1 so activations stay sane."""
    template = abstract_params(cfg, dtype)
    leaves, treedef = jax.tree_util.tree_flatten(template)
    keys = jax.random.split(key, len(leaves))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(template)[0]]
    out = []
    for k, leaf, path in zip(keys, leaves, paths):
        noise = jax.random.normal(k, leaf.shape, jnp.float32)
        if "norm" in path:
            out.append((1.0 + 0.1 * noise).astype(dtype))
        else:
            out.append((scale * noise).astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


# ----------------------------------------------------------------------------- building blocks
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32 (as HF does), returned in x's dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * xf).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Per-pair inverse frequencies f32[head_dim // 2], with linear / llama3 scaling applied.

    Computed on the host in float64 so it is a trace-time constant identical to HF's.
    """
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = cfg.rope_scaling
    if rs.rope_type == "linear":
        inv = inv / rs.factor
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


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half RoPE (HF layout). x: [..., T, H, D], positions: i32[..., T]."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., T, D/2]
    cos = jnp.cos(angles)[..., None, :]
    sin = jnp.sin(angles)[..., None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : x.shape[-1] // 2], xf[..., x.shape[-1] // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _linear(x: jax.Array, w: Weight, b: jax.Array | None = None) -> jax.Array:
    if isinstance(w, (PackedWeight, QuantizedWeight)):
        y = w.matmul(x)
    else:
        y = jnp.einsum("...i,io->...o", x, w.astype(x.dtype))
    return y if b is None else y + b.astype(x.dtype)


def decoder_layer(cfg: ModelConfig, lp: LayerParams, x: jax.Array, positions: jax.Array,
                  attn: AttnFn, layer_state: object) -> tuple[jax.Array, object]:
    """One pre-norm block on one layer's (unstacked) params. x: [..., T, hidden]."""
    h = rms_norm(x, lp.attn_norm, cfg.rms_norm_eps)
    lead = h.shape[:-1]
    q = _linear(h, lp.wq, lp.bq).reshape(*lead, cfg.num_heads, cfg.head_dim)
    k = _linear(h, lp.wk, lp.bk).reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    v = _linear(h, lp.wv, lp.bv).reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, lp.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, lp.k_norm, cfg.rms_norm_eps)
    inv_freq = rope_inv_freq(cfg)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)
    o, layer_state = attn(q, k, v, layer_state)
    x = x + _linear(o.reshape(*lead, cfg.q_size), lp.wo)
    h = rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps)
    mlp = jax.nn.silu(_linear(h, lp.w_gate)) * _linear(h, lp.w_up)
    return x + _linear(mlp, lp.w_down), layer_state


def scan_layers(body: Callable[[object, tuple[LayerParams, jax.Array, object]],
                                tuple[object, object]],
                carry: object, layers: LayerParams, xs: object = None) -> tuple[object, object]:
    """`lax.scan` of body(carry, (layer params, layer index i32[], xs slice)) over the layers.
    A `PackedWeight` field is not sliced: the body gets the whole stack with `layer` set."""
    names = [f for f in LayerParams.__dataclass_fields__
             if isinstance(getattr(layers, f), PackedWeight)]
    packed = {f: getattr(layers, f) for f in names}
    sliced = layers.replace(**{f: None for f in names})
    num_layers = layers.attn_norm.shape[0]

    def step(c: object, s: tuple[LayerParams, jax.Array, object]) -> tuple[object, object]:
        lp, i, x = s
        lp = lp.replace(**{f: w.replace(layer=i) for f, w in packed.items()})
        return body(c, (lp, i, x))

    return jax.lax.scan(step, carry, (sliced, jnp.arange(num_layers, dtype=jnp.int32), xs))


def run_layers(cfg: ModelConfig, layers: LayerParams, x: jax.Array, positions: jax.Array,
               attn: AttnFn, layer_states: object = None) -> tuple[jax.Array, object]:
    """Scan `decoder_layer` over the stacked layers; `layer_states` is scanned alongside."""

    def body(carry: jax.Array, xs: tuple[LayerParams, jax.Array, object]
             ) -> tuple[jax.Array, object]:
        lp, _, state = xs
        return decoder_layer(cfg, lp, carry, positions, attn, state)

    return scan_layers(body, x, layers, layer_states)


def embed(params: LlamaParams, tokens: jax.Array) -> jax.Array:
    # Packed or quantized, the embedding is stored transposed (as the tied lm_head) and its
    # rows come back in f32: cast to the activations' dtype, the norms'.
    if isinstance(params.embed, PackedWeight):
        return params.embed.rows(tokens).astype(params.final_norm.dtype)
    if isinstance(params.embed, QuantizedWeight):
        return params.embed.columns(tokens).astype(params.final_norm.dtype)
    return jnp.take(params.embed, tokens, axis=0)


def lm_logits(cfg: ModelConfig, params: LlamaParams, hidden: jax.Array) -> jax.Array:
    """Final norm + vocabulary projection, logits in float32. hidden: [..., hidden]."""
    h = rms_norm(hidden, params.final_norm, cfg.rms_norm_eps)
    head = params.embed if params.lm_head is None else params.lm_head
    if isinstance(head, (PackedWeight, QuantizedWeight)):  # a tied embedding: transposed
        logits = head.matmul(h.astype(jnp.float32))
    elif params.lm_head is None:
        logits = jnp.einsum("...h,vh->...v", h, params.embed.astype(h.dtype),
                            preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("...h,hv->...v", h, params.lm_head.astype(h.dtype),
                            preferred_element_type=jnp.float32)
    return logits.astype(jnp.float32)


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                     sm_scale: float) -> jax.Array:
    """Dense GQA attention. q: [B, T, Hq, D], k/v: [B, S, Hkv, D], mask: bool[B, T, S]."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    qg = q.reshape(B, T, Hkv, Hq // Hkv, D)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * sm_scale
    scores = jnp.where(mask[:, None, None, :, :], scores, -jnp.inf)
    # A fully masked row (padding query) would give NaN; keep it finite, it is never read.
    scores = jnp.where(jnp.any(mask, axis=-1)[:, None, None, :, None], scores, 0.0)
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


def forward(params: LlamaParams, tokens: jax.Array, lengths: jax.Array,
            cfg: ModelConfig) -> jax.Array:
    """Full-sequence forward, the correctness oracle: f32[B, T, vocab] logits.

    tokens: i32[B, T] right-padded; lengths: i32[B] valid tokens per row. Logits at padded
    positions are garbage-but-finite. Jit with `cfg` static.
    """
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    valid = positions < lengths[:, None]
    mask = causal_mask(positions, positions, valid, cfg.sliding_window)
    scale = cfg.head_dim ** -0.5

    def attn(q: jax.Array, k: jax.Array, v: jax.Array, state: object) -> tuple[jax.Array, object]:
        return masked_attention(q, k, v, mask, scale), state

    x = embed(params, tokens)
    x, _ = run_layers(cfg, params.layers, x, positions, attn)
    return lm_logits(cfg, params, x)


forward_jit: Callable[..., jax.Array] = jax.jit(forward, static_argnames=("cfg",))
