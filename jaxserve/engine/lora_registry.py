"""The engine's registered LoRA adapters and the host cache of the loaded ones.

Plain Python (no jax); adapters are opaque here. The engine owns one `LoraRegistry`, built
with the loader serving.build injects (`load(lora_path) -> adapter`: the PEFT loader,
`serving.lora_build.adapter_loader`, whose adapters the runner's `load_lora` takes; a fake
one in tests), and the scheduler's slot table
(`lora_slots.LoraSlots`) to ask which adapters sit in a device slot.

Data flow:
  register (`add`: start-up `lora_modules`, runtime load, or an offline request naming an
    adapter the engine has not seen) -> the adapter is loaded now through `load` (a bad one
    is refused at once: InvalidRequest naming lora_path) into the host cache, and the name
    maps to a `LoraBinding`: the request and a fresh load id (`lora_request.py`).
  `resolve(name)` -> the binding a new request's sequences carry.
  a step loads a slot -> the step core asks `adapter(binding)`: from the host cache, or read
    again through `load` when the cache had dropped it.
  `remove(name)` -> the name no longer resolves; sequences queued with it still run (their
    binding keeps what they need; the slot table empties its slot once they are done).

Host cache: at most `LoRAConfig.num_cpu_loras` adapters (vLLM's max_cpu_loras), least
recently used dropped first, but never one bound to a device slot (max_cpu_loras >= max_loras,
so there is always room for the ones in slots); a dropped adapter that is still registered is
read from its path again when a slot next needs it, under the same load id (the same
registration: its path is assumed to hold the same weights).
"""

from __future__ import annotations

import collections
from typing import Callable

from jaxserve.engine.errors import InvalidRequest
from jaxserve.engine.lora_request import LoraBinding, LoRARequest
from jaxserve.engine.lora_slots import LoraSlots
from jaxserve.lora_config import LoRAConfig

LoraLoader = Callable[[str], object]  # lora_path -> the loaded adapter (raises when bad)


