"""The decoder every family runs: layers composed of shared blocks, scanned group by group.

Data flow: token ids -> `blocks.embed` -> for each `LayerGroup` of the config (consecutive
layers of equal `LayerSpec`, in layer order) one `lax.scan` of `decoder_layer` over that
group's layers of the stacked per-layer params -> `blocks.lm_logits`. The spec is static
within a scan, so a layer's composition (norm kind, qk-norm, bias, MLP activation, sandwich
norms) and its attention's window / soft-cap / rope base are trace-time data; a model of
uniform layers (the Llama family) is one group and one scan, exactly as before.

The stacked weights are read in place: one group scans them as `lax.scan` xs; several groups
index layer i of the loop-invariant stack inside each scan (`lax.dynamic_index_in_dim`, the
same per-layer read a scan's xs make), so no group slices the stack (a slice would copy the
group's weights every step). A `PackedWeight` / `PackedExperts` field is never sliced: the
body gets the whole stack with `layer` set (the CPU kernel reads that layer's panels); a
`LoraWeight` (a step's adapter slots beside a projection, `models/lora.py`) has its base
sliced or handed whole by the base's own kind and its LoRA stacks always handed whole
(`linear.split_stacked` / `join_stacked`). Everything is a pure
function of the params pytree; the config is a static argument. `forward` is the
full-sequence correctness oracle; `models/paged.py` is the engine's step on the same layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from .blocks import AttnFn, attention, causal_mask, embed, gated_mlp, lm_logits
from .blocks import masked_attention, per_layer_input_block, per_layer_inputs, rms_norm
from .config import LayerGroup, LayerSpec, ModelConfig, MoESpec
from .linear import PACKED_STACKS, join_stacked, split_stacked
from .moe import moe_mlp

# body(spec, carry, (one layer's params, layer index i32[], xs slice)) -> (carry, ys slice)
LayerBody = Callable[[LayerSpec, Any, tuple[Any, jax.Array, Any]], tuple[Any, Any]]
# moe(spec, one layer's params, normed h [..., hidden]) -> [..., hidden]
MoEFn = Callable[[MoESpec, Any, jax.Array], jax.Array]


def decoder_layer(cfg: ModelConfig, spec: LayerSpec, lp: Any, x: jax.Array,
                  positions: jax.Array, attn: AttnFn, layer_state: object,
                  per_layer_input: jax.Array | None = None,
                  shared_kv: jax.Array | None = None, moe: MoEFn = moe_mlp
                  ) -> tuple[jax.Array, object, jax.Array | None]:
    """One pre-norm block on one layer's (unstacked) params. x: [..., T, hidden] ->
    (x, layer_state, shared_kv). `per_layer_input` [..., T, P]: this layer's slice of
    `blocks.per_layer_inputs` (models that have them); `shared_kv`: the K/V slots layers
    hand on (`blocks.attention`), None in models without; `moe`: a sparse layer's MLP
    (`moe_mlp`; tensor parallel: `moe_mlp` with `moe_block.sharded_grouped_mlp`; expert
    parallel: `moe_parallel.ep_moe_mlp` on its mesh)."""
    eps, offset = cfg.rms_norm_eps, spec.norm_offset
    h = rms_norm(x, lp.attn_norm, eps, offset)
    o, layer_state, shared_kv = attention(cfg, spec, lp, h, positions, attn, layer_state,
                                          shared_kv)
    if spec.post_norms:
        o = rms_norm(o, lp.post_attn_norm, eps, offset)
    x = x + o
    h = rms_norm(x, lp.mlp_norm, eps, offset)
    m = gated_mlp(spec.mlp_activation, lp, h) if spec.moe is None else moe(spec.moe, lp, h)
    if spec.post_norms:
        m = rms_norm(m, lp.post_mlp_norm, eps, offset)
    x = x + m
    if per_layer_input is not None:
        x = x + per_layer_input_block(cfg, spec.mlp_activation, lp, x, per_layer_input)
    if spec.layer_scalar:  # Gemma 4: the whole residual stream, times a weight [1]
        x = x * lp.layer_scalar.astype(x.dtype)
    return x, layer_state, shared_kv


def _num_layers(layers: Any) -> int:
    for f in dataclasses.fields(layers):
        w = getattr(layers, f.name)
        if w is not None and not isinstance(w, PACKED_STACKS):
            return jax.tree.leaves(w)[0].shape[0]
    raise ValueError("layer params hold no unpacked field to count the layers by")


def scan_layers(body: LayerBody, carry: object, layers: Any,
                groups: tuple[LayerGroup, ...], xs: object = None) -> tuple[object, object]:
    """`lax.scan` of body over the layers, one scan per group; `xs` ([L, ...] leaves) is
    scanned alongside and the ys of the groups are concatenated in layer order."""
    parts = {f.name: split_stacked(getattr(layers, f.name)) for f in dataclasses.fields(layers)}
    whole = {f: w for f, (_, w) in parts.items() if w is not None}
    stacked = layers.replace(**{f: parts[f][0] for f in whole})
    num_layers = _num_layers(stacked)
    if groups[-1].stop != num_layers or groups[0].start != 0:
        raise ValueError(f"layer groups cover [{groups[0].start}, {groups[-1].stop}); the "
                         f"params hold {num_layers} layers")

    def with_packed(lp: Any, i: jax.Array) -> Any:
        return lp.replace(**{f: join_stacked(getattr(lp, f), w, i) for f, w in whole.items()})

    if len(groups) == 1:
        spec = groups[0].spec

        def step(c: object, s: tuple[Any, jax.Array, object]) -> tuple[object, object]:
            lp, i, x = s
            return body(spec, c, (with_packed(lp, i), i, x))

        return jax.lax.scan(step, carry, (stacked, jnp.arange(num_layers, dtype=jnp.int32), xs))

    ys = []
    for g in groups:
        def group_step(c: object, s: tuple[jax.Array, object],
                       spec: LayerSpec = g.spec) -> tuple[object, object]:
            i, x = s
            lp = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False),
                              stacked)
            return body(spec, c, (with_packed(lp, i), i, x))

        group_xs = jax.tree.map(lambda a, g=g: a[g.start:g.stop], xs)
        carry, y = jax.lax.scan(group_step, carry,
                                (jnp.arange(g.start, g.stop, dtype=jnp.int32), group_xs))
        ys.append(y)
    return carry, jax.tree.map(lambda *a: jnp.concatenate(a), *ys)


def init_shared_kv(cfg: ModelConfig, lead: tuple[int, ...], dtype: object) -> jax.Array | None:
    """Zeroed K/V slots [slots, 2, *lead, Hkv, D] for a model whose layers share K/V
    (`ModelConfig.kv_share_slots`); None for the others (an empty part of a scan's carry)."""
    if not cfg.kv_share_slots:
        return None
    return jnp.zeros((cfg.kv_share_slots, 2, *lead, cfg.num_kv_heads, cfg.head_dim), dtype)


def run_layers(cfg: ModelConfig, layers: Any, x: jax.Array, positions: jax.Array,
               attn: AttnFn, layer_states: object = None,
               per_layer_inputs: jax.Array | None = None) -> tuple[jax.Array, object]:
    """Scan `decoder_layer` over the stacked layers; `layer_states` and `per_layer_inputs`
    ([L, ...]) are scanned alongside, the shared K/V slots carried."""

    def body(spec: LayerSpec, carry: tuple[jax.Array, jax.Array | None],
             xs: tuple[Any, jax.Array, tuple[object, jax.Array | None]]
             ) -> tuple[tuple[jax.Array, jax.Array | None], object]:
        lp, _, (state, inp) = xs
        x, shared = carry
        x, state, shared = decoder_layer(cfg, spec, lp, x, positions, attn, state, inp, shared)
        return (x, shared), state

    shared = init_shared_kv(cfg, x.shape[:-1], x.dtype)
    (x, _), states = scan_layers(body, (x, shared), layers, cfg.layer_groups,
                                 (layer_states, per_layer_inputs))
    return x, states


def forward(params: Any, tokens: jax.Array, lengths: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Full-sequence forward, the correctness oracle: f32[B, T, vocab] logits.

    tokens: i32[B, T] right-padded; lengths: i32[B] valid tokens per row. Logits at padded
    positions are garbage-but-finite. Jit with `cfg` static.
    """
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    valid = positions < lengths[:, None]

    def attn(q: jax.Array, k: jax.Array, v: jax.Array, state: object,
             spec: LayerSpec, sinks: jax.Array | None = None) -> tuple[jax.Array, object]:
        mask = causal_mask(positions, positions, valid, spec.sliding_window)
        return masked_attention(q, k, v, mask, spec.query_scale, spec.soft_cap, sinks), state

    x = embed(params, tokens, cfg.embed_scale)
    inputs = per_layer_inputs(cfg, params, tokens, x) if cfg.per_layer_input_size else None
    x, _ = run_layers(cfg, params.layers, x, positions, attn, per_layer_inputs=inputs)
    return lm_logits(cfg, params, x)


forward_jit: Callable[..., jax.Array] = jax.jit(forward, static_argnames=("cfg",))
