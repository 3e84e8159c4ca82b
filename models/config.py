"""Model architecture config: the one frozen tree every model family is described by.

Data flow: an HF `config.json` dict (or the HF-shaped dict that the GGUF loader derives from
GGUF metadata) -> the family's `config_from_hf` (chosen by `families.config_from_hf` from
`architectures` / `model_type`) -> the frozen `ModelConfig` that the forward functions,
loaders and the engine read. Its `layer_specs` say what each layer is (a `LayerSpec`: window,
rope base, soft-cap, which blocks), `layer_groups` the runs of equal specs the step scans
one at a time. The family's `config_to_hf` goes back the other way so an export is loadable by
transformers and vLLM. No jax here: the scheduler side imports this too; the HF parsing
helpers below are shared by the families.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

# "proportional" (Gemma 4's global layers): the default frequencies of the layer's head dim
# on its first `partial_rotary_factor` of the pairs, the other pairs not rotated.
# "yarn": YaRN (gpt-oss), transformers' _compute_yarn_parameters.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "proportional", "yarn")
MLP_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # SwiGLU, GeGLU (HF `hidden_act` names)
# An MoE expert's activation: SwiGLU, or gpt-oss's clamped SwiGLU (`MoESpec`).
EXPERT_ACTIVATIONS = ("silu", "swiglu_clamped")


class ConfigError(ValueError):
    """A checkpoint config that jaxserve cannot serve; the message names the field."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `rope_type` is one of SUPPORTED_ROPE_TYPES."""

    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # proportional only: the fraction of the head's rotary pairs that rotate
    partial_rotary_factor: float = 1.0
    # yarn only (original_max_position_embeddings above too): the ramp between extrapolated
    # and interpolated frequencies over the rotations [beta_slow, beta_fast], its bounds
    # rounded outward when `truncate`; cos / sin are multiplied by `attention_factor`
    # (transformers' default 0.1 ln(factor) + 1, resolved when the config is parsed).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """A sparse mixture-of-experts MLP (`models/moe.py`) in place of the dense gated MLP.

    Routing: softmax over the `num_experts` router logits in float32, the `top_k` largest
    probabilities, renormalised to sum to 1 when `norm_topk_prob` (Qwen3-MoE's flag; Mixtral
    always: its softmax over the top-k logits is the same numbers). Each expert is a SwiGLU
    MLP of width `intermediate_size`. `shared_intermediate_size` > 0: a shared expert every
    token also goes through, scaled by sigmoid of its own gate (Qwen2-MoE).

    gpt-oss: `router_bias` (the router's logits get a bias [E] before the choice: top-k of the
    logits, softmax over the k, i.e. `norm_topk_prob`), `expert_bias` (each expert's gate / up
    and down projections add a bias), and `activation` "swiglu_clamped": gate clamped above
    at `swiglu_limit`, up to [-limit, limit], out = (up + 1) * gate * sigmoid(alpha * gate)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_intermediate_size: int = 0
    activation: str = "silu"  # one of EXPERT_ACTIVATIONS
    swiglu_alpha: float = 1.702  # swiglu_clamped only
    swiglu_limit: float = 7.0  # swiglu_clamped only
    router_bias: bool = False
    expert_bias: bool = False


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer is: its attention kind and which shared blocks it composes.

    Layers of equal spec are scanned together; a model whose layers differ (Gemma 3's five
    sliding-window layers per global one, each kind with its own rope base) is a tuple of
    these, not branches in the layer code.
    """

    sliding_window: int | None = None  # None: full (global) causal attention
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    query_scale: float = 1.0  # the attention's sm_scale (HF: head_dim ** -0.5, Gemma: q_pre_attn)
    soft_cap: float | None = None  # attention logit soft-cap: cap * tanh(s / cap) (Gemma 2)
    # A learned logit per query head joining the softmax denominator (gpt-oss; the layer's
    # `sinks` param, passed to the attention kernel).
    attention_sinks: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3)
    mlp_activation: str = "silu"  # silu: SwiGLU; gelu_pytorch_tanh: GeGLU (Gemma)
    norm_offset: float = 0.0  # RMSNorm scale (offset + w): 0 for Llama, 1 for Gemma's (1 + w)
    post_norms: bool = False  # also norm the attention and MLP outputs (Gemma's sandwich)
    # Layers of one model whose attention shapes differ (Gemma 4's global layers: a wider
    # head, fewer KV heads). None: the model-wide `head_dim` / `num_kv_heads`. The model-wide
    # values are then the widest (the stacked weights' and the KV pages' shape): a narrower
    # layer's heads are zero-padded to it and its KV heads repeated to it at load time, and
    # the attention block computes at the layer's own head dim (`blocks.attention`).
    head_dim: int | None = None
    num_kv_heads: int | None = None
    v_norm: bool = False  # a scale-free RMSNorm on each value head (Gemma 4)
    v_from_k: bool = False  # V is K's projection before k-norm (Gemma 4 attention_k_eq_v)
    layer_scalar: bool = False  # the layer's output times a per-layer weight (Gemma 4)
    # KV shared across layers (Gemma 4 num_kv_shared_layers): a layer with `kv_store` = s
    # hands its K/V (normed, rotated, at the model-wide shape) to later layers through slot
    # s of the scan's carry; a layer with `kv_reuse` = s computes no K/V of its own and uses
    # slot s's instead; its KV pages are the storing layer's (`kv_groups` gives it that
    # layer's group and slot), into which it writes the same K/V again (a no-op by value),
    # so paging, prefix caching and preemption need nothing new.
    kv_store: int | None = None
    kv_reuse: int | None = None
    # A layer whose MLP is narrower than the model's `intermediate_size` (Gemma 4's
    # double-wide MLP on KV-sharing layers makes the others the narrow ones): its gate / up
    # columns and down rows are zero-padded at load, which adds exact zeros. None: the model's.
    intermediate_size: int | None = None
    # A sparse MoE MLP instead of the dense one (Qwen3-MoE, Mixtral); None: the dense MLP.
    # Dense and sparse layers of one model differ in spec, so they scan in separate groups.
    moe: MoESpec | None = None

    @property
    def attention_type(self) -> str:
        """HF `layer_types` vocabulary."""
        return "full_attention" if self.sliding_window is None else "sliding_attention"


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """Layers [start, stop) share `spec`: one `lax.scan` over their stacked weights."""

    spec: LayerSpec
    start: int
    stop: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only model; `model_type` names its family module
    (`families.py`). The model-wide fields are the shape; `per_layer` (set by a family whose
    layers differ) overrides the uniform per-layer spec the other fields imply."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # Mistral-style window on every layer; None = full causal
    rope_scaling: RopeScaling = RopeScaling()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    embed_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden))
    final_soft_cap: float | None = None  # final logit soft-cap (Gemma 2)
    norm_offset: float = 0.0  # every RMSNorm scales by (offset + w); Gemma: 1
    per_layer: tuple[LayerSpec, ...] = ()  # () : every layer `uniform_spec()`
    # Per-layer inputs (Gemma 4's per-layer embeddings): each layer also gets a vector of
    # this size per token, from a token table of `per_layer_vocab_size` rows and a projection
    # of the embeddings (`blocks.per_layer_inputs`); 0: none.
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise ConfigError(f"rms_norm_eps={self.rms_norm_eps!r} must be a positive number")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ConfigError(f"rope_theta={self.rope_theta!r} must be a positive number")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"sliding_window={self.sliding_window!r} must be positive or null")
        if self.per_layer and len(self.per_layer) != self.num_layers:
            raise ConfigError(f"{len(self.per_layer)} layer specs for num_hidden_layers="
                              f"{self.num_layers}")
        for spec in self.layer_specs:
            if spec.rope_scaling.rope_type not in SUPPORTED_ROPE_TYPES:
                raise ConfigError(
                    f"rope_scaling.rope_type={spec.rope_scaling.rope_type!r} is not supported; "
                    f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
            if spec.mlp_activation not in MLP_ACTIVATIONS:
                raise ConfigError(f"hidden_act={spec.mlp_activation!r} is not supported; "
                                  f"supported: {', '.join(MLP_ACTIVATIONS)}")
            if spec.sliding_window is not None and spec.sliding_window <= 0:
                raise ConfigError(f"sliding_window={spec.sliding_window!r} must be positive")
            d = spec.head_dim
            if d is not None and not (isinstance(d, int) and 0 < d <= self.head_dim
                                      and d % 2 == 0):
                raise ConfigError(f"a layer's head_dim={d!r} must be a positive even integer "
                                  f"no larger than the model's head_dim={self.head_dim}")
            if spec.intermediate_size is not None and not (
                    0 < spec.intermediate_size <= self.intermediate_size):
                raise ConfigError(f"a layer's intermediate_size={spec.intermediate_size!r} must "
                                  f"be positive and no larger than {self.intermediate_size}")
            moe = spec.moe
            if moe is not None and not (0 < moe.top_k <= moe.num_experts
                                        and moe.intermediate_size > 0
                                        and moe.shared_intermediate_size >= 0):
                raise ConfigError(f"num_experts_per_tok={moe.top_k} must be in [1, num_experts="
                                  f"{moe.num_experts}] and the expert width "
                                  f"{moe.intermediate_size} positive")
            if moe is not None and moe.activation not in EXPERT_ACTIVATIONS:
                raise ConfigError(f"expert activation {moe.activation!r} is not supported; "
                                  f"supported: {', '.join(EXPERT_ACTIVATIONS)}")
            kv = spec.num_kv_heads
            if kv is not None and not (isinstance(kv, int) and kv > 0
                                       and self.num_kv_heads % kv == 0):
                raise ConfigError(f"a layer's num_key_value_heads={kv!r} must divide the "
                                  f"model's num_kv_heads={self.num_kv_heads}")

        stored: set[int] = set()
        for i, spec in enumerate(self.layer_specs):
            if spec.kv_reuse is not None and spec.kv_reuse not in stored:
                raise ConfigError(f"layer {i} reuses KV slot {spec.kv_reuse}, which no earlier "
                                  "layer stores")
            if spec.kv_store is not None:
                stored.add(spec.kv_store)
        if self.per_layer_input_size and self.per_layer_vocab_size <= 0:
            raise ConfigError("per-layer inputs need a positive per_layer_vocab_size")

    @property
    def kv_share_slots(self) -> int:
        """How many K/V slots layers hand on to later ones (`LayerSpec.kv_store`)."""
        return max((s.kv_store + 1 for s in self.layer_specs if s.kv_store is not None),
                   default=0)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def uniform_spec(self) -> LayerSpec:
        """The spec every layer has when `per_layer` is empty (the Llama family's layers)."""
        return LayerSpec(sliding_window=self.sliding_window, rope_theta=self.rope_theta,
                         rope_scaling=self.rope_scaling, query_scale=self.head_dim ** -0.5,
                         attention_bias=self.attention_bias, qk_norm=self.qk_norm,
                         norm_offset=self.norm_offset)

    @property
    def layer_specs(self) -> tuple[LayerSpec, ...]:
        return self.per_layer or (self.uniform_spec(),) * self.num_layers

    @property
    def layer_groups(self) -> tuple[LayerGroup, ...]:
        """Runs of consecutive layers of equal spec, in layer order."""
        groups: list[LayerGroup] = []
        for i, spec in enumerate(self.layer_specs):
            if groups and groups[-1].spec == spec:
                groups[-1] = dataclasses.replace(groups[-1], stop=i + 1)
            else:
                groups.append(LayerGroup(spec, i, i + 1))
        return tuple(groups)


# ----------------------------------------------------------------- HF config.json helpers
def hf_int(x: object, name: str, source: str) -> int:
    """An integer field of an HF config (a float that is whole is accepted)."""
    if (isinstance(x, bool) or not isinstance(x, (int, float))
            or (isinstance(x, float) and not x.is_integer())):
        raise ConfigError(f"{source}: field {name!r}={x!r} must be an integer")
    return int(x)


def opt_token_id(x: object) -> int | None:
    if isinstance(x, (list, tuple)):
        x = x[0] if x else None
    return None if x is None else int(x)  # type: ignore[call-overload]


def eos_ids(x: object) -> tuple[int, ...]:
    eos_list = x if isinstance(x, (list, tuple)) else ([] if x is None else [x])
    return tuple(int(i) for i in eos_list)


def hf_rope_theta(d: Mapping[str, object]) -> float:
    # transformers >= 5 moved rope_theta into `rope_parameters`.
    rp = d.get("rope_parameters")
    if isinstance(rp, Mapping) and "rope_theta" in rp:
        return float(rp["rope_theta"])  # type: ignore[arg-type]
    return float(d.get("rope_theta", 10000.0))  # type: ignore[arg-type]


def hf_rope_scaling(d: Mapping[str, object], source: str) -> RopeScaling:
    rs = d.get("rope_scaling")
    if rs is None:
        rp = d.get("rope_parameters")
        rs = rp if isinstance(rp, Mapping) else None
    if rs is None:
        return RopeScaling()
    if not isinstance(rs, Mapping):
        raise ConfigError(f"{source}: rope_scaling={rs!r} must be an object")
    rope_type = str(rs.get("rope_type", rs.get("type", "default")))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{source}: rope_scaling.rope_type={rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return RopeScaling()
    if rope_type == "yarn":
        return _yarn_scaling(rs, d, source)
    if rope_type == "proportional":
        prf = float(rs.get("partial_rotary_factor", 1.0))  # type: ignore[arg-type]
        if not 0.0 <= prf <= 1.0:
            raise ConfigError(f"{source}: rope_parameters.partial_rotary_factor={prf!r} must "
                              "be in [0, 1]")
        return RopeScaling(rope_type=rope_type, partial_rotary_factor=prf,
                           factor=float(rs.get("factor", 1.0)))  # type: ignore[arg-type]
    return RopeScaling(
        rope_type=rope_type,
        factor=float(rs.get("factor", 1.0)),  # type: ignore[arg-type]
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),  # type: ignore[arg-type]
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),  # type: ignore[arg-type]
        original_max_position_embeddings=int(
            rs.get("original_max_position_embeddings", 8192)),  # type: ignore[arg-type]
    )


