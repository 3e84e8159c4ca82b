"""Tensor parallelism over a JAX device mesh: which axis of each weight and of the KV pages
lives on which device, for XLA's SPMD partitioner to compile one program for all of them.

Data flow: `tensor_parallel_size` (EngineConfig) -> `make_tp_mesh` (a 1-D Mesh, axis
"model") -> `tp_layout(model_cfg, tp)` decides whether KV heads must be replicated ->
`shard_params` (replicates KV heads if needed, then `device_put`s every array onto its
NamedSharding) -> the runner places the KV pages with `kv_sharding` and every step's inputs
replicated; `paged_forward(..., mesh=mesh)` runs attention under `jax.shard_map`, each device on
its own heads, and the rest of the step is partitioned by XLA from these shardings.

Layout (Megatron style, per layer):
  wq / wk / wv (and their biases): columns split by head over "model";
  wo: rows split by head -> one all-reduce after the attention block;
  w_gate / w_up: columns split; w_down: rows split -> one all-reduce after the MLP;
  embed [vocab, hidden] and lm_head [hidden, vocab]: split by vocabulary (replicated when tp
  does not divide the vocabulary);
  norms (and q/k norms, shared by heads): replicated;
  KV pages [L * num_pages, 2 * Hkv, page_size, D]: split on the 2 * Hkv axis, so each device
  holds the pages of its own KV heads (rows 2h / 2h + 1 stay together).
KV heads that do not divide by tp: when tp is a multiple of num_kv_heads, each KV head is
replicated tp / num_kv_heads times (so every device holds exactly one, shared by its query
heads, as in vLLM); per-device KV bytes are then 1 / num_kv_heads of one copy instead of 1 / tp.
num_heads must divide by tp.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .models.config import ModelConfig
from .models.llama import LayerParams, LlamaParams
from .models.paged import MODEL_AXIS


def make_tp_mesh(tp: int, devices: list | None = None) -> Mesh:
    """A 1-D mesh of the first `tp` devices (local ones by default), axis "model"."""
    devices = list(devices if devices is not None else jax.devices())
    if tp < 1 or tp > len(devices):
        raise ValueError(f"tensor_parallel_size={tp} needs {tp} devices; {len(devices)} "
                         f"available ({devices[0].platform if devices else 'none'})")
    return Mesh(np.array(devices[:tp]), (MODEL_AXIS,))


def kv_head_replication(cfg: ModelConfig, tp: int) -> int:
    """How many copies of each KV head tp devices need (1: none)."""
    if cfg.num_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide num_heads={cfg.num_heads}")
    if cfg.num_kv_heads % tp == 0:
        return 1
    if tp % cfg.num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} and num_kv_heads={cfg.num_kv_heads}: one "
                         "must divide the other")
    return tp // cfg.num_kv_heads


def tp_model_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config the sharded model runs with (KV heads replicated where needed)."""
    rep = kv_head_replication(cfg, tp)
    return cfg if rep == 1 else dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * rep)


def _repeat_heads(w: jax.Array | None, num_heads: int, rep: int) -> jax.Array | None:
    """[..., Hkv * D] -> [..., Hkv * rep * D], each head's block repeated `rep` times."""
    if w is None or rep == 1:
        return w
    lead, width = w.shape[:-1], w.shape[-1]
    heads = w.reshape(*lead, num_heads, width // num_heads)
    return jnp.repeat(heads, rep, axis=-2).reshape(*lead, width * rep)


def _specs(params: LlamaParams, tp: int) -> LlamaParams:
    col = P(None, None, MODEL_AXIS)   # [L, in, out]: split outputs
    row = P(None, MODEL_AXIS, None)   # [L, in, out]: split inputs
    vec = P(None, MODEL_AXIS)         # [L, out] biases of split outputs
    rep = P()
    lp = params.layers
    layers = LayerParams(
        attn_norm=rep, wq=col, wk=col, wv=col, wo=row, mlp_norm=rep, w_gate=col, w_up=col,
        w_down=row, bq=None if lp.bq is None else vec, bk=None if lp.bk is None else vec,
        bv=None if lp.bv is None else vec, q_norm=None if lp.q_norm is None else rep,
        k_norm=None if lp.k_norm is None else rep)
    # A vocabulary that tp does not divide (only toy ones) stays replicated.
    by_vocab = params.embed.shape[0] % tp == 0
    return LlamaParams(embed=P(MODEL_AXIS, None) if by_vocab else rep, layers=layers,
                       final_norm=rep, lm_head=None if params.lm_head is None else (
                           P(None, MODEL_AXIS) if by_vocab else rep))


def shard_params(params: LlamaParams, cfg: ModelConfig, mesh: Mesh) -> LlamaParams:
    """Replicate KV heads if tp needs it, then place every array on its sharding."""
    tp = mesh.shape[MODEL_AXIS]
    rep = kv_head_replication(cfg, tp)
    if rep > 1:
        lp = params.layers
        params = dataclasses.replace(params, layers=dataclasses.replace(
            lp, wk=_repeat_heads(lp.wk, cfg.num_kv_heads, rep),
            wv=_repeat_heads(lp.wv, cfg.num_kv_heads, rep),
            bk=_repeat_heads(lp.bk, cfg.num_kv_heads, rep),
            bv=_repeat_heads(lp.bv, cfg.num_kv_heads, rep)))
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), _specs(params, tp),
                             is_leaf=lambda x: isinstance(x, P))
    return jax.device_put(params, shardings)


def kv_sharding(mesh: Mesh) -> NamedSharding:
    """KV pages [L * num_pages, 2 * Hkv, page_size, D] split by KV head."""
    return NamedSharding(mesh, P(None, MODEL_AXIS, None, None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
