"""An EAGLE-3 head's `config.json` -> `Eagle3Config`, and the checks against its target model.

An EAGLE-3 head (a speculative decoding draft; `models/eagle3.py` runs it) is saved as an HF
Llama config with `architectures` ["LlamaForCausalLMEagle3"] (the EAGLE authors' and SGLang's
name) or ["Eagle3LlamaForCausalLM"] (vLLM's), one decoder layer (`num_hidden_layers` 1),
and these extra fields, read here as vLLM and SGLang read them:
  - `draft_vocab_size`: rows of the head's `lm_head` (absent: the target's vocabulary); a
    reduced vocabulary maps back to target ids through the checkpoint's `d2t` offsets;
  - `target_hidden_size`: the width of the target's hidden states (absent: `hidden_size`);
    `fc` reads 3 of them concatenated;
  - `eagle_aux_hidden_state_layer_ids` (top level, as vLLM reads it, or inside `eagle_config`):
    which target layers' input streams feed `fc`; absent: (2, L // 2, L - 3) of a target of
    L layers, vLLM's and SGLang's default. Both take them in ascending layer order (each layer
    is tested for membership as the loop passes it), so they are sorted here;
  - `eagle_config.use_aux_hidden_state` false (a head without `fc`) is refused;
  - `norm_before_residual`: the midlayer's residual is the normed hidden input, not the raw
    one (vLLM's option; default false);
  - `logit_scale`: multiplies the draft logits (vLLM's LogitsProcessor scale; default 1).
Fields this head's layer cannot honour (`attention_bias`, `mlp_bias`, `bias` on fc, more than
one layer, an activation other than silu) are refused with a ConfigError naming them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from .config import (ConfigError, ModelConfig, RopeScaling, hf_int, hf_rope_scaling,
                     hf_rope_theta)

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
NUM_AUX = 3  # target hidden states `fc` reads (EAGLE-3's low / middle / high features)


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """Shape and options of one EAGLE-3 head (hashable: a static jit argument)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's vocabulary (embedding rows, d2t's range)
    draft_vocab_size: int  # lm_head rows
    target_hidden_size: int  # fc reads NUM_AUX * this
    tie_word_embeddings: bool = False  # lm_head is the embedding (draft vocab = vocab)
    norm_before_residual: bool = False
    logit_scale: float = 1.0
    aux_layer_ids: tuple[int, ...] | None = None  # None: the target's default
    rope_scaling: RopeScaling = RopeScaling()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_config(self) -> ModelConfig:
        """The midlayer as a one-layer Llama ModelConfig (what `blocks.attention` and the
        norms read; its q/k/v read 2 * hidden inputs, which the config does not constrain)."""
        return ModelConfig(
            model_type="llama", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=1, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings, attention_bias=False, qk_norm=False,
            rope_scaling=self.rope_scaling)

    def aux_layers(self, target: ModelConfig) -> tuple[int, ...]:
        """The `aux_layers` to pass `paged.paged_hidden` of `target`: the config's ids, or
        (2, L // 2, L - 3) for a target of L layers; refused unless NUM_AUX distinct layers
        in [0, L] (index i: the residual stream entering layer i)."""
        L = target.num_layers
        ids = self.aux_layer_ids
        if ids is None:
            ids = (2, L // 2, L - 3)
        ids = tuple(sorted(set(ids)))
        if len(ids) != NUM_AUX or not all(0 <= i <= L for i in ids):
            raise ConfigError(f"EAGLE-3 aux hidden state layers {ids} for a target of {L} "
                              f"layers: need {NUM_AUX} distinct layer indices in [0, {L}]")
        return ids

    def check_target(self, target: ModelConfig, has_embed: bool) -> None:
        """Refuse a target this head cannot read: hidden sizes or vocabularies that differ,
        naming both."""
        if target.hidden_size != self.target_hidden_size:
            raise ConfigError(
                f"the EAGLE-3 head reads target hidden states of size {self.target_hidden_size} "
                f"(target_hidden_size, or hidden_size={self.hidden_size}), but the target "
                f"model's hidden_size is {target.hidden_size}")
        if target.vocab_size != self.vocab_size:
            raise ConfigError(f"the EAGLE-3 head's vocab_size={self.vocab_size} differs from "
                              f"the target model's vocab_size={target.vocab_size}")
        if not has_embed and target.hidden_size != self.hidden_size:
            raise ConfigError(
                f"the EAGLE-3 head has no embed_tokens.weight, so it shares the target's "
                f"embeddings, but its hidden_size={self.hidden_size} differs from the target "
                f"model's hidden_size={target.hidden_size}")
        if not has_embed and target.embed_scale is not None:
            raise ConfigError("the EAGLE-3 head shares the target's embeddings, which this "
                              f"target ({target.model_type}) scales: not supported")


def eagle3_config_from_hf(d: Mapping[str, object], source: str) -> Eagle3Config:
    """An EAGLE-3 head's config.json dict -> Eagle3Config; errors name `source` and the field."""
    archs = d.get("architectures")
    if not (isinstance(archs, list) and len(archs) == 1 and archs[0] in ARCHITECTURES):
        raise ConfigError(f"{source}: architectures={archs!r} is not an EAGLE-3 head "
                          f"(expected one of {', '.join(ARCHITECTURES)})")

    def req(key: str) -> object:
        if d.get(key) is None:
            raise ConfigError(f"{source}: required field {key!r} is missing")
        return d[key]

    def refuse_true(key: str, what: str) -> None:
        if d.get(key):
            raise ConfigError(f"{source}: {key}={d[key]!r} is not supported ({what})")

    refuse_true("attention_bias", "the EAGLE-3 midlayer has no q/k/v bias here")
    refuse_true("mlp_bias", "the EAGLE-3 midlayer has no MLP bias")
    refuse_true("bias", "vLLM's EAGLE-3 fc has no bias")
    layers = hf_int(req("num_hidden_layers"), "num_hidden_layers", source)
    if layers != 1:
        raise ConfigError(f"{source}: num_hidden_layers={layers}: only one-layer EAGLE-3 heads "
                          "are supported")
    act = d.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"{source}: hidden_act={act!r} is not supported (only 'silu')")
    eagle = d.get("eagle_config") or {}
    if not isinstance(eagle, dict):
        raise ConfigError(f"{source}: eagle_config must be an object")
    if eagle.get("use_aux_hidden_state", True) is not True:
        raise ConfigError(f"{source}: eagle_config.use_aux_hidden_state="
                          f"{eagle['use_aux_hidden_state']!r}: a head without fc over the "
                          "target's auxiliary hidden states is not EAGLE-3")
    ids = _aux_ids(d, eagle, source)
    try:
        hidden = hf_int(req("hidden_size"), "hidden_size", source)
        heads = hf_int(req("num_attention_heads"), "num_attention_heads", source)
        vocab = hf_int(req("vocab_size"), "vocab_size", source)
        draft_vocab = hf_int(d.get("draft_vocab_size") or vocab, "draft_vocab_size", source)
        tied = bool(d.get("tie_word_embeddings", False))
        if draft_vocab > vocab or (tied and draft_vocab != vocab):
            raise ConfigError(f"draft_vocab_size={draft_vocab} must be at most vocab_size="
                              f"{vocab}, and equal to it with tie_word_embeddings")
        scale = float(d.get("logit_scale", 1.0))  # type: ignore[arg-type]
        if not math.isfinite(scale):
            raise ConfigError(f"logit_scale={scale!r} must be finite")
        cfg = Eagle3Config(
            hidden_size=hidden, num_heads=heads,
            num_kv_heads=hf_int(d.get("num_key_value_heads") or heads, "num_key_value_heads",
                                source),
            head_dim=hf_int(d.get("head_dim") or hidden // heads, "head_dim", source),
            intermediate_size=hf_int(req("intermediate_size"), "intermediate_size", source),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),  # type: ignore[arg-type]
            rope_theta=float(hf_rope_theta(d)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),  # type: ignore[arg-type]
            vocab_size=vocab, draft_vocab_size=draft_vocab,
            target_hidden_size=hf_int(d.get("target_hidden_size") or hidden,
                                      "target_hidden_size", source),
            tie_word_embeddings=tied,
            norm_before_residual=bool(d.get("norm_before_residual", False)),
            logit_scale=scale, aux_layer_ids=ids, rope_scaling=hf_rope_scaling(d, source))
        cfg.layer_config  # noqa: B018 - ModelConfig validates heads, head_dim, eps, rope
        return cfg
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    except (TypeError, ValueError, OverflowError, ZeroDivisionError) as e:
        raise ConfigError(f"{source}: a field has a value of the wrong type ({e}); "
                          "numeric fields must be numbers") from None


def _aux_ids(d: Mapping[str, object], eagle: Mapping[str, object],
             source: str) -> tuple[int, ...] | None:
    """`eagle_aux_hidden_state_layer_ids`, top level or in eagle_config (one answer)."""
    found = [x for x in (d.get("eagle_aux_hidden_state_layer_ids"),
                         eagle.get("eagle_aux_hidden_state_layer_ids")) if x is not None]
    if not found:
        return None
    if len(found) == 2 and list(found[0]) != list(found[1]):  # type: ignore[call-overload]
        raise ConfigError(f"{source}: eagle_aux_hidden_state_layer_ids differs between the top "
                          f"level ({found[0]!r}) and eagle_config ({found[1]!r})")
    ids = found[0]
    if not (isinstance(ids, list) and len(ids) == NUM_AUX and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
        raise ConfigError(f"{source}: eagle_aux_hidden_state_layer_ids={ids!r} must be a list "
                          f"of {NUM_AUX} layer indices")
    return tuple(ids)
