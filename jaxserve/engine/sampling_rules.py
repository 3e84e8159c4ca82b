"""The value rules of the sampling registry (`sampling_params`): each `Rule` states the allowed
values of one field and raises InvalidRequest naming the field when a value is outside them.

Plain Python (no jax). The limits here are the ones that hold whatever the model: every integer
fits the type the engine stores it in (int32 token ids and counts, uint64 seeds) and every float
a device column carries stays finite in float32, in a range where the sampler's arithmetic stays
finite (see `MIN_TEMPERATURE`). `sampling_params` re-exports the limits.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from typing import Any, Callable

from jaxserve.engine.errors import InvalidRequest

MAX_LOGPROBS = 20  # top-N logprobs computed per sampled token (the sampler's static width)
MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256  # characters
MAX_STOP_TOKEN_IDS = 64
# logit_bias: OpenAI's limits (at most 300 entries, each bias in [-100, 100]). The entry limit
# is also the static width of the step's sparse bias arrays (see `jaxserve.engine.batch`).
MAX_LOGIT_BIAS = 300
MAX_ABS_LOGIT_BIAS = 100.0
# allowed_token_ids: at most this many ids (a 256k vocabulary fits); the vocabulary bound is
# `EngineLimits.check_params`. bad_words: vLLM has no bound; this one keeps the admission
# work (each word tokenized twice) and the per-step suffix checks small.
MAX_ALLOWED_TOKEN_IDS = 2**18
MAX_BAD_WORDS = 128
MAX_BAD_WORD_LEN = 256  # characters
INT32_MAX = 2**31 - 1  # token ids, top_k and token counts are int32 on the device and host
# Sampler arithmetic in float32: logits are divided by the temperature and by the repetition
# penalty (or multiplied by it), so both are kept where the result stays finite for any
# realistic logit (|logit| < 1e6): no overflow to inf, no 0 * inf = NaN. vLLM treats
# temperatures below 1e-5 as greedy; here they are refused rather than silently changed.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-5, 100.0
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0


def show(value: object, limit: int = 40) -> str:
    """`value` as an error message quotes it: repr, cut to `limit` characters (a client's
    value may be a 4,000-digit integer or a long string)."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's int -> str digit limit
        digits = int(value.bit_length() * math.log10(2))  # type: ignore[attr-defined]
        return f"<an integer of about {digits} digits>"
    return text if len(text) <= limit else f"{text[:limit - 5]}...{text[-2:]}"


