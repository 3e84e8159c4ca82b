"""SamplingParams: the per-request generation knobs, validated once where they enter.

Plain Python (no jax). This module is the one registry of sampling fields: each field is
declared once below, with `knob(default, rule=..., help=..., device=...)`, and everything
else is derived from that declaration:
  - validation (`Rule`: the allowed values and the text error messages state them in);
  - the gRPC mapping (`server/proto_map.sampling_from_proto`, `server/client.sampling_to_proto`:
    proto field names equal these names);
  - the HTTP body parsing (`server/openai_http.parse_completion`: type checks from the
    declared type);
  - the CLI flags (`jaxserve.cli.flags.add_sampling_flags`) and the batch job's line keys;
  - a mapping field (`logit_bias`, type `dict` in the registry) is stored as a sorted tuple of
    (key, value) pairs, so SamplingParams stays frozen and hashable; the sampler reads it as
    a sparse per-row bias (`jaxserve.engine.batch` packs it into i32/f32[S, MAX_LOGIT_BIAS]);
  - for fields with `device=Column(pad=...)`: one column of the step's f32[S, K] sampling
    matrix (`DEVICE_FIELDS` gives the column order, `PAD_ROW` the padding / warmup row, which
    must sample greedily with every filter and penalty off), and so the multi-host broadcast.
Every bad value raises ValueError naming the field and the allowed range, so the offline API
raises it and the servers map it to INVALID_ARGUMENT / 400. Checks across fields
(min_tokens <= max_tokens) are explicit code in `_validate`. The ranges here are the ones that
hold whatever the model: every integer fits the type the engine stores it in (int32 token ids
and counts, uint64 seeds) and every float a device column carries stays finite in float32, and
in a range where the sampler's arithmetic stays finite (see `TEMPERATURE`); checks against
the model (top_k and stop_token_ids within the vocabulary) are `EngineLimits.check_params`.
"""

from __future__ import annotations

import dataclasses
import functools
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
    text: str = "a list of token ids"

    def check(self, name: str, value: Any) -> None:
        if len(value) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(f"{name} has {len(value)} ids; at most {MAX_STOP_TOKEN_IDS}",
                                 name)
        for i, t in enumerate(value):
            if not _is_int(t) or not 0 <= t <= INT32_MAX:
                raise InvalidRequest(f"{name}[{i}]={show(t)} must be an integer in "
                                     f"[0, {INT32_MAX}]", name)


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


@dataclasses.dataclass(frozen=True)
class Column:
    """A field the sampler reads: one column of the f32[S, K] sampling matrix."""

    pad: float  # the value of padding rows (and the warmup batch): must be a no-op
    none: float | None = None  # stored when the field is None
    penalty: bool = False  # a value other than `pad` needs the token history (penalties)

    def encode(self, value: Any) -> float:
        return self.none if value is None else float(value)  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class Knob:
    """One sampling field's declaration (in the dataclass field's metadata)."""

    rule: Rule | None
    help: str
    device: Column | None


def knob(default: Any, *, help: str, rule: Rule | None = None,
         device: Column | None = None) -> Any:
    """A SamplingParams field with its registry entry."""
    return dataclasses.field(default=default, metadata={"knob": Knob(rule, help, device)})


@dataclasses.dataclass(frozen=True)
class SamplingField:
    """A registry entry as the derived places use it."""

    name: str
    default: Any
    type: type  # int, float, bool, str, tuple, or dict (stored as a tuple of pairs)
    item: type | None  # element type of a tuple field; value type of a dict field
    optional: bool  # None is allowed (and skips the rule)
    rule: Rule | None
    help: str
    device: Column | None


