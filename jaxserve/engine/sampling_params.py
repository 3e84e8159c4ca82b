"""SamplingParams: the per-request generation knobs, validated once where they enter.

Plain Python (no jax). Every bad value raises ValueError naming the field and the allowed
range, so the offline API raises it and the gRPC server maps it to INVALID_ARGUMENT. On the
device side these become per-row arrays (`jaxserve.sampler`), never static arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

MAX_LOGPROBS = 20
MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs for each generated token
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Accept lists / a single string from callers; store tuples (frozen, hashable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        _int_in("n", self.n, 1, MAX_N)
        _finite("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        _finite("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or (
                self.top_k < -1 or self.top_k == 0):
            raise ValueError(f"top_k={self.top_k} must be -1 (disabled) or >= 1")
        _finite("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        if self.seed is not None:
            _int_in("seed", self.seed, 0, 2**64 - 1)
        if self.max_tokens is not None:
            _int_in("max_tokens", self.max_tokens, 1, 2**31 - 1)
        _int_in("min_tokens", self.min_tokens, 0, 2**31 - 1)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS}")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop[{i}]={s!r} must be a non-empty string")
            if len(s) > MAX_STOP_STRING_LEN:
                raise ValueError(
                    f"stop[{i}] is {len(s)} characters long; at most {MAX_STOP_STRING_LEN}")
        for i, t in enumerate(self.stop_token_ids):
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"stop_token_ids[{i}]={t!r} must be a non-negative integer")
        if self.logprobs is not None:
            _int_in("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        _finite("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _finite(name, value)
            if not -2 <= value <= 2:
                raise ValueError(f"{name}={value} must be in [-2, 2]")

    @functools.cached_property
    def row(self) -> tuple[float, int, float, float, float, float, float, bool]:
        """This request's row of the per-step sampling arrays (built once, reused each step):
        (temperature, top_k (-1 = all), top_p, min_p, repetition, presence, frequency,
        wants logprobs)."""
        return (self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty,
                self.presence_penalty, self.frequency_penalty, self.logprobs is not None)

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_stop_ids(self, extra: Sequence[int]) -> "SamplingParams":
        return dataclasses.replace(self, stop_token_ids=tuple(dict.fromkeys(
            [*self.stop_token_ids, *extra])))


def _finite(name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite number")


def _int_in(name: str, value: object, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"{name}={value!r} must be an integer in [{lo}, {hi}]")