def check_text(field: str, text: str, where: str = "") -> int:
    """`text` (field `field`, at `where` in it, e.g. "[2]") is valid Unicode: no lone UTF-16
    surrogate, which has no UTF-8 form and which the tokenizer cannot take. Returns its UTF-8
    size in bytes."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise InvalidRequest(f"{field}{where} is not valid Unicode: character {e.start} is a "
                             f"lone UTF-16 surrogate {e.object[e.start]!r}", field) from None


# ----------------------------------------------------------------------------- declarations
class Rule:
    """The allowed values of one field. `text` states them as error messages do."""

    text: str

    def check(self, name: str, value: Any) -> None:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class IntIn(Rule):
    lo: int
    hi: int

    @property
    def text(self) -> str:  # type: ignore[override]
        return f"an integer in [{self.lo}, {self.hi}]"

    def check(self, name: str, value: Any) -> None:
        if not _is_int(value) or not self.lo <= value <= self.hi:
            raise InvalidRequest(f"{name}={show(value)} must be {self.text}", name)


@dataclasses.dataclass(frozen=True)
class Finite(Rule):
    """A finite number satisfying `ok`; a non-finite value gets its own message first."""

    text: str  # e.g. "in (0, 1]"
    ok: Callable[[float], bool]

    def check(self, name: str, value: Any) -> None:
        finite = isinstance(value, (int, float)) and not isinstance(value, bool)
        if finite:
            try:
                finite = math.isfinite(value)
            except OverflowError:  # an int too large for a float (e.g. 10**400 from JSON)
                finite = False
        if not finite:
            raise InvalidRequest(f"{name}={show(value)} must be a finite number {self.text}",
                                 name)
        if not self.ok(value):
            raise InvalidRequest(f"{name}={value} must be {self.text}", name)


@dataclasses.dataclass(frozen=True)
class ZeroOrFinite(Finite):
    """0 (the knob's off value), or a finite number satisfying `ok`."""

    def check(self, name: str, value: Any) -> None:
        if not (value == 0 and not isinstance(value, bool) and isinstance(value, (int, float))):
            super().check(name, value)


@dataclasses.dataclass(frozen=True)
class TopK(Rule):
    """-1 and 0 both mean "the whole vocabulary" (the sampler reads k <= 0 so, as vLLM does);
    the upper bound here is int32, the vocabulary bound is `EngineLimits.check_params`."""

    text: str = f"-1 or 0 (disabled) or an integer in [1, {INT32_MAX}]"

    def check(self, name: str, value: Any) -> None:
        if not _is_int(value) or not -1 <= value <= INT32_MAX:
            raise InvalidRequest(f"{name}={show(value)} must be {self.text}", name)


@dataclasses.dataclass(frozen=True)
class StopStrings(Rule):
    text: str = "a string or a list of strings"

    def check(self, name: str, value: Any) -> None:
        if len(value) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"{name} has {len(value)} strings; at most {MAX_STOP_STRINGS}",
                                 name)
        for i, s in enumerate(value):
            if not isinstance(s, str) or not s:
                raise InvalidRequest(f"{name}[{i}]={show(s)} must be a non-empty string", name)
            check_text(name, s, f"[{i}]")
            if len(s) > MAX_STOP_STRING_LEN:
                raise InvalidRequest(
                    f"{name}[{i}] is {len(s)} characters long; at most {MAX_STOP_STRING_LEN}",
                    name)


@dataclasses.dataclass(frozen=True)
class TokenIds(Rule):
    """A list of at most `max_count` token ids, each an integer in [0, INT32_MAX] (the
    vocabulary bound is `EngineLimits.check_params`); `non_empty`: an empty list is refused
    (allowed_token_ids: it would allow no token)."""

    text: str = "a list of token ids"
    max_count: int = MAX_STOP_TOKEN_IDS
    non_empty: bool = False

    def check(self, name: str, value: Any) -> None:
        if self.non_empty and not value:
            raise InvalidRequest(f"{name} must not be empty: it would allow no token", name)
        if len(value) > self.max_count:
            raise InvalidRequest(f"{name} has {len(value)} ids; at most {self.max_count}",
                                 name)
        for i, t in enumerate(value):
            if not _is_int(t) or not 0 <= t <= INT32_MAX:
                raise InvalidRequest(f"{name}[{i}]={show(t)} must be an integer in "
                                     f"[0, {INT32_MAX}]", name)


def allowed_token_ids_rule() -> TokenIds:
    """vLLM's allowed_token_ids: a non-empty list of token ids (only these may be sampled)."""
    return TokenIds(text=f"a non-empty list of at most {MAX_ALLOWED_TOKEN_IDS} token ids "
                         f"(integers in [0, {INT32_MAX}])",
                    max_count=MAX_ALLOWED_TOKEN_IDS, non_empty=True)


@dataclasses.dataclass(frozen=True)
class BadWords(Rule):
    """vLLM's bad_words: words the output may not contain (`engine.token_filter`)."""

    text: str = (f"a list of at most {MAX_BAD_WORDS} words of at most {MAX_BAD_WORD_LEN} "
                 "characters")

    def check(self, name: str, value: Any) -> None:
        if len(value) > MAX_BAD_WORDS:
            raise InvalidRequest(f"{name} has {len(value)} words; at most {MAX_BAD_WORDS}",
                                 name)
        for i, s in enumerate(value):
            if not isinstance(s, str) or not s.strip():
                raise InvalidRequest(f"{name}[{i}]={show(s)} must be a string with a "
                                     "non-space character", name)
            if len(s) > MAX_BAD_WORD_LEN:
                raise InvalidRequest(
                    f"{name}[{i}] is {len(s)} characters long; at most {MAX_BAD_WORD_LEN}",
                    name)
            check_text(name, s, f"[{i}]")


