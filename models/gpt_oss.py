"""gpt-oss (`GptOssForCausalLM`): one family module on the shared blocks.

Layers (transformers' modeling_gpt_oss): pre-norm attention with q/k/v/o biases, a learned
attention sink per query head (`LayerSpec.attention_sinks`: the layer's `sinks` go to the
ragged paged attention kernel), sliding-window (`sliding_window`, 128 in the releases) and
full layers as `layer_types` says (alternating), YaRN RoPE (`rope_scaling` / `rope_parameters`
type "yarn", cos / sin times its attention_factor); the MLP is the shared MoE block
(`models/moe_block.py`) with gpt-oss's options as `MoESpec` data: a router with a bias (top
`num_experts_per_tok` of the logits, softmax over those: `norm_topk_prob`), experts with
biases on gate / up and down, and the clamped SwiGLU (`swiglu_limit`, alpha `swiglu_alpha`
= 1.702: `moe_biased.expert_activation`).

Checkpoints: HF safetensors. The experts are stored per layer as one stack:
`mlp.experts.gate_up_proj` [E, hidden, 2I] with gate and up INTERLEAVED along the last axis
(gate = [..., ::2], up = [..., 1::2]), `gate_up_proj_bias` [E, 2I] likewise,
`down_proj` [E, I, hidden], `down_proj_bias` [E, hidden]; `hf_layer_part` views the
de-interleaved halves (`Interleaved`, reading only what a box asks) and `hf_layer_export`
interleaves them back. The released checkpoints keep the expert stacks in MXFP4
(`*_blocks` + `*_scales`, quantization_config quant_method "mxfp4"): `models/mxfp4.py`
dequantizes them at load into these float stacks. The config mapping is gpt_oss_config.py.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from . import moe
from .config import ModelConfig
from .gpt_oss_config import (ARCHITECTURES, config_dict_from_gguf,  # noqa: F401
                             config_from_hf, config_to_hf)
from .host_arrays import HostArray, normalize_box
from .linear import Weight
from .moe import EXPERT_FIELDS, KV_FIELDS  # noqa: F401  (the family's names)

GGUF_ARCHITECTURES: dict[str, str] = {}
GGUF_REFUSED = {"gpt-oss": "gpt-oss GGUF files are not supported yet (their MXFP4 expert "
                "tensors are not mapped); load the HF safetensors checkpoint"}
GGUF_PERMUTED: tuple[str, ...] = ()
GGUF_NAMES: dict[str, str] = {}
GGUF_LAYER_NAMES: dict[str, str] = {}


@struct.dataclass
class LayerParams(moe.MoELayerParams):
    """`moe.MoELayerParams` plus gpt-oss's biases and sinks."""

    bo: jax.Array | None = None  # f[L, hidden]       (attention_bias: o_proj's bias)
    sinks: jax.Array | None = None  # f[L, num_heads]  (attention-sink logits)
    router_bias: jax.Array | None = None  # f[L, E]
    be_gate: jax.Array | None = None  # f[L, E, I_e]
    be_up: jax.Array | None = None  # f[L, E, I_e]
    be_down: jax.Array | None = None  # f[L, E, hidden]


@struct.dataclass
class Params:
    """All weights of one model. `lm_head` is None when the embeddings are tied."""

    embed: Weight  # f[vocab, hidden]
    layers: LayerParams
    final_norm: jax.Array  # f[hidden]
    lm_head: Weight | None = None  # f[hidden, vocab]


TP_LAYOUT, LINEAR_FIELDS = moe.family_tables(LayerParams)
# Sinks split with the query heads; the gate / up biases with the experts' intermediate
# axis ([L, E, I]: "col" splits the last axis); the rest added after the all-reduce.
TP_LAYOUT = {**TP_LAYOUT, "bo": "rep", "sinks": "vec", "router_bias": "rep",
             "be_gate": "col", "be_up": "col", "be_down": "rep"}

HF_NAMES = {"embed": ("model.embed_tokens.weight", False),
            "final_norm": ("model.norm.weight", False),
            "lm_head": ("lm_head.weight", True)}
_ATTN = {"attn_norm": ("input_layernorm.weight", False),
         "wq": ("self_attn.q_proj.weight", True), "wk": ("self_attn.k_proj.weight", True),
         "wv": ("self_attn.v_proj.weight", True), "wo": ("self_attn.o_proj.weight", True),
         "bq": ("self_attn.q_proj.bias", False), "bk": ("self_attn.k_proj.bias", False),
         "bv": ("self_attn.v_proj.bias", False), "bo": ("self_attn.o_proj.bias", False),
         "sinks": ("self_attn.sinks", False),
         # MoELayerParams' qk-norm fields: gpt-oss has none (never in param_shapes)
         "q_norm": ("self_attn.q_norm.weight", False), "k_norm": ("self_attn.k_norm.weight", False),
         "mlp_norm": ("post_attention_layernorm.weight", False)}
