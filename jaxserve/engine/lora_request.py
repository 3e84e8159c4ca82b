"""What a request names to run under a LoRA adapter, and what the engine binds it to.

Plain Python (no jax). `LoRARequest(lora_name, lora_int_id, lora_path)` is vLLM's: the user
(offline: `generate(..., lora_request=...)`) or the server (from `"model": NAME`, through
`Engine.resolve_lora`) hands it to `Engine.add_request`; `jaxserve` exports it. The engine's
registry (`lora_registry.LoraRegistry`) turns a registered one into a `LoraBinding`: the
request plus the load id of that registration, unique for the engine's life, which
- keys the host cache of loaded adapters and the device slot table (`lora_slots.LoraSlots`),
  so an adapter unloaded and loaded again under the same name never reuses the old weights;
- salts the prefix cache's page hashes (`prefix_cache.PrefixCache`), so KV computed under
  one adapter (or the base model) is never served to another.
Each `Sequence` of such a request carries its binding (`Sequence.lora`).
"""

from __future__ import annotations

import dataclasses

from jaxserve.lora_config import check_lora_name


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    lora_name: str  # the adapter's model id on the wire (`"model": NAME`)
    lora_int_id: int  # >= 1, unique among the registered adapters (0 is "no adapter")
    lora_path: str  # the PEFT adapter directory the engine's loader reads

    def __post_init__(self) -> None:
        check_lora_name(self.lora_name, "lora_name")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id={self.lora_int_id!r:.60} must be an integer >= 1 "
                             "(0 is the base model)")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path={self.lora_path!r:.60} must be a non-empty string "
                             f"(LoRA adapter {self.lora_name!r})")

    # vLLM's short names for the same fields.
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id


@dataclasses.dataclass(frozen=True)
class LoraBinding:
    """One registration of an adapter: its request and its load id (module docstring)."""

    request: LoRARequest
    load_id: int  # >= 1, never reused by the engine that assigned it

    @property
    def name(self) -> str:
        return self.request.lora_name

    @property
    def salt(self) -> bytes:
        """The prefix cache's salt of this registration's KV pages."""
        return b"lora:%d" % self.load_id