class LoraRegistry:
    def __init__(self, cfg: LoRAConfig, load: LoraLoader, in_slot: Callable[[int], bool]):
        """`in_slot(load_id)`: whether that registration is bound to a device slot."""
        self.cfg = cfg
        self._load = load
        self._in_slot = in_slot
        self._by_name: dict[str, LoraBinding] = {}
        self._host: collections.OrderedDict[int, object] = collections.OrderedDict()
        self._next_load_id = 1
        self.num_host_loads = 0  # adapters read through the loader (cumulative)

    # ----------------------------------------------------------------------- registry
    def resolve(self, name: str) -> LoraBinding | None:
        """The binding registered under `name` (None: none). Any thread (one dict read)."""
        return self._by_name.get(name)

    def list(self) -> list[LoRARequest]:
        """The registered adapters' requests, in registration order."""
        return [b.request for b in list(self._by_name.values())]

    def add(self, request: LoRARequest) -> LoraBinding:
        """Register `request` and load it into the host cache now. InvalidRequest naming
        lora_name (the name is taken), lora_int_id (taken by another name) or lora_path
        (the loader refused it); nothing is registered then."""
        if not isinstance(request, LoRARequest):
            raise InvalidRequest(f"lora_request must be a LoRARequest, got "
                                 f"{type(request).__name__}", "lora_request")
        if request.lora_name in self._by_name:
            raise InvalidRequest(f"lora_name {request.lora_name!r} is already loaded "
                                 "(unload it first)", "lora_name")
        for other in self._by_name.values():
            if other.request.lora_int_id == request.lora_int_id:
                raise InvalidRequest(f"lora_int_id {request.lora_int_id} of LoRA adapter "
                                     f"{request.lora_name!r} is already the id of "
                                     f"{other.name!r}", "lora_int_id")
        adapter = self._read(request)
        binding = LoraBinding(request, self._next_load_id)
        self._next_load_id += 1
        self._by_name[request.lora_name] = binding
        self._keep(binding.load_id, adapter)
        return binding

    def bind(self, request: LoRARequest) -> LoraBinding:
        """The binding a request naming `request` runs under (vLLM's offline rule): the
        registered one when it is the same adapter, a new registration when the name is
        unknown; InvalidRequest naming lora_name when the name is registered with another
        path or id."""
        known = self._by_name.get(getattr(request, "lora_name", None))  # type: ignore[arg-type]
        if known is None:
            return self.add(request)
        if known.request != request:
            k = known.request
            raise InvalidRequest(
                f"lora_name {request.lora_name!r} is loaded as lora_int_id={k.lora_int_id}, "
                f"lora_path={k.lora_path!r}; this request gives lora_int_id="
                f"{request.lora_int_id}, lora_path={request.lora_path!r} (unload it first, "
                "or use another name)", "lora_name")
        return known

    def remove(self, name: str) -> LoraBinding | None:
        """Unregister `name` (None: it was not registered). Its host copy goes unless a
        device slot holds it (then it goes when the slot lets it go: `unbound`)."""
        binding = self._by_name.pop(name, None)
        if binding is not None and not self._in_slot(binding.load_id):
            self._host.pop(binding.load_id, None)
        return binding

    def unbound(self, load_id: int) -> None:
        """A device slot let that registration go: an unregistered one leaves the host
        cache too (a sequence still queued with it reads it again when it runs)."""
        if all(b.load_id != load_id for b in self._by_name.values()):
            self._host.pop(load_id, None)

    # ----------------------------------------------------------------------- host cache
    def adapter(self, binding: LoraBinding) -> object:
        """The loaded adapter of `binding` (the host cache's, else read again through the
        loader); InvalidRequest naming lora_path when it cannot be read any more."""
        adapter = self._host.get(binding.load_id)
        if adapter is None:
            adapter = self._read(binding.request)
            self._keep(binding.load_id, adapter)
        else:
            self._host.move_to_end(binding.load_id)
        return adapter

    def cached(self) -> list[int]:
        """The load ids in the host cache, least recently used first."""
        return list(self._host)

    def _read(self, request: LoRARequest) -> object:
        try:
            adapter = self._load(request.lora_path)
        except Exception as e:  # noqa: BLE001 - any loader failure is the adapter's fault
            raise InvalidRequest(f"lora_path {request.lora_path!r} (LoRA adapter "
                                 f"{request.lora_name!r}) could not be loaded: {e}",
                                 "lora_path") from e
        if adapter is None:
            raise InvalidRequest(f"lora_path {request.lora_path!r} (LoRA adapter "
                                 f"{request.lora_name!r}): the loader returned nothing",
                                 "lora_path")
        self.num_host_loads += 1
        return adapter

    def _keep(self, load_id: int, adapter: object) -> None:
        """Cache `adapter` as the most recently used, then drop the least recently used
        ones outside every device slot while the cache is over its bound."""
        self._host[load_id] = adapter
        self._host.move_to_end(load_id)
        over = len(self._host) - self.cfg.num_cpu_loras
        for old in list(self._host):
            if over <= 0:
                break
            if not self._in_slot(old):
                del self._host[old]
                over -= 1


def engine_registry(cfg: LoRAConfig | None, load: LoraLoader | None,
                    slots: LoraSlots) -> LoraRegistry | None:
    """The engine's registry over the scheduler's `slots` (which tell it when a slot lets
    an adapter go; None: LoRA is off), with `cfg.lora_modules` registered and
    loaded (lora_int_id 1, 2, ... in their order; a bad one is refused now, naming it).
    ValueError naming lora_loader when it is missing, or given with LoRA off."""
    if cfg is None:
        if load is not None:
            raise ValueError("a lora_loader was given but the config has no lora_config "
                             "(enable_lora)")
        return None
    if load is None:
        raise ValueError("lora_config needs a lora_loader (serving.build injects the PEFT "
                         "adapter loader)")
    registry = LoraRegistry(cfg, load, slots.in_slot)
    slots.on_unbind = registry.unbound
    for i, (name, path) in enumerate(cfg.lora_modules, 1):
        registry.add(LoRARequest(name, i, path))
    return registry


def lora_on(registry: LoraRegistry | None, request: object) -> LoraRegistry:
    """`registry`, or InvalidRequest naming lora_request when the engine has none (LoRA is
    off: a request naming an adapter is refused, never run on the base model)."""
    if registry is None:
        raise InvalidRequest(f"lora_request {getattr(request, 'lora_name', request)!r:.60}: "
                             "LoRA is off (enable_lora=True, --enable-lora)", "lora_request")
    return registry
