"""The sparse mixture-of-experts MLP block (Qwen3-MoE, Qwen2-MoE, Mixtral): a pure function.

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
  own expert's weights, chosen where the step is lowered: XLA's ragged dot on TPU / GPU
  (`grouped_mlp_ragged`); on CPU a loop over row tiles (`grouped_mlp_tiled`), because JAX
  lowers `ragged_dot` there by multiplying every row by every group's weights (E times the
  work: scripts/bench/bench_moe_cpu.py). The work is N * k rows (plus under a tile of
  padding per group on CPU), not N * E
  -> un-sorted (the inverse permutation), weighted by the routing probabilities and summed
  over the k choices per token; plus, with a shared expert (Qwen2-MoE), sigmoid(h @ gate) *
  the shared SwiGLU MLP.

`dense_moe_reference` computes the same thing with every expert on every token, masked by the
routing: the test oracle only (E / k times the work).

The family side shared by the MoE families is here too: the layer-params base classes
(`MoELayerParams`, `MixedMoELayerParams` with a dense MLP and a shared expert; each family
subclasses one so `families.family_of_params` tells them apart), the expert stacks' shapes / TP layout, and the HF checkpoint mapping of per-expert
tensors stacked at load into [E, in, out] (`ExpertStack`) and split back on export.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .compressed_tensors import CompressedTensor
from .config import ConfigError, LayerSpec, ModelConfig, MoESpec, hf_int
from .host_arrays import HostArray, normalize_box
from .linear import Weight, linear
from .safetensors_io import CheckpointError


# ------------------------------------------------------------------------------- routing
def route(spec: MoESpec, router: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(weights f32[N, k], experts i32[N, k]) of tokens x [N, hidden] under router
    [hidden, E]: softmax over all E logits, the k largest (ties: the lower expert id, as
    `lax.top_k`), renormalised over the k when `norm_topk_prob`."""
    logits = jnp.einsum("nh,he->ne", x.astype(jnp.float32), router.astype(jnp.float32),
                        preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, spec.top_k)
    if spec.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def router_logits(router: jax.Array, x: jax.Array) -> jax.Array:
    """f32[..., E]: the logits `route` ranks (tests compare its choice to HF's)."""
    return jnp.einsum("...h,he->...e", x.astype(jnp.float32), router.astype(jnp.float32),
                      preferred_element_type=jnp.float32)


# ------------------------------------------------------------------- grouped expert matmul
def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Rows x [M, in] sorted by group, group g's `group_sizes[g]` rows times w[g] [in, out]
    -> [M, out] in x's dtype (float32 accumulation). XLA's ragged dot: no row meets another
    group's weights. Rows past sum(group_sizes) come out zero."""
    y = jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes,
                           preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def grouped_matmul_reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """grouped_matmul by the definition: each row's group from the cumulative sizes, then
    that group's weights gathered per row (tests only: M copies of a weight matrix)."""
    ends = jnp.cumsum(group_sizes)
    row = jnp.arange(x.shape[0])
    group = jnp.searchsorted(ends, row, side="right")
    valid = row < ends[-1]
    wg = w[jnp.minimum(group, w.shape[0] - 1)].astype(jnp.float32)
    y = jnp.einsum("mi,mio->mo", x.astype(jnp.float32), wg)
    return jnp.where(valid[:, None], y, 0.0).astype(x.dtype)


