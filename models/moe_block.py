"""The sparse mixture-of-experts MLP block (Qwen3-MoE, Qwen2-MoE, Mixtral): a pure function.
(`models/moe.py` holds the families' shared params and checkpoint mapping.)

Data flow for one layer (`moe_mlp`, called by `decoder.decoder_layer` where the layer's
`LayerSpec.moe` is set) on normed input h [..., T, hidden], flattened to N tokens:

  router logits f32[N, E] = h @ router (float32: the choice of experts is a comparison of
  these, so they are not rounded to a narrower activation dtype first) -> softmax -> top-k
  (probabilities, expert ids) [N, k], renormalised to sum 1 if `norm_topk_prob`
  -> the N * k (token, expert) pairs sorted by expert (a stable argsort of the expert ids),
  group sizes i32[E] = how many pairs each expert got (data, not shape: the compiled step
  is one per bucket whatever the routing; no token is dropped, there is no capacity)
  -> the grouped SwiGLU MLP of the sorted rows against the stacked expert weights
  [E, in, out] (`grouped_mlp`: gate and up, SwiGLU, then down), each row meeting only its
  own expert's weights: on a CPU host whose engine packed the experts (`PackedExperts`,
  `models/packing.py`), one C++ call over their panels (`kernels_pallas.moe_grouped_cpu`);
  else chosen where the step is lowered: the Pallas grouped matmul on TPU
  (Mosaic) and CUDA (Triton) (kernels_pallas/grouped_matmul*.py: tile metadata from the
  group sizes, one visit per (m-tile, group) pair); on CPU (unpacked) a loop over row tiles
  (`grouped_mlp_tiled`), because JAX lowers `ragged_dot` there by multiplying every row by
  every group's weights (E times the work: scripts/bench/bench_moe_cpu.py); XLA's ragged
  dot elsewhere (`grouped_mlp_ragged`). Under tensor parallelism `sharded_grouped_mlp`
  runs it per device on the experts' intermediate slices and sums. The work is N * k rows
  (plus under a tile of padding per group or m-tile), not N * E
  (quantized experts, `ExpertWeight`: the tile loop converts and scales only each tile's
  expert's values; the other paths run over the converted values, scale per-column outputs
  after the dot and dequantize a grouped-scale stack whole, docs/quantization.md)
  -> un-sorted (the inverse permutation), weighted by the routing probabilities and summed
  over the k choices per token; plus, with a shared expert (Qwen2-MoE), sigmoid(h @ gate) *
  the shared SwiGLU MLP.

Experts with biases or another gated activation (gpt-oss: `MoESpec.expert_bias`,
`activation` "swiglu_clamped", and a router bias, `router_bias`) take `moe_biased`'s grouped
MLP instead of `grouped_mlp`; the SwiGLU path of the other families is unchanged.

Expert parallelism (`models/moe_parallel.py`) runs `expert_mlp` on each device with only its
E / P experts' weights (`first_expert` says which): the pairs of the other experts sort past
the local groups and count zero, and a psum over the devices adds the slices up.

`dense_moe_reference` computes the same thing with every expert on every token, masked by the
routing: the test oracle only (E / k times the work).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jax.sharding import Mesh
from jax.sharding import PartitionSpec as PS

from ..kernels_pallas.grouped_matmul_gpu import gpu_tiles_fit, grouped_matmul_gpu
from ..kernels_pallas.grouped_matmul_tpu import grouped_matmul_tpu
from ..kernels_pallas.moe_grouped_cpu import grouped_mlp_packed
from .config import MoESpec
from .linear import PackedExperts, linear
from .moe_biased import expert_activation, grouped_mlp_biased
from .moe_quant import (ExpertWeight, expert_floats, grouped_dot, over_quantized,  # noqa: F401
                        per_column, row_groups, stack_spec)
from .quant import QuantizedWeight

# An expert stack [E, in, out] (one layer's; float or quantized), or packed for the CPU kernel.
Experts = ExpertWeight | PackedExperts


# ------------------------------------------------------------------------------- routing
def route(spec: MoESpec, router: jax.Array, x: jax.Array,
          bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(weights f32[N, k], experts i32[N, k]) of tokens x [N, hidden] under router
    [hidden, E] (+ bias [E], gpt-oss): softmax over all E logits, the k largest (ties: the
    lower expert id, as `lax.top_k`), renormalised over the k when `norm_topk_prob` (the
    same numbers as a softmax over the k largest logits: gpt-oss, Mixtral)."""
    logits = jnp.einsum("nh,he->ne", x.astype(jnp.float32), router.astype(jnp.float32),
                        preferred_element_type=jnp.float32)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, spec.top_k)
    if spec.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def router_logits(router: jax.Array, x: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """f32[..., E]: the logits `route` ranks (tests compare its choice to HF's)."""
    logits = jnp.einsum("...h,he->...e", x.astype(jnp.float32), router.astype(jnp.float32),
                        preferred_element_type=jnp.float32)
    return logits if bias is None else logits + bias.astype(jnp.float32)


# ------------------------------------------------------------------- grouped expert matmul
def grouped_matmul(x: jax.Array, w: ExpertWeight, group_sizes: jax.Array) -> jax.Array:
    """Rows x [M, in] sorted by group, group g's `group_sizes[g]` rows times w[g] [in, out]
    -> [M, out] in x's dtype (float32 accumulation). XLA's ragged dot: no row meets another
    group's weights. Rows past sum(group_sizes) come out zero.

    Quantized w: per-column scales (int8 / fp8 by default) multiply each row's output after
    the dot, the values converted in the dot's operand as the dense path's are; grouped
    scales (int4, GGUF blocks) are applied to the whole stack before the dot: every step
    dequantizes all E experts of the layer (E * in * out multiply-adds, and a float copy
    unless XLA fuses it into the operand), a cost the CPU tile loop does not pay."""
    if isinstance(w, QuantizedWeight) and per_column(w):
        y = jax.lax.ragged_dot(x, w.values.astype(x.dtype), group_sizes,
                               preferred_element_type=jnp.float32)
        return (y * w.scales[row_groups(group_sizes, x.shape[0]), 0]).astype(x.dtype)
    y = jax.lax.ragged_dot(x, expert_floats(w, x.dtype), group_sizes,
                           preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def grouped_matmul_reference(x: jax.Array, w: ExpertWeight, group_sizes: jax.Array
                             ) -> jax.Array:
    """grouped_matmul by the definition: each row's group from the cumulative sizes, then
    that group's weights gathered per row (tests only: M copies of a weight matrix)."""
    ends = jnp.cumsum(group_sizes)
    row = jnp.arange(x.shape[0])
    group = jnp.searchsorted(ends, row, side="right")
    valid = row < ends[-1]
    wg = expert_floats(w)[jnp.minimum(group, w.shape[0] - 1)]
    y = jnp.einsum("mi,mio->mo", x.astype(jnp.float32), wg)
    return jnp.where(valid[:, None], y, 0.0).astype(x.dtype)


def _swiglu(x: jax.Array, gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


def _dot(x: jax.Array, w: jax.Array | QuantizedWeight) -> jax.Array:
    if isinstance(w, QuantizedWeight):  # one expert's [in, out]: only its values converted
        return w.matmul(x) if per_column(w) else grouped_dot(x, w)
    return jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


def grouped_mlp_ragged(xs: jax.Array, sizes: jax.Array, w_gate: ExpertWeight,
                       w_up: ExpertWeight, w_down: ExpertWeight) -> jax.Array:
    """The SwiGLU expert MLP of rows xs [M, hidden] sorted by expert (`sizes` i32[E] rows
    each) through three `jax.lax.ragged_dot`s: XLA's ragged dot instruction on TPU and GPU."""
    h = _swiglu(xs, grouped_matmul(xs, w_gate, sizes), grouped_matmul(xs, w_up, sizes))
    return grouped_matmul(h, w_down, sizes)


def tile_rows(rows: int, num_experts: int) -> int:
    """The row tile of `grouped_mlp_tiled`: the power of two covering an expert's share of
    the rows, in [4, 32]. A tile's matmuls cost their full rows whatever the group fills, so
    the padding (under a tile per group) is paid in compute: measured on XLA:CPU (hidden 512,
    8 experts of 1024, top-2), 2 rows ran 0.97 ms at tiles of 4 and 6.1 ms at 64; 128 rows
    were fastest at 16, 512 rows at 32 (64: 10% slower)."""
    share = -(-rows // num_experts)
    return int(min(32, max(4, 1 << max(share - 1, 0).bit_length())))


def grouped_mlp_tiled(xs: jax.Array, sizes: jax.Array, w_gate: ExpertWeight,
                      w_up: ExpertWeight, w_down: ExpertWeight, tile: int | None = None
                      ) -> jax.Array:
    """`grouped_mlp_ragged`'s result by a loop over row tiles, for XLA:CPU, whose lowering of
    `ragged_dot` multiplies every row by every group's weights and masks (E times the work;
    scripts/bench/bench_moe_cpu.py measures it). Each group is padded to a whole number of
    tiles of `tile` rows (the padded layout's size is static: M + E * (tile - 1), rounded up),
    and a `fori_loop` whose trip count is the data's tile count (a while loop: tiles past it
    are not run) computes one tile through its expert's gate / up / down weights per step.
    Work: the real rows plus under one tile of padding per non-empty group. Quantized
    experts: each step converts only its tile's expert's values (and scales them: after the
    dot for per-column scales, before it for groups), never the other experts'."""
    m, hidden = xs.shape
    num_experts = w_gate.shape[0]
    t = tile or tile_rows(m, num_experts)
    slots = -(-(m + num_experts * (t - 1)) // t) * t
    padded = (sizes + t - 1) // t * t
    ends, padded_ends = jnp.cumsum(sizes), jnp.cumsum(padded)
    row = jnp.arange(m, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(ends, row, side="right"), num_experts - 1)
    pos = (padded_ends - padded)[group] + row - (ends - sizes)[group]
    xp = jnp.zeros((slots, hidden), xs.dtype).at[pos].set(xs)
    tile_group = jnp.minimum(jnp.searchsorted(padded_ends, jnp.arange(0, slots, t),
                                              side="right"), num_experts - 1)

    def step(i: jax.Array, yp: jax.Array) -> jax.Array:
        def w(stack: ExpertWeight) -> jax.Array | QuantizedWeight:
            # the tile's expert's weights (a quantized one's values and scales), read in place
            return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(
                a, tile_group[i], keepdims=False), stack)

        xt = jax.lax.dynamic_slice_in_dim(xp, i * t, t)
        h = _swiglu(xt, _dot(xt, w(w_gate)), _dot(xt, w(w_up)))
        return jax.lax.dynamic_update_slice_in_dim(yp, _dot(h, w(w_down)), i * t, 0)

    yp = jax.lax.fori_loop(0, padded_ends[-1] // t, step, jnp.zeros((slots, hidden), xs.dtype))
    return jnp.take(yp, pos, axis=0)


def grouped_mlp_with(matmul: Callable[..., jax.Array], xs: jax.Array, sizes: jax.Array,
                     w_gate: ExpertWeight, w_up: ExpertWeight, w_down: ExpertWeight
                     ) -> jax.Array:
    """The SwiGLU expert MLP through a grouped matmul `matmul(x, w, sizes)` of float stacks
    (a kernel of kernels_pallas/grouped_matmul*.py), the weights cast to the rows' dtype;
    quantized stacks as `grouped_matmul` takes them (`over_quantized`)."""
    gate = over_quantized(matmul, xs, w_gate, sizes)
    h = _swiglu(xs, gate, over_quantized(matmul, xs, w_up, sizes))
    return over_quantized(matmul, h, w_down, sizes)


def grouped_mlp_pallas_tpu(xs: jax.Array, sizes: jax.Array, w_gate: ExpertWeight,
                           w_up: ExpertWeight, w_down: ExpertWeight) -> jax.Array:
    """The expert MLP through the Pallas Mosaic TPU grouped matmul (Megablox's tile visits:
    kernels_pallas/grouped_matmul_tpu.py), three calls."""
    return grouped_mlp_with(grouped_matmul_tpu, xs, sizes, w_gate, w_up, w_down)


def grouped_mlp_pallas_gpu(xs: jax.Array, sizes: jax.Array, w_gate: ExpertWeight,
                           w_up: ExpertWeight, w_down: ExpertWeight) -> jax.Array:
    """The expert MLP through the Pallas Triton grouped matmul
    (kernels_pallas/grouped_matmul_gpu.py); XLA's ragged dot where its power-of-two tiles do
    not divide the widths (hidden or expert width not a multiple of 16: toy shapes only)."""
    if not all(gpu_tiles_fit(w.shape[1], w.shape[2]) for w in (w_gate, w_down)):
        return grouped_mlp_ragged(xs, sizes, w_gate, w_up, w_down)
    return grouped_mlp_with(grouped_matmul_gpu, xs, sizes, w_gate, w_up, w_down)


def grouped_mlp(xs: jax.Array, sizes: jax.Array, w_gate: Experts, w_up: Experts,
                w_down: Experts, tile: int | None = None) -> jax.Array:
    """The grouped expert MLP: over packed expert panels (only a CPU engine packs them) the
    C++ grouped kernel; over plain or quantized stacks per backend, chosen where the step is
    lowered (so an export for TPU / CUDA from a CPU host gets that platform's kernel): the
    tile loop on CPU (of `tile` rows; None: `tile_rows` of the rows and groups given), the
    Pallas grouped matmul on TPU (Mosaic) and CUDA (Triton), XLA's ragged dot elsewhere
    (`grouped_mlp_ragged`: also the reference the kernels' tests compare against)."""
    packed = [isinstance(w, PackedExperts) for w in (w_gate, w_up, w_down)]
    if any(packed):
        if not all(packed):
            raise ValueError(f"expert stacks gate / up / down packed {packed}: all or none")
        return grouped_mlp_packed(xs, sizes, w_gate.panels, w_up.panels, w_down.panels,
                                  w_gate.layer, w_gate.out_features, isa=w_gate.isa)
    return jax.lax.platform_dependent(xs, sizes, w_gate, w_up, w_down,
                                      cpu=functools.partial(grouped_mlp_tiled, tile=tile),
                                      tpu=grouped_mlp_pallas_tpu, cuda=grouped_mlp_pallas_gpu,
                                      default=grouped_mlp_ragged)


def sharded_grouped_mlp(mesh: Mesh, axis: str) -> "GroupedMLP":
    """`grouped_mlp` under tensor parallelism (the experts' intermediate axis split over
    `axis`, as models/placement.py lays them out): each device runs the kernels on its
    slice (gate / up columns, down rows) and the partial outputs are summed. Without it XLA
    could not split a Pallas call and would gather every expert's weights to each device.
    A quantized stack's scales are split with its values (`stack_spec`)."""
    tp = mesh.shape[axis]
    col, row = PS(None, None, axis), PS(None, axis, None)

    def local(xs: jax.Array, sizes: jax.Array, w_gate: ExpertWeight, w_up: ExpertWeight,
              w_down: ExpertWeight) -> jax.Array:
        y = grouped_mlp(xs, sizes, w_gate, w_up, w_down).astype(jnp.float32)
        return jax.lax.psum(y, axis).astype(xs.dtype)

    def run(xs: jax.Array, sizes: jax.Array, w_gate: ExpertWeight, w_up: ExpertWeight,
            w_down: ExpertWeight) -> jax.Array:
        specs = (PS(), PS(), stack_spec(w_gate, col, tp), stack_spec(w_up, col, tp),
                 stack_spec(w_down, row, tp))
        return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=PS(),
                             check_vma=False)(xs, sizes, w_gate, w_up, w_down)

    return run


GroupedMLP = Callable[[jax.Array, jax.Array, Any, Any, Any], jax.Array]


def expert_mlp(x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate: Experts,
               w_up: Experts, w_down: Experts, mlp: GroupedMLP = grouped_mlp,
               first_expert: jax.Array | int = 0) -> jax.Array:
    """sum_j weights[n, j] * MLP_{experts[n, j]}(x[n]) for x [N, hidden], the k choices per
    token as `route` gives them; stacked weights [E_l, hidden, I] (gate, up), [E_l, I, hidden]
    (down) of experts first_expert .. first_expert + E_l - 1. Sort by expert, grouped matmuls,
    un-sort, weight, sum.

    All E experts (first_expert 0, E_l = E): the whole MoE sum. A slice of them (expert
    parallelism, `models/moe_parallel.py`: one device's E / P experts): the pairs of the
    other experts sort past the local groups (key E_l), beyond sum(sizes), where the grouped
    matmul does no work for them, and count zero; the result is this slice's share of the
    sum (tokens with no local expert: zero)."""
    n, k = experts.shape
    num_local = w_gate.num_experts if isinstance(w_gate, PackedExperts) else w_gate.shape[0]
    flat = experts.reshape(-1) - first_expert  # pair p = token p // k, choice p % k
    mine = (flat >= 0) & (flat < num_local)
    key = jnp.where(mine, flat, num_local)
    order = jnp.argsort(key, stable=True)  # pairs sorted by expert, the others last
    sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
    xs = jnp.take(x, order // k, axis=0)
    ys = mlp(xs, sizes, w_gate, w_up, w_down)
    # The inverse permutation gathers each pair's row back (a gather, not a scatter-add:
    # the k contributions of a token are then summed in one fixed order).
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=order.dtype))
    y = jnp.take(ys, inverse, axis=0).reshape(n, k, -1).astype(jnp.float32)
    # Rows past sum(sizes) are not results (the tile loop may leave padding there): a
    # select, not a zero weight, so nothing of them reaches the sum.
    mine = mine.reshape(n, k)
    y = jnp.where(mine[..., None], y, 0.0)
    w = jnp.where(mine, weights.astype(jnp.float32), 0.0)
    return jnp.einsum("nkh,nk->nh", y, w).astype(x.dtype)


def moe_mlp(spec: MoESpec, lp: Any, h: jax.Array, mlp: GroupedMLP | None = None) -> jax.Array:
    """The MoE MLP block on normed h [..., hidden] with one layer's params `lp` (fields
    `router`, `we_gate`, `we_up`, `we_down`; with a shared expert `ws_gate`, `ws_up`,
    `ws_down`, `ws_router`; with biases `router_bias`, `be_gate`, `be_up`, `be_down`) ->
    [..., hidden]. `mlp`: the grouped expert MLP of SwiGLU experts (default `grouped_mlp`;
    `sharded_grouped_mlp` under tensor parallelism); biased / clamped experts (gpt-oss) take
    `moe_biased.grouped_mlp_biased` instead, which XLA partitions under TP by itself."""
    lead, hidden = h.shape[:-1], h.shape[-1]
    x = h.reshape(-1, hidden)
    weights, experts = route(spec, lp.router, x, _router_bias(spec, lp))
    mlp = (mlp or grouped_mlp) if _plain(spec) else grouped_mlp_biased(spec, lp)
    out = expert_mlp(x, weights, experts, lp.we_gate, lp.we_up, lp.we_down, mlp)
    if spec.shared_intermediate_size:
        out = out + _shared_expert(lp, x)
    return out.reshape(*lead, hidden)


def _plain(spec: MoESpec) -> bool:
    """SwiGLU experts without biases: `grouped_mlp` (Qwen3-MoE, Qwen2-MoE, Mixtral)."""
    return spec.activation == "silu" and not spec.expert_bias


def _router_bias(spec: MoESpec, lp: Any) -> jax.Array | None:
    return lp.router_bias if spec.router_bias else None


def _shared_expert(lp: Any, x: jax.Array) -> jax.Array:
    shared = linear(jax.nn.silu(linear(x, lp.ws_gate)) * linear(x, lp.ws_up), lp.ws_down)
    gate = jax.nn.sigmoid(linear(x, lp.ws_router).astype(jnp.float32))
    return (gate * shared.astype(jnp.float32)).astype(x.dtype)


def dense_moe_reference(spec: MoESpec, lp: Any, h: jax.Array) -> jax.Array:
    """The test oracle: every expert's MLP on every token in float32, combined with the
    routing weights where the token chose the expert (zero elsewhere). E / k times the work
    of `moe_mlp`; never on a serving path."""
    lead, hidden = h.shape[:-1], h.shape[-1]
    x = h.reshape(-1, hidden).astype(jnp.float32)
    weights, experts = route(spec, lp.router, x, _router_bias(spec, lp))
    num_experts = lp.we_gate.shape[0]
    comb = jnp.zeros((x.shape[0], num_experts), jnp.float32)
    comb = comb.at[jnp.arange(x.shape[0])[:, None], experts].add(weights)
    f32 = jnp.float32
    g = jnp.einsum("nh,ehi->nei", x, expert_floats(lp.we_gate, f32))
    u = jnp.einsum("nh,ehi->nei", x, expert_floats(lp.we_up, f32))
    if spec.expert_bias:
        g, u = g + lp.be_gate.astype(f32), u + lp.be_up.astype(f32)
    y = jnp.einsum("nei,eih->neh", expert_activation(spec, g, u), expert_floats(lp.we_down, f32))
    if spec.expert_bias:
        y = y + lp.be_down.astype(f32)
    out = jnp.einsum("neh,ne->nh", y, comb)
    if spec.shared_intermediate_size:
        out = out + _shared_expert(lp, x)
    return out.reshape(*lead, hidden).astype(h.dtype)
