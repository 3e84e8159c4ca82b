"""jaxserve: an LLM serving engine on JAX/XLA.

`from jaxserve import LLM, SamplingParams, StructuredOutputs, LoRARequest, Engine`. The heavy
(jax) parts load on first use so that the host-side modules (scheduler, allocator, request,
detokenizer) import without jax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxserve.engine.lora_request import LoRARequest
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.structured_outputs import StructuredOutputs

__version__ = "0.1.0"
__all__ = ["LLM", "Engine", "EngineConfig", "LoRARequest", "SamplingParams",
           "StructuredOutputs", "build_engine"]

if TYPE_CHECKING:
    from jaxserve.config import EngineConfig
    from jaxserve.engine.engine import Engine
    from jaxserve.llm import LLM, build_engine


def __getattr__(name: str) -> object:
    if name in ("LLM", "build_engine"):
        from jaxserve import llm

        return getattr(llm, name)
    if name == "Engine":
        from jaxserve.engine.engine import Engine

        return Engine
    if name == "EngineConfig":
        from jaxserve.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