@dataclasses.dataclass(frozen=True)
class TruncatePromptTokens(Rule):
    """vLLM's truncate_prompt_tokens: -1 (keep the last tokens that leave room for
    max_tokens) or k >= 1 (keep the last k); the max_model_len bound is
    `EngineLimits.truncate`."""

    text: str = f"-1 (as many as fit) or an integer in [1, {INT32_MAX}]"

    def check(self, name: str, value: Any) -> None:
        if not _is_int(value) or not (value == -1 or 1 <= value <= INT32_MAX):
            raise InvalidRequest(f"{name}={show(value)} must be {self.text}", name)


@dataclasses.dataclass(frozen=True)
class LogitBias(Rule):
    """token id -> bias added to that token's logit before any other processing (OpenAI's
    `logit_bias`). Ids may be given as decimal strings (JSON object keys); the vocabulary
    bound is `EngineLimits.check_params`."""

    text: str = (f"a mapping of at most {MAX_LOGIT_BIAS} token ids (integers in "
                 f"[0, {INT32_MAX}]) to biases in [-{MAX_ABS_LOGIT_BIAS:g}, "
                 f"{MAX_ABS_LOGIT_BIAS:g}]")

    def check(self, name: str, value: Any) -> None:
        if not isinstance(value, tuple) or not all(
                isinstance(p, tuple) and len(p) == 2 for p in value):
            raise InvalidRequest(f"{name}={show(value)} must be {self.text}", name)
        if len(value) > MAX_LOGIT_BIAS:
            raise InvalidRequest(f"{name} has {len(value)} entries; at most {MAX_LOGIT_BIAS}",
                                 name)
        seen: set[int] = set()
        for key, b in value:
            if not _is_int(key) or not 0 <= key <= INT32_MAX:
                raise InvalidRequest(f"{name} key {show(key)} must be a token id: an integer "
                                     f"in [0, {INT32_MAX}]", name)
            if key in seen:
                raise InvalidRequest(f"{name} gives token id {key} more than once", name)
            seen.add(key)
            try:
                _BIAS.check(f"{name}[{key}]", b)
            except InvalidRequest as e:  # the field is the mapping, not its entry
                raise InvalidRequest(str(e), name) from None


@dataclasses.dataclass(frozen=True)
class Spec(Rule):
    """A spec field: an instance of `cls` (a frozen dataclass that checks its own fields;
    `SamplingParams` builds it from a mapping with `cls.from_mapping`)."""

    cls: type
    text: str

    def check(self, name: str, value: Any) -> None:
        if not isinstance(value, self.cls):
            raise InvalidRequest(f"{name}={show(value)} must be {self.text}", name)


_BIAS = Finite(f"in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}]",
               lambda v: -MAX_ABS_LOGIT_BIAS <= v <= MAX_ABS_LOGIT_BIAS)


def token_key(key: Any) -> Any:
    """A mapping key as a token id: an int, or a decimal string as JSON object keys are
    (\"50256\"); anything else is returned unchanged for the rule to refuse."""
    if isinstance(key, str) and re.fullmatch(r"-?[0-9]{1,100}", key):
        return int(key)
    return key


def _pairs(value: Any) -> Any:
    """A mapping field's value as a tuple of (key, value) pairs (a Mapping, or an iterable
    of pairs); a value of another shape is returned as it is for the rule to refuse."""
    if isinstance(value, typing.Mapping):
        items: Any = value.items()
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        return value
    return tuple((token_key(p[0]), p[1]) if isinstance(p, (list, tuple)) and len(p) == 2
                 else p for p in items)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