# ----------------------------------------------------------------------------- the fields
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    n: int = knob(1, rule=IntIn(1, MAX_N), help="samples per prompt")
    temperature: float = knob(1.0, rule=ZeroOrFinite(
        f"0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]",
        lambda v: MIN_TEMPERATURE <= v <= MAX_TEMPERATURE),
                              help="sampling temperature; 0 = greedy",
                              device=Column(pad=0.0))
    top_p: float = knob(1.0, rule=Finite("in (0, 1]", lambda v: 0 < v <= 1),
                        help="nucleus sampling mass", device=Column(pad=1.0))
    top_k: int = knob(-1, rule=TopK(), help="sample among the k likeliest; -1 or 0: all",
                      device=Column(pad=-1.0))  # the sampler reads <= 0 as the whole vocabulary
    min_p: float = knob(0.0, rule=Finite("in [0, 1]", lambda v: 0 <= v <= 1),
                        help="drop tokens below min_p times the top token's probability",
                        device=Column(pad=0.0))
    seed: int | None = knob(None, rule=IntIn(0, 2**64 - 1),
                            help="random seed of the request; unset: drawn by the engine")
    # None: up to max_model_len; 0: prefill only (score the prompt: see prompt_logprobs).
    max_tokens: int | None = knob(16, rule=IntIn(0, INT32_MAX), help="new tokens at most")
    min_tokens: int = knob(0, rule=IntIn(0, INT32_MAX),
                           help="new tokens before EOS / stop ids may end the output")
    stop: tuple[str, ...] = knob((), rule=StopStrings(), help="stop string")
    stop_token_ids: tuple[int, ...] = knob((), rule=TokenIds(), help="stop token id")
    ignore_eos: bool = knob(False, help="keep generating after EOS")
    logprobs: int | None = knob(None, rule=IntIn(0, MAX_LOGPROBS),
                                help="top-N logprobs for each generated token",
                                device=Column(pad=-1.0, none=-1.0))  # >= 0: wants logprobs
    repetition_penalty: float = knob(1.0, rule=Finite(
        f"in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]",
        lambda v: MIN_REPETITION_PENALTY <= v <= MAX_REPETITION_PENALTY),
                                     help="divide seen tokens' positive logits by this",
                                     device=Column(pad=1.0, penalty=True))
    presence_penalty: float = knob(0.0, rule=Finite("in [-2, 2]", lambda v: -2 <= v <= 2),
                                   help="subtract this from generated tokens' logits",
                                   device=Column(pad=0.0, penalty=True))
    frequency_penalty: float = knob(0.0, rule=Finite("in [-2, 2]", lambda v: -2 <= v <= 2),
                                    help="subtract this times the count of each generated "
                                         "token", device=Column(pad=0.0, penalty=True))
    # Computed from the prefill's hidden states by a separate LM-head pass over the prompt
    # positions only (`jaxserve.device.prompt_logprobs`); such a request skips the prefix
    # cache, since cached positions are never computed (vLLM does the same).
    prompt_logprobs: int | None = knob(None, rule=IntIn(0, MAX_LOGPROBS),
                                       help="top-N logprobs for each prompt token")
    include_stop_str_in_output: bool = knob(False, help="keep a matched stop string in the text")
    skip_special_tokens: bool = knob(True, help="leave special tokens out of the text")
    # Stored as ((token id, bias), ...) sorted by id; pass a dict. Applied on the device to
    # the logits before penalties, temperature and filters (as vLLM / OpenAI do); the
    # reported logprobs stay those of the unbiased model distribution.
    logit_bias: tuple[tuple[int, float], ...] = knob(
        (), rule=LogitBias(), help="add VALUE to the logit of token id KEY before sampling")

    def __post_init__(self) -> None:
        # Accept lists / a single string / a dict from callers; store tuples (frozen,
        # hashable); a mapping sorted by key once valid, so equal mappings compare equal.
        for f in _MAPPINGS:
            object.__setattr__(self, f.name, _pairs(getattr(self, f.name)))
        for f in _SEQUENCES:
            value = getattr(self, f.name)
            if isinstance(value, str) and f.item is str:
                object.__setattr__(self, f.name, (value,))
            elif not isinstance(value, tuple):
                object.__setattr__(self, f.name, tuple(value))
        self._validate()
        for f in _MAPPINGS:
            object.__setattr__(self, f.name, tuple(sorted(
                (k, float(v)) for k, v in getattr(self, f.name))))

    def _validate(self) -> None:
        for f in FIELDS:
            value = getattr(self, f.name)
            if f.rule is not None and not (value is None and f.optional):
                f.rule.check(f.name, value)
            elif f.type is bool and not isinstance(value, bool):  # flags: no rule, one type
                raise InvalidRequest(f"{f.name}={show(value)} must be true or false", f.name)
            if f.name == "min_tokens" and self.max_tokens is not None and \
                    self.min_tokens > self.max_tokens:  # after min_tokens' own range check
                raise InvalidRequest(
                    f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}",
                    "min_tokens")

    @functools.cached_property
    def row(self) -> tuple[float, ...]:
        """This request's row of the step's sampling matrix, in `DEVICE_FIELDS` order (built
        once, reused each step)."""
        return tuple(f.device.encode(getattr(self, f.name)) for f in DEVICE)  # type: ignore

    @functools.cached_property
    def uses_penalties(self) -> bool:
        """Whether the sampler needs this request's token history."""
        return any(getattr(self, f.name) != f.device.pad for f in DEVICE  # type: ignore
                   if f.device.penalty)  # type: ignore[union-attr]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _registry() -> tuple[SamplingField, ...]:
    hints = typing.get_type_hints(SamplingParams)
    out = []
    for f in dataclasses.fields(SamplingParams):
        args = typing.get_args(hints[f.name])
        optional = type(None) in args
        base = next(a for a in args if a is not type(None)) if optional else hints[f.name]
        item = None
        if typing.get_origin(base) is tuple:
            base, item = tuple, typing.get_args(base)[0]
            if typing.get_origin(item) is tuple:  # ((key, value), ...): a mapping
                base, item = dict, typing.get_args(item)[1]
        k: Knob = f.metadata["knob"]
        if k.device is not None and optional and k.device.none is None:
            raise TypeError(f"{f.name} may be None: its Column needs none=")
        out.append(SamplingField(f.name, f.default, base, item, optional, k.rule, k.help,
                                 k.device))
    return tuple(out)


FIELDS: tuple[SamplingField, ...] = _registry()  # every field, in declaration order
BY_NAME: dict[str, SamplingField] = {f.name: f for f in FIELDS}
_SEQUENCES = tuple(f for f in FIELDS if f.type is tuple)
_MAPPINGS = tuple(f for f in FIELDS if f.type is dict)
DEVICE: tuple[SamplingField, ...] = tuple(f for f in FIELDS if f.device is not None)
DEVICE_FIELDS: tuple[str, ...] = tuple(f.name for f in DEVICE)  # sampling matrix columns
DEVICE_COLUMN: dict[str, int] = {name: i for i, name in enumerate(DEVICE_FIELDS)}
PAD_ROW: tuple[float, ...] = tuple(f.device.pad for f in DEVICE)  # type: ignore[union-attr]