def _yarn_scaling(rs: Mapping[str, object], d: Mapping[str, object],
                  source: str) -> RopeScaling:
    """YaRN's fields as transformers reads them (`_compute_yarn_parameters`): factor (None:
    max_position_embeddings / original_max_position_embeddings), attention_factor (None:
    from mscale / mscale_all_dim where both are given, else 0.1 ln(factor) + 1), beta_fast /
    beta_slow (falsy: 32 / 1), truncate (default true)."""
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rs.get("original_max_position_embeddings") is None:
        raise ConfigError(f"{source}: rope_scaling.original_max_position_embeddings is "
                          "required for rope_type 'yarn'")
    original = hf_int(rs["original_max_position_embeddings"],
                      "rope_scaling.original_max_position_embeddings", source)
    factor = rs.get("factor")
    factor = (float(d.get("max_position_embeddings", original)) / original  # type: ignore[arg-type]
              if factor is None else float(factor))  # type: ignore[arg-type]
    if not (factor > 0 and math.isfinite(factor)) or original <= 0:
        raise ConfigError(f"{source}: rope_scaling factor={factor!r} and "
                          f"original_max_position_embeddings={original} must be positive")
    att = rs.get("attention_factor")
    ms, ms_all = rs.get("mscale"), rs.get("mscale_all_dim")
    if att is None:
        att = (mscale(factor, float(ms)) / mscale(factor, float(ms_all))  # type: ignore[arg-type]
               if ms and ms_all else mscale(factor))
    return RopeScaling(rope_type="yarn", factor=factor, original_max_position_embeddings=original,
                       beta_fast=float(rs.get("beta_fast") or 32.0),  # type: ignore[arg-type]
                       beta_slow=float(rs.get("beta_slow") or 1.0),  # type: ignore[arg-type]
                       truncate=bool(rs.get("truncate", True)),
                       attention_factor=float(att))  # type: ignore[arg-type]


def rope_scaling_to_hf(rs: RopeScaling) -> dict[str, object] | None:
    if rs.rope_type == "default":
        return None
    if rs.rope_type == "yarn":  # attention_factor written out: it was resolved at parse time
        return {"rope_type": "yarn", "factor": rs.factor, "beta_fast": rs.beta_fast,
                "beta_slow": rs.beta_slow, "truncate": rs.truncate,
                "original_max_position_embeddings": rs.original_max_position_embeddings,
                "attention_factor": rs.attention_factor}
    if rs.rope_type == "proportional":  # transformers reads `factor` but flags it if written
        out: dict[str, object] = {"rope_type": rs.rope_type,
                                  "partial_rotary_factor": rs.partial_rotary_factor}
        return out if rs.factor == 1.0 else {**out, "factor": rs.factor}
    out = {"rope_type": rs.rope_type, "factor": rs.factor}
    if rs.rope_type == "llama3":
        out.update(low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor,
                   original_max_position_embeddings=rs.original_max_position_embeddings)
    return out