def _swiglu(x: jax.Array, gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


def _dot(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


def grouped_mlp_ragged(xs: jax.Array, sizes: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                       w_down: jax.Array) -> jax.Array:
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


def grouped_mlp_tiled(xs: jax.Array, sizes: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                      w_down: jax.Array, tile: int | None = None) -> jax.Array:
    """`grouped_mlp_ragged`'s result by a loop over row tiles, for XLA:CPU, whose lowering of
    `ragged_dot` multiplies every row by every group's weights and masks (E times the work;
    scripts/bench/bench_moe_cpu.py measures it). Each group is padded to a whole number of
    tiles of `tile` rows (the padded layout's size is static: M + E * (tile - 1), rounded up),
    and a `fori_loop` whose trip count is the data's tile count (a while loop: tiles past it
    are not run) computes one tile through its expert's gate / up / down weights per step.
    Work: the real rows plus under one tile of padding per non-empty group."""
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
        def w(stack: jax.Array) -> jax.Array:  # the tile's expert's weights, read in place
            return jax.lax.dynamic_index_in_dim(stack, tile_group[i], keepdims=False)

        xt = jax.lax.dynamic_slice_in_dim(xp, i * t, t)
        h = _swiglu(xt, _dot(xt, w(w_gate)), _dot(xt, w(w_up)))
        return jax.lax.dynamic_update_slice_in_dim(yp, _dot(h, w(w_down)), i * t, 0)

    yp = jax.lax.fori_loop(0, padded_ends[-1] // t, step, jnp.zeros((slots, hidden), xs.dtype))
    return jnp.take(yp, pos, axis=0)


def grouped_mlp(xs: jax.Array, sizes: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                w_down: jax.Array) -> jax.Array:
    """The grouped expert MLP per backend, chosen where the step is lowered (so an export
    for TPU / CUDA from a CPU host gets the ragged dot): the tile loop on CPU, XLA's ragged
    dot elsewhere."""
    return jax.lax.platform_dependent(xs, sizes, w_gate, w_up, w_down,
                                      cpu=grouped_mlp_tiled, default=grouped_mlp_ragged)


GroupedMLP = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def expert_mlp(x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate: jax.Array,
               w_up: jax.Array, w_down: jax.Array, mlp: GroupedMLP = grouped_mlp
               ) -> jax.Array:
    """sum_j weights[n, j] * MLP_{experts[n, j]}(x[n]) for x [N, hidden], the k choices per
    token as `route` gives them; stacked weights [E, hidden, I] (gate, up), [E, I, hidden]
    (down). Sort by expert, grouped matmuls, un-sort, weight, sum."""
    n, k = experts.shape
    num_experts = w_gate.shape[0]
    flat = experts.reshape(-1)  # pair p = token p // k, choice p % k
    order = jnp.argsort(flat, stable=True)  # pairs sorted by expert
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    xs = jnp.take(x, order // k, axis=0)
    ys = mlp(xs, sizes, w_gate, w_up, w_down)
    # The inverse permutation gathers each pair's row back (a gather, not a scatter-add:
    # the k contributions of a token are then summed in one fixed order).
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=order.dtype))
    y = jnp.take(ys, inverse, axis=0).reshape(n, k, -1).astype(jnp.float32)
    return jnp.einsum("nkh,nk->nh", y, weights.astype(jnp.float32)).astype(x.dtype)


def moe_mlp(spec: MoESpec, lp: Any, h: jax.Array) -> jax.Array:
    """The MoE MLP block on normed h [..., hidden] with one layer's params `lp` (fields
    `router`, `we_gate`, `we_up`, `we_down`; with a shared expert `ws_gate`, `ws_up`,
    `ws_down`, `ws_router`) -> [..., hidden]."""
    lead, hidden = h.shape[:-1], h.shape[-1]
    x = h.reshape(-1, hidden)
    weights, experts = route(spec, lp.router, x)
    out = expert_mlp(x, weights, experts, lp.we_gate, lp.we_up, lp.we_down)
    if spec.shared_intermediate_size:
        out = out + _shared_expert(lp, x)
    return out.reshape(*lead, hidden)


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
    weights, experts = route(spec, lp.router, x)
    num_experts = lp.we_gate.shape[0]
    comb = jnp.zeros((x.shape[0], num_experts), jnp.float32)
    comb = comb.at[jnp.arange(x.shape[0])[:, None], experts].add(weights)
    f32 = jnp.float32
    g = jnp.einsum("nh,ehi->nei", x, lp.we_gate.astype(f32))
    u = jnp.einsum("nh,ehi->nei", x, lp.we_up.astype(f32))
    y = jnp.einsum("nei,eih->neh", jax.nn.silu(g) * u, lp.we_down.astype(f32))
    out = jnp.einsum("neh,ne->nh", y, comb)
    if spec.shared_intermediate_size:
        out = out + _shared_expert(lp, x)
    return out.reshape(*lead, hidden).astype(h.dtype)


# ------------------------------------------------------------- the families' shared parts
@struct.dataclass
class MoELayerParams:
    """Per-layer weights of an MoE decoder of sparse layers only, stacked on a leading layer
    axis L. A model whose dense and sparse layers mix (Qwen3-MoE `mlp_only_layers` /
    `decoder_sparse_step`; `MixedMoELayerParams`) has both kinds of MLP stacked over all L,
    zeros on the layers of the other kind (never read: the layer's spec picks its MLP).
    Cost: those zeros' memory; a model of sparse layers only (every Qwen3-MoE / Mixtral
    release) has no dense MLP fields at all."""

    attn_norm: jax.Array  # f[L, hidden]
    wq: Weight  # f[L, hidden, num_heads * head_dim]
    wk: Weight  # f[L, hidden, num_kv_heads * head_dim]
    wv: Weight  # f[L, hidden, num_kv_heads * head_dim]
    wo: Weight  # f[L, num_heads * head_dim, hidden]
    mlp_norm: jax.Array  # f[L, hidden]
    router: jax.Array  # f[L, hidden, E]
    we_gate: jax.Array  # f[L, E, hidden, I_e]
    we_up: jax.Array  # f[L, E, hidden, I_e]
    we_down: jax.Array  # f[L, E, I_e, hidden]
    bq: jax.Array | None = None  # f[L, num_heads * head_dim]   (attention_bias)
    bk: jax.Array | None = None  # f[L, num_kv_heads * head_dim] (attention_bias)
    bv: jax.Array | None = None  # f[L, num_kv_heads * head_dim] (attention_bias)
    q_norm: jax.Array | None = None  # f[L, head_dim] (qk_norm)
    k_norm: jax.Array | None = None  # f[L, head_dim] (qk_norm)


@struct.dataclass
class MixedMoELayerParams(MoELayerParams):
    """MoELayerParams plus what the Qwen-MoE models may have: dense layers' MLP between
    sparse ones, and a shared expert."""

    # dense layers' MLP (a model with dense layers between sparse ones)
    w_gate: Weight | None = None  # f[L, hidden, intermediate]
    w_up: Weight | None = None  # f[L, hidden, intermediate]
    w_down: Weight | None = None  # f[L, intermediate, hidden]
    # the shared expert (Qwen2-MoE)
    ws_gate: Weight | None = None  # f[L, hidden, I_s]
    ws_up: Weight | None = None  # f[L, hidden, I_s]
    ws_down: Weight | None = None  # f[L, I_s, hidden]
    ws_router: jax.Array | None = None  # f[L, hidden, 1] (shared_expert_gate)


# The stacked experts' fields (not `LINEAR_FIELDS`: the CPU dense kernel's packing and the
# quantization options do not cover them; `quantized_params` refuses quantizing a model
# that has them).
EXPERT_FIELDS = ("we_gate", "we_up", "we_down")
# Tensor parallelism: each expert's intermediate axis split as the dense MLP's is (gate / up
# outputs, down inputs; the down projection's partial sums are all-reduced); the router
# replicated (every device routes every token alike).
TP_LAYOUT = {"attn_norm": "rep", "wq": "col", "wk": "col", "wv": "col", "wo": "row",
             "mlp_norm": "rep", "router": "rep", "we_gate": "expert_col",
             "we_up": "expert_col", "we_down": "expert_row",
             "bq": "vec", "bk": "vec", "bv": "vec", "q_norm": "rep", "k_norm": "rep",
             "w_gate": "col", "w_up": "col", "w_down": "row",
             "ws_gate": "col", "ws_up": "col", "ws_down": "row", "ws_router": "rep"}
KV_FIELDS = ("wk", "wv", "bk", "bv")
LINEAR_FIELDS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "ws_gate", "ws_up",
                 "ws_down")
# The dense MLP fields and the MoE fields: which a layer has depends on its spec.
DENSE_MLP_FIELDS = ("w_gate", "w_up", "w_down")
SPARSE_FIELDS = ("router", *EXPERT_FIELDS, "ws_gate", "ws_up", "ws_down", "ws_router")


def hf_num_experts(d: Mapping[str, object], default: int, source: str) -> int:
    """The expert count of an HF MoE config: `num_experts` (the Hub's Qwen configs) or
    `num_local_experts` (Mixtral, and transformers 5's name for Qwen3-MoE's, which it writes);
    both present must agree."""
    given = {k: d[k] for k in ("num_experts", "num_local_experts") if d.get(k) is not None}
    values = {hf_int(v, k, source) for k, v in given.items()}
    if len(values) > 1:
        raise ConfigError(f"{source}: num_experts={given['num_experts']!r} and "
                          f"num_local_experts={given['num_local_experts']!r} disagree")
    n = values.pop() if values else default
    if n < 0:
        raise ConfigError(f"{source}: num_experts={n} must not be negative")
    return n


def family_tables(layer_params: type) -> tuple[dict[str, str], tuple[str, ...]]:
    """(TP_LAYOUT, LINEAR_FIELDS) restricted to the fields of a family's layer params."""
    fields = layer_params.__dataclass_fields__
    return ({f: k for f, k in TP_LAYOUT.items() if f in fields},
            tuple(f for f in LINEAR_FIELDS if f in fields))


def sparse_layers(d: Mapping[str, object], num_layers: int, source: str) -> list[bool]:
    """Which layers are sparse under Qwen-MoE's `decoder_sparse_step` / `mlp_only_layers`
    (transformers: layer i is sparse unless listed in mlp_only_layers, if num_experts > 0 and
    (i + 1) % decoder_sparse_step == 0)."""
    step = hf_int(d.get("decoder_sparse_step", 1), "decoder_sparse_step", source)
    if step < 1:
        raise ConfigError(f"{source}: decoder_sparse_step={step} must be a positive integer")
    only = d.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers
            for i in only):
        raise ConfigError(f"{source}: mlp_only_layers={only!r} must list layer indices below "
                          f"num_hidden_layers={num_layers}")
    return [i not in only and (i + 1) % step == 0 for i in range(num_layers)]


