"""A PEFT LoRA adapter's `adapter_config.json`, read and checked: the half of adapter loading
that needs no tensors (`lora_loader.py` maps the tensors).

Data flow: the JSON object -> `parse_peft_config` -> `PeftLoraConfig` (the default rank and
alpha, rsLoRA, the per-module rank / alpha patterns compiled, the layer and module filters),
whose `rank_of` / `scaling_of` answer for one module key ("model.layers.3.self_attn.q_proj")
as PEFT resolved them when it built the adapter (first matching pattern wins, the pattern
anchored at a dotted boundary and at the end of the key).

Every option that changes what the adapter computes at inference is either honoured here or
refused with a `LoraError` naming it: DoRA, trained biases, Conv1D (fan_in_fan_out) layouts,
full module copies (modules_to_save), trainable token rows, layer replication, parameter
targets, activated / quantization-aware / block-diagonal / routed variants. Training-only
options (dropout, the initialisation schemes, Megatron's layer classes) change nothing in the
saved weights' meaning and are accepted. A key this table does not know is accepted only
while it is unset (null, false, 0, empty): a future PEFT option that is switched on is refused
instead of being silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Mapping

_LIMIT = 160  # longest value quoted in an error message


class LoraError(ValueError):
    """An adapter that cannot be served; the message names the adapter and the problem."""


def short(value: object, limit: int = _LIMIT) -> str:
    """repr for an error message, cut short (a config may hold anything)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# Options that, when set, make the adapter compute something a low-rank delta beside the base
# linear does not: key -> why (`_unset` values mean off).
_REFUSED = {
    "use_dora": "DoRA rescales each weight column by a trained magnitude, which a delta "
                "added beside the base projection cannot express",
    "lora_bias": "a trained bias on lora_B is not served",
    "fan_in_fan_out": "Conv1D-style (fan_in, fan_out) weights are not what these models use",
    "modules_to_save": "full copies of whole modules are not served, only LoRA deltas",
    "trainable_token_indices": "trained embedding rows are not served",
    "layer_replication": "replicated layers change the model's depth",
    "target_parameters": "LoRA on raw parameters (MoE expert stacks) is not served",
    "alora_invocation_tokens": "activated LoRA (applied only after invocation tokens) is not "
                               "served",
    "use_qalora": "quantization-aware LoRA pools its inputs in groups",
    "use_bdlora": "block-diagonal LoRA factors are not served",
    "arrow_config": "routed (Arrow) adapters are not served",
    "kasa_config": "KaSA adapters are not served",
    "monteclora_config": "MonteCLoRA adapters are not served",
}
# Known and without effect on inference (or read below).
_NEUTRAL = {
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path",
    "revision", "inference_mode", "lora_dropout", "init_lora_weights", "loftq_config",
    "eva_config", "corda_config", "lora_ga_config", "velora_config", "megatron_config",
    "megatron_core",
    "runtime_config", "ensure_weight_tying", "exclude_modules", "layers_pattern",
    "qalora_group_size", "r", "lora_alpha", "use_rslora", "bias", "rank_pattern",
    "alpha_pattern", "target_modules", "layers_to_transform",
}


def _unset(value: object) -> bool:
    """null, false, 0, "" or empty: how PEFT writes an option that is off."""
    if isinstance(value, bool):
        return not value
    return value is None or value in (0, "", "none") or value == [] or value == {}


