"""Which LoRA adapter a served request runs under: a model name -> the registered
`LoRARequest` (or None: the base model), and the last check before the engine queues it.

Data flow: a front reads the request's model name (HTTP `"model"`, gRPC `lora_name`, a batch
line's `"model"`) -> `resolve_model`: absent or one of the base model's names -> None; a
registered adapter's name -> its `LoRARequest` (read from the engine's registry: one dict
read, any thread); anything else -> `LoraNotFound` (HTTP 404 NotFoundError, gRPC NOT_FOUND,
a batch error line) -> `AsyncEngine.submit(..., lora=...)` -> on the engine's loop thread,
`bind_registered`: the adapter must still be registered as it was resolved (an unload, or
an unload and a load of another adapter under that name, may have come in between), else
`LoraNotFound` from the stream. So a request never runs under an adapter unloaded before it
was queued, and never re-registers one (the engine registers a `LoRARequest` it does not
know, vLLM's offline rule, which a server must not follow).

Every engine call of the serving layer's LoRA support (here and `lora_adapters.py`) goes
through `Engine.resolve_lora` / `list_loras` / `add_lora` / `remove_lora`.
"""

from __future__ import annotations

from typing import Any, Sequence

from jaxserve.engine.lora_request import LoRARequest


class LoraNotFound(LookupError):
    """A model name that is neither the base model nor a registered adapter."""

    def __init__(self, name: str, message: str | None = None):
        self.name = name
        super().__init__(message or f"The model `{name}` does not exist.")


def lora_enabled(engine: Any) -> bool:
    """Whether `engine` (an Engine or a ReplicaPool) serves adapters (--enable-lora)."""
    return engine.config.lora_config is not None


def resolve_model(engine: Any, name: object, base_names: Sequence[str],
                  strict: bool = True) -> LoRARequest | None:
    """The adapter a request naming model `name` runs under: None for the base model (`name`
    None or in `base_names`); LoraNotFound for another name that is no registered adapter,
    unless not `strict` and the engine has no LoRA (a server without --served-model-name
    answers to any name then, as it always has). `engine`: an Engine or a ReplicaPool."""
    if name is None or name in base_names:
        return None
    if lora_enabled(engine) and isinstance(name, str):
        found = engine.resolve_lora(name)
        if found is not None:
            return found
    if not strict and not lora_enabled(engine):
        return None
    raise LoraNotFound(str(name))


def bind_registered(engine: Any, lora: LoRARequest | None) -> LoRARequest | None:
    """`lora` if the engine still registers it as it was resolved (its loop thread, just
    before `add_request`); LoraNotFound otherwise."""
    if lora is not None and engine.resolve_lora(lora.lora_name) != lora:
        raise LoraNotFound(lora.lora_name)
    return lora


def next_lora_int_id(registered: Sequence[LoRARequest], last: int = 0) -> int:
    """A lora_int_id for an adapter loaded without one: past every registered id and `last`
    (the previous one handed out, which may not be registered yet)."""
    return max([last, *(r.lora_int_id for r in registered)]) + 1
