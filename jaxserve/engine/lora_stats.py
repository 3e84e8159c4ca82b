"""Per-adapter figures of the engine's LoRA serving, for the metrics.

Plain Python (no jax). `LoraCounters` (the engine's) counts, per adapter name, the requests
queued under it and the tokens its sequences generated (advanced after each step from the
groups with news); `Engine.stats()` snapshots them, with the names of the adapters in use by
running and by waiting sequences, as `LoraStats` (`EngineStats.lora`), which
`serving/metrics.py` maps to vLLM's `lora_requests_info` gauge and per-adapter counters.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from jaxserve.engine.sequence import Sequence


@dataclasses.dataclass(frozen=True)
class LoraStats:
    max_lora: int = 0  # device adapter slots (vLLM's max_loras); 0: LoRA is off
    running: tuple[str, ...] = ()  # adapters of running sequences, sorted
    waiting: tuple[str, ...] = ()  # adapters of waiting sequences, sorted
    requests: tuple[tuple[str, int], ...] = ()  # (name, requests queued), cumulative
    generation_tokens: tuple[tuple[str, int], ...] = ()  # (name, tokens generated)

    def __add__(self, other: "LoraStats") -> "LoraStats":
        """Two engines' stats together (data-parallel replicas of one model)."""
        def add(a: tuple[tuple[str, int], ...], b: tuple[tuple[str, int], ...]
                ) -> tuple[tuple[str, int], ...]:
            total = dict(a)
            for name, n in b:
                total[name] = total.get(name, 0) + n
            return tuple(sorted(total.items()))
        return LoraStats(max(self.max_lora, other.max_lora),
                         tuple(sorted(set(self.running) | set(other.running))),
                         tuple(sorted(set(self.waiting) | set(other.waiting))),
                         add(self.requests, other.requests),
                         add(self.generation_tokens, other.generation_tokens))


class LoraCounters:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self._requests: dict[str, int] = {}
        self._tokens: dict[str, int] = {}
        self._seen: dict[int, int] = {}  # id(sequence) -> its output tokens already counted

    def on_request(self, name: str) -> None:
        self._requests[name] = self._requests.get(name, 0) + 1

    def on_tokens(self, seqs: Iterable[Sequence], done: bool) -> None:
        """Count the new output tokens of one request's sequences (`done`: its last call)."""
        for seq in seqs:
            if seq.lora is None:
                continue
            key = id(seq)
            seen = self._seen.get(key, 0)
            now = seq.num_output_tokens
            if now > seen:  # (a verified run cut short may shrink the output: never negative)
                name = seq.lora.name
                self._tokens[name] = self._tokens.get(name, 0) + now - seen
                self._seen[key] = now
            if done:
                self._seen.pop(key, None)

    def stats(self, running: Iterable[Sequence], waiting: Iterable[Sequence]) -> LoraStats:
        """The snapshot (`waiting` is only walked with LoRA on: it may be long)."""
        if not self.max_loras:
            return LoraStats()
        return LoraStats(
            self.max_loras,
            tuple(sorted({s.lora.name for s in running if s.lora is not None})),
            tuple(sorted({s.lora.name for s in waiting if s.lora is not None})),
            tuple(sorted(self._requests.items())), tuple(sorted(self._tokens.items())))