def moe_param_shapes(cfg: ModelConfig, base: dict[str, tuple[int, ...]]
                     ) -> dict[str, tuple[int, ...]]:
    """`base` (the attention / norm / head shapes) plus the MLP fields the layers need."""
    L, H = cfg.num_layers, cfg.hidden_size
    specs = cfg.layer_specs
    moe = next((s.moe for s in specs if s.moe is not None), None)
    shapes = dict(base)
    if moe is not None:
        E, I = moe.num_experts, moe.intermediate_size
        shapes.update({"layers.router": (L, H, E), "layers.we_gate": (L, E, H, I),
                       "layers.we_up": (L, E, H, I), "layers.we_down": (L, E, I, H)})
        S = moe.shared_intermediate_size
        if S:
            shapes.update({"layers.ws_gate": (L, H, S), "layers.ws_up": (L, H, S),
                           "layers.ws_down": (L, S, H), "layers.ws_router": (L, H, 1)})
    if any(s.moe is None for s in specs):
        I = cfg.intermediate_size
        shapes.update({"layers.w_gate": (L, H, I), "layers.w_up": (L, H, I),
                       "layers.w_down": (L, I, H)})
    return shapes


def _layer_has(spec: LayerSpec, field: str) -> bool:
    """Whether a layer of `spec` has `field` in its checkpoint (a sparse layer has no dense
    MLP, a dense one no router / experts)."""
    if field in DENSE_MLP_FIELDS:
        return spec.moe is None
    return spec.moe is not None or field not in SPARSE_FIELDS


