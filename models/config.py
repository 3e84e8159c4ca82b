"""Model architecture config: one frozen dataclass for every Llama-family checkpoint.

Data flow: an HF `config.json` dict (or the HF-shaped dict that the GGUF loader derives from
GGUF metadata) -> `ModelConfig.from_hf_dict` -> the frozen `ModelConfig` that the forward
functions, loaders and the engine read. `to_hf_dict` goes back the other way so an export is
loadable by transformers and vLLM. No jax here: the scheduler side imports this too.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

# HF `model_type` -> the features our single decoder implementation switches on.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_ARCHITECTURE_CLASS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM)."""

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
    sliding_window: int | None = None  # Mistral-style window; None = full causal
    rope_scaling: RopeScaling = RopeScaling()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type={self.model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
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
        if self.rope_scaling.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"rope_scaling.rope_type={self.rope_scaling.rope_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"sliding_window={self.sliding_window!r} must be positive or null")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    # ------------------------------------------------------------------ HF config.json
    @classmethod
    def from_hf_dict(cls, d: Mapping[str, object], source: str = "config.json") -> "ModelConfig":
        """Build from an HF `config.json` dict; errors name `source` and the bad field."""

        def req(key: str) -> object:
            if key not in d or d[key] is None:
                raise ConfigError(f"{source}: required field {key!r} is missing")
            return d[key]

        model_type = d.get("model_type")
        if model_type is None:
            archs = d.get("architectures")
            arch = archs[0] if isinstance(archs, list) and archs else None
            model_type = {v: k for k, v in _ARCHITECTURE_CLASS.items()}.get(
                arch if isinstance(arch, str) else "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{source}: model_type={model_type!r} (architectures={d.get('architectures')!r}) "
                f"is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        hidden = _num(req("hidden_size"), "hidden_size", source)
        num_heads = _num(req("num_attention_heads"), "num_attention_heads", source)
        num_kv_heads = _num(d.get("num_key_value_heads") or num_heads, "num_key_value_heads",
                            source)
        head_dim = d.get("head_dim") or hidden // max(num_heads, 1)
        if model_type == "qwen3":
            attention_bias = bool(d.get("attention_bias", False))
        elif model_type == "qwen2":
            attention_bias = True
        else:
            attention_bias = bool(d.get("attention_bias", False))
        if model_type == "llama" and d.get("mlp_bias"):
            raise ConfigError(f"{source}: mlp_bias=true is not supported")
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ConfigError(f"{source}: hidden_act={act!r} is not supported (only 'silu')")

        sliding_window = d.get("sliding_window")
        if model_type in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
            sliding_window = None
        eos = d.get("eos_token_id")
        try:
            eos_list = eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
            eos_ids = tuple(int(x) for x in eos_list)
            return cls(
                model_type=str(model_type),
                vocab_size=int(req("vocab_size")),  # type: ignore[arg-type]
                hidden_size=hidden,
                intermediate_size=int(req("intermediate_size")),  # type: ignore[arg-type]
                num_layers=int(req("num_hidden_layers")),  # type: ignore[arg-type]
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=int(head_dim),  # type: ignore[arg-type]
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),  # type: ignore[arg-type]
                rope_theta=float(_rope_theta(d)),
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),  # type: ignore[arg-type]
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=attention_bias,
                qk_norm=model_type == "qwen3",
                sliding_window=int(sliding_window) if sliding_window else None,  # type: ignore[arg-type]
                rope_scaling=_rope_scaling(d, source),
                bos_token_id=_opt_int(d.get("bos_token_id")),
                eos_token_ids=eos_ids,
                pad_token_id=_opt_int(d.get("pad_token_id")),
            )
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
        # OverflowError: int() of an infinite float (JSON allows 1e999).
        except (TypeError, ValueError, OverflowError) as e:
            raise ConfigError(f"{source}: a field has a value of the wrong type ({e}); "
                              "numeric fields must be numbers") from None

    def to_hf_dict(self, torch_dtype: str = "float32") -> dict[str, object]:
        """An HF `config.json` dict that transformers and vLLM load."""
        d: dict[str, object] = {
            "architectures": [_ARCHITECTURE_CLASS[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "torch_dtype": torch_dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (list(self.eos_token_ids) if len(self.eos_token_ids) > 1
                             else (self.eos_token_ids[0] if self.eos_token_ids else None)),
            "pad_token_id": self.pad_token_id,
        }
        if self.model_type in ("qwen2", "qwen3"):
            d["use_sliding_window"] = self.sliding_window is not None
        d["sliding_window"] = self.sliding_window
        if self.rope_scaling.rope_type != "default":
            rs: dict[str, object] = {"rope_type": self.rope_scaling.rope_type,
                                     "factor": self.rope_scaling.factor}
            if self.rope_scaling.rope_type == "llama3":
                rs.update(
                    low_freq_factor=self.rope_scaling.low_freq_factor,
                    high_freq_factor=self.rope_scaling.high_freq_factor,
                    original_max_position_embeddings=(
                        self.rope_scaling.original_max_position_embeddings),
                )
            d["rope_scaling"] = rs
        return d


def _num(x: object, name: str, source: str) -> int:
    if (isinstance(x, bool) or not isinstance(x, (int, float))
            or (isinstance(x, float) and not x.is_integer())):
        raise ConfigError(f"{source}: field {name!r}={x!r} must be an integer")
    return int(x)


def _opt_int(x: object) -> int | None:
    if isinstance(x, (list, tuple)):
        x = x[0] if x else None
    return None if x is None else int(x)  # type: ignore[call-overload]


def _rope_theta(d: Mapping[str, object]) -> float:
    # transformers >= 5 moved rope_theta into `rope_parameters`.
    rp = d.get("rope_parameters")
    if isinstance(rp, Mapping) and "rope_theta" in rp:
        return float(rp["rope_theta"])  # type: ignore[arg-type]
    return float(d.get("rope_theta", 10000.0))  # type: ignore[arg-type]


def _rope_scaling(d: Mapping[str, object], source: str) -> RopeScaling:
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
    return RopeScaling(
        rope_type=rope_type,
        factor=float(rs.get("factor", 1.0)),  # type: ignore[arg-type]
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),  # type: ignore[arg-type]
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),  # type: ignore[arg-type]
        original_max_position_embeddings=int(
            rs.get("original_max_position_embeddings", 8192)),  # type: ignore[arg-type]
    )