# Expert fields are read by `hf_layer_part` (already [E, in, out], no transpose).
HF_LAYER_NAMES: dict[str, tuple[str, bool]] = {
    **_ATTN,
    "router": ("mlp.router.weight", True),
    "router_bias": ("mlp.router.bias", False),
    "we_gate": ("mlp.experts.gate_up_proj", False),
    "we_up": ("mlp.experts.gate_up_proj", False),
    "we_down": ("mlp.experts.down_proj", False),
    "be_gate": ("mlp.experts.gate_up_proj_bias", False),
    "be_up": ("mlp.experts.gate_up_proj_bias", False),
    "be_down": ("mlp.experts.down_proj_bias", False),
}
# field -> which half of the interleaved checkpoint stack it is (gate even, up odd columns).
_INTERLEAVED = {"we_gate": 0, "we_up": 1, "be_gate": 0, "be_up": 1}


class Interleaved:
    """Every other entry of a checkpoint tensor's last axis (from `parity`): HF's
    `gate_up_proj` [E, hidden, 2I] seen as gate [E, hidden, I] (parity 0) or up (1); a box
    reads only the columns it covers."""

    def __init__(self, base: HostArray, parity: int) -> None:
        self.base, self.parity = base, parity
        self.shape = (*base.shape[:-1], base.shape[-1] // 2)
        self.dtype = base.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, index: object) -> np.ndarray:
        *lead, last = normalize_box(index, self.shape, "interleaved gate/up")
        cols = slice(2 * last.start, 2 * last.stop)
        return np.ascontiguousarray(np.asarray(self.base[(*lead, cols)])[..., self.parity::2])


# --------------------------------------------------- checkpoint tensors <-> stacked params
def hf_layer_part(cfg: ModelConfig, field: str, i: int, suffix: str,
                  fetch: Callable[[str, tuple[int, ...]], HostArray]) -> HostArray:
    """Layer i's tensor of `field`: the gate / up halves of the interleaved stacks as views."""
    stacked = param_shapes(cfg)[f"layers.{field}"][1:]
    if field in _INTERLEAVED:
        whole = fetch(suffix, (*stacked[:-1], 2 * stacked[-1]))
        return Interleaved(whole, _INTERLEAVED[field])
    return fetch(suffix, stacked)


def hf_layer_export(cfg: ModelConfig, field: str, i: int, t: np.ndarray
                    ) -> np.ndarray | dict[str, np.ndarray] | None:
    """The inverse on one layer's tensor; a gate / up half goes out under its stack's name
    tagged `#0` / `#1`, joined by `hf_export_finish` once both halves are there."""
    if field in _INTERLEAVED:
        return {HF_LAYER_NAMES[field][0] + f"#{_INTERLEAVED[field]}": t}
    return t


def hf_export_finish(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF-named export tensors with the `#0` / `#1` halves `hf_layer_export` left joined
    into HF's interleaved stacks (gate on even, up on odd entries of the last axis)."""
    out = {n: t for n, t in tensors.items() if "#" not in n}
    for name in [n for n in tensors if n.endswith("#0")]:
        gate, up = tensors[name], tensors[name[:-2] + "#1"]
        joined = np.empty((*gate.shape[:-1], 2 * gate.shape[-1]), gate.dtype)
        joined[..., 0::2], joined[..., 1::2] = gate, up
        out[name[:-2]] = joined
    return out


# -------------------------------------------------------------------------------- params
def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of every Params/LayerParams field for `cfg` (absent: not used)."""
    L, H = cfg.num_layers, cfg.hidden_size
    spec = moe.moe_spec_of(cfg)
    E, I = spec.num_experts, spec.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "embed": (cfg.vocab_size, H), "final_norm": (H,),
        "layers.attn_norm": (L, H), "layers.mlp_norm": (L, H),
        "layers.wq": (L, H, cfg.q_size), "layers.wk": (L, H, cfg.kv_size),
        "layers.wv": (L, H, cfg.kv_size), "layers.wo": (L, cfg.q_size, H),
        "layers.sinks": (L, cfg.num_heads),
        "layers.router": (L, H, E), "layers.router_bias": (L, E),
        "layers.we_gate": (L, E, H, I), "layers.we_up": (L, E, H, I),
        "layers.we_down": (L, E, I, H),
        "layers.be_gate": (L, E, I), "layers.be_up": (L, E, I), "layers.be_down": (L, E, H)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (H, cfg.vocab_size)
    if cfg.attention_bias:
        shapes.update({"layers.bq": (L, cfg.q_size), "layers.bk": (L, cfg.kv_size),
                       "layers.bv": (L, cfg.kv_size), "layers.bo": (L, H)})
    return shapes


def abstract_params(cfg: ModelConfig, dtype: jnp.dtype) -> Params:
    """A Params of jax.ShapeDtypeStruct leaves (restore targets, memory estimates)."""
    shapes = param_shapes(cfg)

    def leaf(name: str) -> jax.ShapeDtypeStruct | None:
        return jax.ShapeDtypeStruct(shapes[name], dtype) if name in shapes else None

    layer_fields = {f: leaf(f"layers.{f}") for f in LayerParams.__dataclass_fields__}
    return Params(embed=leaf("embed"), layers=LayerParams(**layer_fields),
                  final_norm=leaf("final_norm"), lm_head=leaf("lm_head"))


def init_random_params(cfg: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.float32,
                       scale: float = 0.02) -> Params:
    """Random weights (tests, benchmarks); norms start near 1 so activations stay sane."""
    return moe.random_params(abstract_params(cfg, dtype), key, dtype, scale)
