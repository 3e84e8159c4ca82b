"""SamplingParams: the per-request generation knobs, validated once where they enter.

Plain Python (no jax). This module is the one registry of sampling fields: each field is
declared once below, with `knob(default, rule=..., help=..., device=...)`, and everything
else is derived from that declaration:
  - validation (`Rule`, in `sampling_rules`: the allowed values and the text error messages
    state them in);
  - the gRPC mapping (`server/proto_map.sampling_from_proto`, `server/client.sampling_to_proto`:
    proto field names equal these names);
  - the HTTP body parsing (`server/openai_schema.parse_completion`: type checks from the
    declared type);
  - the CLI flags (`jaxserve.cli.flags.add_sampling_flags`) and the batch job's line keys;
  - a mapping field (`logit_bias`, type `dict` in the registry) is stored as a sorted tuple of
    (key, value) pairs, so SamplingParams stays frozen and hashable; the sampler reads it as
    a sparse per-row bias (`jaxserve.engine.batch` packs it into i32/f32[S, MAX_LOGIT_BIAS]);
  - a spec field (`structured_outputs`, a frozen dataclass type in the registry) is given as
    that dataclass or as a mapping of its fields (a JSON object, a proto message's set fields);
    it travels as one nested message / object and has no CLI flag;
  - for fields with `device=Column(pad=...)`: one column of the step's f32[S, K] sampling
    matrix (`DEVICE_FIELDS` gives the column order, `PAD_ROW` the padding / warmup row, which
    must sample greedily with every filter and penalty off), and so the multi-host broadcast.
Every bad value raises ValueError naming the field and the allowed range, so the offline API
raises it and the servers map it to INVALID_ARGUMENT / 400. Checks across fields
(min_tokens <= max_tokens) are explicit code in `_validate`; checks against the model (top_k
and stop_token_ids within the vocabulary, a grammar against the vocabulary) are
`EngineLimits.check_params` and `EngineLimits.admit`.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, Mapping

from jaxserve.engine.errors import InvalidRequest
from jaxserve.engine.sampling_rules import (  # noqa: F401 - the limits, re-exported
    INT32_MAX, MAX_ABS_LOGIT_BIAS, MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORD_LEN, MAX_BAD_WORDS,
    MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N, MAX_REPETITION_PENALTY, MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TEMPERATURE, MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE, BadWords, Finite, IntIn, LogitBias, Rule, Spec, allowed_token_ids_rule,
    StopStrings, TokenIds, TopK, TruncatePromptTokens, ZeroOrFinite, _is_int, _pairs,
    check_text, show, token_key)
from jaxserve.engine.structured_outputs import StructuredOutputs


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
    # Grammar-constrained decoding (`jaxserve.engine.grammar`): compiled at admission, applied
    # on the device as a token mask before every other transform (logit bias included). The
    # reported logprobs stay those of the unconstrained model distribution, as with logit_bias.
    structured_outputs: StructuredOutputs | None = knob(
        None, rule=Spec(StructuredOutputs, "one of json / regex / choice / grammar / "
                        "json_object"), help="what the output must match")
    # vLLM's token filters (`jaxserve.engine.token_filter`, compiled at admission): applied
    # as the step's token mask, with the grammar's, so the reported logprobs stay the
    # model's own as above. None: every token allowed.
    allowed_token_ids: tuple[int, ...] | None = knob(
        None, rule=allowed_token_ids_rule(), help="sample only among these token ids")
    bad_words: tuple[str, ...] = knob(
        (), rule=BadWords(), help="a word the output may not contain (vLLM's bad_words: "
                                  "its last token masked once the rest is generated)")
    # Applied at admission (`EngineLimits.truncate`): the prompt keeps its last tokens, and
    # everything after (prompt logprobs, usage, the KV fit) sees the truncated prompt.
    truncate_prompt_tokens: int | None = knob(
        None, rule=TruncatePromptTokens(),
        help="keep only the prompt's last K tokens; -1: as many as leave room for max_tokens")
    # Per-request opt-out of the engine's speculative decoding (EngineConfig.
    # speculative_config): false, the request gets one token per step; its output is the
    # same either way (sampled in distribution, seeded and greedy token for token up to the
    # numerics of the step: docs/serving/speculative.md).
    speculative: bool = knob(True, help="let the engine propose and verify several tokens "
                                        "per step for this request (speculative decoding)")

    def __post_init__(self) -> None:
        # Accept lists / a single string / a dict from callers; store tuples (frozen,
        # hashable); a mapping sorted by key once valid, so equal mappings compare equal.
        for f in _MAPPINGS:
            object.__setattr__(self, f.name, _pairs(getattr(self, f.name)))
        for f in SPECS:  # a JSON object / proto message's fields -> the spec dataclass
            value = getattr(self, f.name)
            if isinstance(value, Mapping):
                object.__setattr__(self, f.name, f.type.from_mapping(value))  # type: ignore
        for f in _SEQUENCES:
            value = getattr(self, f.name)
            if isinstance(value, str) and f.item is str:
                object.__setattr__(self, f.name, (value,))
            elif value is None and f.optional:
                continue
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
SPECS = tuple(f for f in FIELDS if dataclasses.is_dataclass(f.type))  # nested specs
DEVICE: tuple[SamplingField, ...] = tuple(f for f in FIELDS if f.device is not None)
DEVICE_FIELDS: tuple[str, ...] = tuple(f.name for f in DEVICE)  # sampling matrix columns
DEVICE_COLUMN: dict[str, int] = {name: i for i, name in enumerate(DEVICE_FIELDS)}
PAD_ROW: tuple[float, ...] = tuple(f.device.pad for f in DEVICE)  # type: ignore[union-attr]