class ExpertStack:
    """A layer's E per-expert checkpoint tensors, each [out, in] (HF linears), seen as the
    stacked [E, in, out]: a box reads, for each expert it covers, only the rows / columns it
    covers, transposed (`host_arrays`' contract)."""

    def __init__(self, parts: Sequence[HostArray]) -> None:
        out, inp = parts[0].shape
        self.parts, self.shape = tuple(parts), (len(parts), inp, out)
        self.dtype = parts[0].dtype

    @property
    def ndim(self) -> int:
        return 3

    def __getitem__(self, index: object) -> np.ndarray:
        e, i, o = normalize_box(index, self.shape, "expert stack")
        rows = [np.asarray(self.parts[j][o, i]).T for j in range(e.start, e.stop)]
        if not rows:
            return np.zeros((0, i.stop - i.start, o.stop - o.start), self.dtype)
        return np.ascontiguousarray(np.stack(rows))

    def __repr__(self) -> str:
        return f"ExpertStack({len(self.parts)} x {self.parts[0]!r})"


def hf_layer_part(cfg: ModelConfig, names: Mapping[str, tuple[str, bool]],
                  expert_names: Mapping[str, str], field: str, i: int, suffix: str,
                  fetch: Callable[[str, tuple[int, ...]], HostArray]) -> HostArray:
    """Layer i's checkpoint tensor(s) of `field` at the stacked per-layer shape
    (`hf_loader`'s hook): an expert field gathers its E tensors `expert_names[field]`
    (formatted with the expert index) into an `ExpertStack`; a field the layer does not have
    (the other kind of MLP) is zeros, read from nothing."""
    from .families import family  # a family module's function: the registry imports it

    spec = cfg.layer_specs[i]
    stacked = family(cfg).param_shapes(cfg)[f"layers.{field}"][1:]
    transpose = names[field][1]
    if not _layer_has(spec, field):
        return np.broadcast_to(np.float32(0), stacked[::-1] if transpose else stacked)
    if field in EXPERT_FIELDS:
        E, inp, out = stacked
        parts = [fetch(expert_names[field].format(e=e), (out, inp)) for e in range(E)]
        if isinstance(parts[0], CompressedTensor):
            # Read through it, the experts would be dequantized to float while the rest keeps
            # the checkpoint's scheme: refused rather than silently several times larger.
            raise CheckpointError(
                f"layer {i}: {expert_names[field].format(e=0)} is stored quantized "
                "(compressed-tensors): quantized expert weights are not supported yet")
        return ExpertStack(parts)
    return fetch(suffix, stacked)