@dataclasses.dataclass(frozen=True)
class PeftLoraConfig:
    """What of an adapter_config.json the loader needs, checked."""

    source: str  # the adapter directory (errors name it)
    r: int
    lora_alpha: float
    use_rslora: bool
    # (compiled pattern, value), in the file's order: the first match wins, as in PEFT
    rank_pattern: tuple[tuple[re.Pattern[str], int], ...]
    alpha_pattern: tuple[tuple[re.Pattern[str], float], ...]
    target_modules: tuple[str, ...] | str | None  # a list of names, a regex, or unset
    layers_to_transform: tuple[int, ...] | None

    def rank_of(self, module_key: str) -> int:
        return _resolve(self.rank_pattern, module_key, self.r)

    def alpha_of(self, module_key: str) -> float:
        return _resolve(self.alpha_pattern, module_key, self.lora_alpha)

    def scaling_of(self, module_key: str) -> float:
        """PEFT's factor on lora_B @ lora_A: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        r = self.rank_of(module_key)
        alpha = self.alpha_of(module_key)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _resolve(patterns: tuple[tuple[re.Pattern[str], object], ...], key: str,
             default: object) -> object:
    for pattern, value in patterns:
        if pattern.match(key):
            return value
    return default


def _number(value: object, what: str, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise LoraError(f"{source}: adapter_config.json {what}={short(value)} must be a finite "
                        "number")
    return float(value)


def _rank(value: object, what: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LoraError(f"{source}: adapter_config.json {what}={short(value)} must be a "
                        "positive integer")
    return value


def _patterns(d: Mapping[str, object], key: str, source: str, is_rank: bool
              ) -> tuple[tuple[re.Pattern[str], object], ...]:
    raw = d.get(key) or {}
    if not isinstance(raw, dict):
        raise LoraError(f"{source}: adapter_config.json {key}={short(raw)} must be an object "
                        "{module pattern: value}")
    out = []
    for pat, value in raw.items():
        what = f"{key}[{short(pat, 60)}]"
        value = _rank(value, what, source) if is_rank else _number(value, what, source)
        try:
            # PEFT's rule: the pattern ends the key, starting at a dotted boundary.
            out.append((re.compile(rf"(.*\.)?({pat})$"), value))
        except re.error as e:
            raise LoraError(f"{source}: adapter_config.json {what} is not a valid regular "
                            f"expression ({e})") from None
    return tuple(out)


def parse_peft_config(d: Mapping[str, object], source: str) -> PeftLoraConfig:
    """adapter_config.json's object -> PeftLoraConfig, or LoraError naming the option."""
    peft_type = d.get("peft_type")
    if peft_type != "LORA":
        raise LoraError(f"{source}: adapter_config.json peft_type={short(peft_type)}: only "
                        "LoRA adapters (peft_type 'LORA') are supported")
    for key, value in d.items():
        if key in _REFUSED:
            if not _unset(value):
                why = _REFUSED[key]
                raise LoraError(f"{source}: adapter_config.json {key}={short(value, 80)}: {why}")
        elif key not in _NEUTRAL and not _unset(value):
            raise LoraError(f"{source}: adapter_config.json has option {short(key, 60)}="
                            f"{short(value, 80)}, which this loader does not know; refusing "
                            "rather than ignoring it")
    bias = d.get("bias", "none")
    if bias not in ("none", None):
        raise LoraError(f"{source}: adapter_config.json bias={short(bias)}: trained base "
                        "biases are not served (only bias='none')")
    rslora = d.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise LoraError(f"{source}: adapter_config.json use_rslora={short(rslora)} must be "
                        "true or false")
    targets = d.get("target_modules")
    if isinstance(targets, list) and all(isinstance(t, str) for t in targets):
        targets = tuple(targets)
    elif targets is not None and not isinstance(targets, str):
        raise LoraError(f"{source}: adapter_config.json target_modules={short(targets)} must "
                        "be a list of module names or a regular expression")
    layers = d.get("layers_to_transform")
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if layers is not None and not (isinstance(layers, list) and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)):
        raise LoraError(f"{source}: adapter_config.json layers_to_transform={short(layers)} "
                        "must be a layer index or a list of them")
    return PeftLoraConfig(
        source=source, r=_rank(d.get("r", 8), "r", source),
        lora_alpha=_number(d.get("lora_alpha", 8), "lora_alpha", source), use_rslora=rslora,
        rank_pattern=_patterns(d, "rank_pattern", source, True),  # type: ignore[arg-type]
        alpha_pattern=_patterns(d, "alpha_pattern", source, False),  # type: ignore[arg-type]
        target_modules=targets,
        layers_to_transform=tuple(layers) if layers is not None else None)


__all__ = ["LoraError", "PeftLoraConfig", "parse_peft_config", "short"]
