"""Prometheus series of multi-LoRA serving (`engine/lora_stats.py`), from `EngineStats.lora`.

Data flow: `EngineMetrics.on_step` (the engine's loop thread, once per iteration), for an
engine with LoRA on (`LoraStats.max_lora` > 0) -> `LoraView.on_step(stats.lora)` ->
- `jaxserve:lora_requests_info` (vLLM's `vllm:lora_requests_info`): one series whose labels
  are the comma-separated names of the adapters running sequences use and of those waiting
  sequences use, and max_lora; its value is the time of the last update (set each step, as
  vLLM sets it at each stats update). The previous label set is removed when the names
  change, so the family holds one series per engine, not one per adapter mix ever seen;
- `jaxserve:lora_requests_total{lora_name}` and `jaxserve:lora_generation_tokens_total
  {lora_name}`: requests queued and tokens generated per adapter, advanced by the deltas of
  the engine's cumulative counts.
The families are registered with the first engine that reports LoRA on (a server without LoRA
exposes none of them, as vLLM's).
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge

from jaxserve.engine.lora_stats import LoraStats

INFO_LABELS = ("running_lora_adapters", "waiting_lora_adapters", "max_lora")


class LoraFamilies:
    def __init__(self, r: CollectorRegistry, prefix: str, labels: tuple[str, ...]):
        self.info = Gauge(prefix + "lora_requests_info",
                          "LoRA adapters in use by running and by waiting requests (comma-"
                          "separated names) and max_lora; the value is the update time.",
                          labels + INFO_LABELS, registry=r)
        self.requests = Counter(prefix + "lora_requests", "Requests queued per LoRA adapter.",
                                labels + ("lora_name",), registry=r)
        self.generation_tokens = Counter(prefix + "lora_generation_tokens",
                                         "Tokens generated per LoRA adapter.",
                                         labels + ("lora_name",), registry=r)


class LazyLoraFamilies:
    """The LoRA families of one registry, registered on first use (replicas' loop threads
    share it: the lock makes that once)."""

    def __init__(self, r: CollectorRegistry, prefix: str, labels: tuple[str, ...]):
        self._args = (r, prefix, labels)
        self._lock = threading.Lock()
        self._families: LoraFamilies | None = None

    def get(self) -> LoraFamilies:
        with self._lock:
            if self._families is None:
                self._families = LoraFamilies(*self._args)
            return self._families


class LoraView:
    """One engine's LoRA series."""

    def __init__(self, families: LazyLoraFamilies, values: tuple[str, ...]):
        self._families = families
        self._values = values
        self._info: tuple[str, str, str] | None = None  # the info series' label values
        self._requests: dict[str, int] = {}  # last seen cumulative counts per adapter
        self._tokens: dict[str, int] = {}

    def on_step(self, st: LoraStats) -> None:
        if not st.max_lora:
            return
        fam = self._families.get()
        info = (",".join(st.running), ",".join(st.waiting), str(st.max_lora))
        if info != self._info:
            if self._info is not None:
                fam.info.remove(*self._values, *self._info)
            self._info = info
        fam.info.labels(*self._values, *info).set_to_current_time()
        for family, counts, last in ((fam.requests, st.requests, self._requests),
                                     (fam.generation_tokens, st.generation_tokens,
                                      self._tokens)):
            for name, n in counts:
                delta = n - last.get(name, 0)
                if delta > 0:
                    family.labels(*self._values, name).inc(delta)
                    last[name] = n