def hf_layer_export(cfg: ModelConfig, expert_names: Mapping[str, str], field: str, i: int,
                    t: np.ndarray) -> np.ndarray | dict[str, np.ndarray] | None:
    """The inverse of `hf_layer_part` on one layer's tensor: an expert stack [E, in, out] as
    {suffix: [out, in]} per expert; None for the MLP kind the layer does not have."""
    spec = cfg.layer_specs[i]
    if not _layer_has(spec, field):
        return None
    if field in EXPERT_FIELDS:
        return {expert_names[field].format(e=e): np.ascontiguousarray(t[e].T)
                for e in range(t.shape[0])}
    return t


def random_params(template: Any, key: jax.Array, dtype: jnp.dtype, scale: float) -> Any:
    """Random leaves for a params template of ShapeDtypeStructs: norms near 1, the rest
    scale * N(0, 1) (tests, benchmarks)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(template)
    keys = jax.random.split(key, max(len(flat), 1))
    out = []
    for k, (path, leaf) in zip(keys, flat):
        noise = jax.random.normal(k, leaf.shape, jnp.float32)
        one = "norm" in jax.tree_util.keystr(path)
        out.append(((1.0 + 0.1 * noise) if one else scale * noise).astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def moe_spec_of(cfg: ModelConfig) -> MoESpec | None:
    return next((s.moe for s in cfg.layer_specs if s.moe is not None), None)


def with_moe(spec: LayerSpec, moe: MoESpec | None) -> LayerSpec:
    return dataclasses.replace(spec, moe=moe)
