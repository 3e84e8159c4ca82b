"""Expert parallelism (EP): an MoE layer's experts split whole over the tensor-parallel devices.

Layout (`--enable-expert-parallel`, `placement.param_specs(..., expert_parallel=True)`): the
expert stacks [L, E, in, out] are split on E over the mesh's "model" axis, so device d holds
experts d * E / P .. (d + 1) * E / P - 1 whole (P = tensor_parallel_size; E / P experts'
bytes per device), instead of TP's 1 / P of every expert's intermediate axis. Attention, the
dense layers' MLP, the embeddings and the LM head stay tensor parallel; the router is
replicated; a shared expert (Qwen2-MoE) stays split on its intermediate axis as under TP.
Data-parallel replicas are separate engines (each its own scheduler and KV pages), so the
experts are split over one replica's tensor-parallel devices only, never across replicas.

Data flow of one sparse layer (`ep_moe_mlp`, in the jitted step, under `jax.shard_map` over
the "model" axis), dispatch "psum":
  h [N, hidden], replicated: attention's all-reduce already left every token on every device
  -> every device routes every token (the same float32 router on the same numbers: the same
     choice everywhere; h is the same bits on every device, an all-reduce's one result)
  -> `moe_block.expert_mlp` with this device's E / P experts (`first_expert` = d * E / P):
     the (token, expert) pairs of local experts sorted into E / P groups, the others sorted
     past sum(sizes), where the grouped matmul does no work for them; local results weighted
     and summed per token: this device's partial [N, hidden] (zero where a token chose no
     local expert)
  -> plus the shared expert's partial sum over this device's slice of its width
  -> one psum over "model" (an all-reduce of [N, hidden] in the activation dtype): the layer's
     output, replicated, as TP's MLP ends.
No token is dropped and the shapes are static: each device's grouped matmul takes N * k rows
(its worst case: every pair on its experts), of which only its own pairs are computed.

Collective bytes per token, Qwen3-30B-A3B (hidden 2048, 128 experts, top-8, 48 layers, bf16:
a token's hidden vector is 4096 B) on P = 8 chips, per MoE layer:
  psum (this module): a ring all-reduce of [N, hidden] sends 2 (P - 1) / P x 4096 = 7168 B per
  token from each device (57344 B over the 8), the same as TP's MLP all-reduce; 48 layers:
  344064 B (336 KiB) per token per device, beside attention's equal all-reduce.
  all-to-all (tokens sharded N / P per device; attention's all-reduce becomes a
  reduce-scatter and an all-gather, the same bytes): each token's k pairs go to their experts'
  devices, (P - 1) / P of them remote, and come back: 2 k (P - 1) / P x 4096 = 57344 B per
  token (from its own device), i.e. 57344 / P = 7168 B per step token per device: equal to
  psum at k = P = 8. Sent once per destination device instead of once per pair (8 of 128
  experts touch 5.34 of the 8 devices on average, 4.67 remote) it is 38273 B per token, 4784 B
  per step token per device (0.67 x psum), before the exchange of the ragged counts and
  with receive buffers sized for the worst case (every pair on one device: P times the mean).
  In general psum costs 2 (P - 1) / P x hidden per token per device whatever k, all-to-all
  2 k (P - 1) / P^2 x hidden: all-to-all wins by P / k when k < P (Mixtral's top-2 on 8
  chips: 4x fewer bytes) and grows better as P grows past k (EP over several hosts).
Chosen: psum. At Qwen3-30B-A3B's k = P = 8 on one host the bytes are equal (within 0.67x
deduplicated), and it needs no ragged buffers, no count exchange and no second layout of the
activations: one all-reduce per layer, like TP. all-to-all is the dispatch to add for
P > k: `DISPATCHES` selects the function by name, and a new entry plugs in there.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from .config import ModelConfig, MoESpec
from .moe_block import expert_mlp, grouped_mlp, route, tile_rows
# A dispatch: (spec, one layer's params, x [N, hidden] replicated, mesh, the mesh axis the
# experts are split over) -> [N, hidden] replicated; it owns its shard_map and collectives.
Dispatch = Callable[[MoESpec, Any, jax.Array, Mesh, str], jax.Array]
DEFAULT_DISPATCH = "psum"
NOT_IMPLEMENTED = {
    "all_to_all": "expert-parallel dispatch 'all_to_all' (ragged all-to-all of the pairs to "
                  "their experts' devices) is not implemented; 'psum' is (models/"
                  "moe_parallel.py compares their bytes)",
}


def check_expert_parallel(cfg: ModelConfig, ep: int) -> None:
    """ValueError naming what stops `cfg` from running with its experts split over `ep`
    devices: a model without experts, num_experts that ep does not divide, a shared expert
    whose width it does not divide."""
    moe = next((s.moe for s in cfg.layer_specs if s.moe is not None), None)
    if moe is None:
        raise ValueError(f"enable_expert_parallel: model_type={cfg.model_type!r} has no "
                         "experts (no mixture-of-experts layer) to split over devices")
    if moe.router_bias or moe.expert_bias or moe.activation != "silu":
        raise ValueError(f"enable_expert_parallel: model_type={cfg.model_type!r} has biased or "
                         f"clamped experts (activation={moe.activation!r}), which expert "
                         "parallelism does not split yet; use tensor parallelism")
    if ep < 2:
        raise ValueError(f"enable_expert_parallel needs tensor_parallel_size > 1 (the experts "
                         f"are split over its devices); got {ep}")
    if moe.num_experts % ep:
        raise ValueError(f"enable_expert_parallel: num_experts={moe.num_experts} is not "
                         f"divisible by the expert-parallel size {ep} (tensor_parallel_size)")
    if moe.shared_intermediate_size % ep:
        raise ValueError(f"enable_expert_parallel: shared_expert_intermediate_size="
                         f"{moe.shared_intermediate_size} is not divisible by the "
                         f"expert-parallel size {ep} (tensor_parallel_size)")


def _shared_partial(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
                    router: jax.Array) -> jax.Array:
    """This device's part of the shared expert: its slice of the width (gate / up columns,
    down rows), times the replicated sigmoid gate; summed over devices by the caller's
    psum (the gate is a per-token scalar, so it distributes over the sum)."""
    dot = lambda a, w: jnp.dot(a, w.astype(a.dtype), preferred_element_type=jnp.float32)  # noqa: E731
    h = (jax.nn.silu(dot(x, gate)) * dot(x, up)).astype(x.dtype)
    g = jax.nn.sigmoid(dot(x, router))
    return (g * dot(h, down)).astype(x.dtype)


def _psum_dispatch(spec: MoESpec, lp: Any, x: jax.Array, mesh: Mesh, axis: str) -> jax.Array:
    """Replicated tokens, local experts, one all-reduce (the module docstring)."""
    ep = mesh.shape[axis]
    num_local = spec.num_experts // ep
    # The tile loop's rows per tile (CPU) from the expected rows per expert, N * k / E,
    # which is each device's too (N * k / P pairs over E / P experts), not from the N * k
    # rows its buffer holds.
    tile = tile_rows(x.shape[0] * spec.top_k, spec.num_experts)
    shared = bool(spec.shared_intermediate_size)

    def local(x: jax.Array, router: jax.Array, w_gate: jax.Array, w_up: jax.Array,
              w_down: jax.Array, *shared_w: jax.Array) -> jax.Array:
        weights, experts = route(spec, router, x)
        first = jax.lax.axis_index(axis) * num_local
        out = expert_mlp(x, weights, experts, w_gate, w_up, w_down,
                         lambda *a: grouped_mlp(*a, tile=tile), first)
        if shared_w:
            out = out + _shared_partial(x, *shared_w)
        return jax.lax.psum(out, axis)

    experts_spec = P(axis, None, None)  # one layer's [E, in, out]: split on E
    args = [x, lp.router, lp.we_gate, lp.we_up, lp.we_down]
    specs = [P(), P(), experts_spec, experts_spec, experts_spec]
    if shared:
        args += [lp.ws_gate, lp.ws_up, lp.ws_down, lp.ws_router]
        specs += [P(None, axis), P(None, axis), P(axis, None), P()]
    for name, a in zip(("router", "we_gate", "we_up", "we_down", "ws_gate", "ws_up",
                        "ws_down", "ws_router"), args[1:]):
        if not isinstance(a, jax.Array):  # quantized / packed weights: not under EP
            raise ValueError(f"enable_expert_parallel: layers.{name} is a "
                             f"{type(a).__name__}; expert parallelism takes float weights")
    # check_vma off: the CPU tile loop starts its carry from (replicated) zeros and fills it
    # from the per-device weights, which the checker rejects; the output is the psum's,
    # the same on every device.
    return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=P(),
                         check_vma=False)(*args)


DISPATCHES: dict[str, Dispatch] = {"psum": _psum_dispatch}


def dispatch_fn(name: str) -> Dispatch:
    """The dispatch called `name`; ValueError naming it when there is none."""
    if name in NOT_IMPLEMENTED:
        raise ValueError(NOT_IMPLEMENTED[name])
    if name not in DISPATCHES:
        raise ValueError(f"expert-parallel dispatch {name!r} is not one of {sorted(DISPATCHES)}")
    return DISPATCHES[name]


def ep_moe_mlp(spec: MoESpec, lp: Any, h: jax.Array, mesh: Mesh, axis: str,
               dispatch: str = DEFAULT_DISPATCH) -> jax.Array:
    """`moe_block.moe_mlp` with the layer's experts split over `mesh`'s `axis` (the
    tensor-parallel "model" axis): normed h [..., hidden] (replicated) -> [..., hidden]
    (replicated)."""
    ep = mesh.shape[axis]
    if spec.num_experts % ep:
        raise ValueError(f"num_experts={spec.num_experts} is not divisible by the "
                         f"expert-parallel size {ep}")
    lead, hidden = h.shape[:-1], h.shape[-1]
    out = dispatch_fn(dispatch)(spec, lp, h.reshape(-1, hidden), mesh, axis)
    return out.reshape(*lead, hidden)
