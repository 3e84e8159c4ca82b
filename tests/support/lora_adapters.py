"""Random PEFT LoRA adapters for tests, built by torch + peft on the tiny HF models of
`hf_models.py`, and their oracle: the HF model with the adapter merged.

`make_peft_adapter(hf_model, out_dir, ...)` wraps a copy of the model with `peft.LoraConfig` /
`get_peft_model`, then overwrites every lora_A and lora_B with seeded random values (PEFT
starts B at zero, which would make the adapter a no-op) and saves the directory with
`save_pretrained(safe_serialization=True)`: adapter_config.json + adapter_model.safetensors.
B is scaled per module so that PEFT's delta `scaling * B @ A` has entries of about
`strength` times the base weight's standard deviation: big enough that greedy tokens change,
small enough that logits stay in the base model's range.

`merged_model(hf_model, adapter_dir)` is a copy of the model with the saved adapter loaded by
`PeftModel.from_pretrained` and merged by `merge_and_unload`: the reference outputs and
weights that jaxserve's adapter path must reproduce.
"""

from __future__ import annotations

import copy
import math
import pathlib
from typing import Any, Sequence

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(hf_model: Any, out_dir: pathlib.Path, rank: int = 8, alpha: float = 16,
                      target_modules: Sequence[str] | str = DEFAULT_TARGETS, seed: int = 0,
                      use_rslora: bool = False, rank_pattern: dict[str, int] | None = None,
                      strength: float = 0.5, **lora_kwargs: Any) -> pathlib.Path:
    """Save a random LoRA adapter of `hf_model` (left unchanged) to `out_dir`; returns it.
    `lora_kwargs` go to `peft.LoraConfig` as they are (alpha_pattern, layers_to_transform,
    use_dora, bias, ...)."""
    import peft
    import torch

    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha,
        target_modules=list(target_modules) if not isinstance(target_modules, str)
        else target_modules,
        use_rslora=use_rslora, rank_pattern=dict(rank_pattern or {}), **lora_kwargs)
    model = peft.get_peft_model(copy.deepcopy(hf_model), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, module in sorted(model.named_modules(), key=lambda kv: kv[0]):
            if not isinstance(module, peft.tuners.lora.LoraLayer) or "default" not in \
                    getattr(module, "lora_A", {}):
                continue
            a = module.lora_A["default"].weight  # [r, in]
            b = module.lora_B["default"].weight  # [out, r]
            r, n_in = a.shape
            scaling = module.scaling["default"]
            # (an MoE expert stack, which PEFT adapts as a parameter, has no `weight`)
            base = getattr(module.get_base_layer(), "weight", None)
            w_std = float(base.float().std()) if base is not None else 0.05
            std_a = 1.0 / math.sqrt(n_in)
            # entries of scaling * B @ A: std = scaling * sqrt(r) * std_a * std_b
            std_b = strength * w_std / (abs(scaling) * math.sqrt(r) * std_a)
            a.copy_(torch.randn(a.shape, generator=gen) * std_a)
            b.copy_(torch.randn(b.shape, generator=gen) * std_b)
    out_dir = pathlib.Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def merged_model(hf_model: Any, adapter_dir: pathlib.Path) -> Any:
    """A copy of `hf_model` with the adapter at `adapter_dir` merged into its weights."""
    import peft

    wrapped = peft.PeftModel.from_pretrained(copy.deepcopy(hf_model), str(adapter_dir))
    return wrapped.merge_and_unload().eval()


__all__ = ["DEFAULT_TARGETS", "make_peft_adapter", "merged_model"]
