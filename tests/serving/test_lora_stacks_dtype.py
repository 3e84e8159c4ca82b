"""The adapter stacks' dtype (`serving.lora_build.stacks_dtype`): `--lora-dtype` as given;
auto: the model's dtype (vLLM's rule), except bfloat16 for a float32 model whose weights are
stored quantized (the bundled Q4_1 model), where float32 stacks would double what a decode
step reads for the adapters and match no float weights."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jaxserve.config import EngineConfig
from jaxserve.lora_config import LoRAConfig
from jaxserve.serving.lora_build import stacks_dtype


@pytest.mark.parametrize("model_dtype,lora_dtype,quantized,want", [
    ("float32", "auto", False, jnp.float32),     # float weights: the model's
    ("bfloat16", "auto", False, jnp.bfloat16),
    ("float32", "auto", True, jnp.bfloat16),     # quantized float32 model: bfloat16
    ("bfloat16", "auto", True, jnp.bfloat16),
    ("float32", "float32", True, jnp.float32),   # named: as named, quantized or not
    ("bfloat16", "float32", False, jnp.float32),
    ("float32", "float16", False, jnp.float16),
])
def test_stacks_dtype(model_dtype: str, lora_dtype: str, quantized: bool, want: object) -> None:
    cfg = EngineConfig(dtype=model_dtype, lora_config=LoRAConfig(lora_dtype=lora_dtype))
    assert stacks_dtype(cfg, quantized) == want


def test_without_lora_the_model_dtype() -> None:
    assert stacks_dtype(EngineConfig(dtype="bfloat16"), True) == jnp.bfloat16
