"""Grammar-constrained decoding, host side: specs compiled by llguidance, a matcher per sequence.

Data flow (issue 17; this module is its host half, not yet wired into requests):
  `StructuredOutputs` (vLLM's shape: exactly one of json / regex / choice / grammar /
  json_object) -> `GrammarCompiler.compile` once per request, at admission: the spec becomes an
  llguidance grammar, validated against the model's vocabulary, and a bad one raises
  InvalidRequest naming the field (`structured_outputs.json`, ...) -> `GrammarCompiler.matcher`
  once per sequence (n > 1: one each; a recomputed sequence replays its output tokens) -> each
  step: `SequenceGrammar.fill(bitmask, row)` writes the row's allowed tokens into the step's
  packed mask i32[S, ceil(vocab / 32)] (bit t % 32 of word t // 32: token t allowed), the
  sampler masks with it, then `accept(token)` advances the matcher. `finished` (the grammar
  reached its end) finishes the sequence with STOP; a row with no allowed token
  (`allows_nothing`) finishes it with an error rather than sampling from nothing.

llguidance builds its token trie from the model's `tokenizers` JSON (`Tokenizer.backend`), so
HF and GGUF-loaded tokenizers work alike. EOS is allowed exactly where the grammar may end.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np

from jaxserve.engine.errors import InvalidRequest
from jaxserve.models.tokenizer import Tokenizer

FIELDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
    """What a request's output must match: exactly one field set. `json` is a JSON schema (a
    dict or its JSON text; stored as canonical text so the spec stays hashable)."""

    json: Any = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # Lark syntax, as llguidance reads it
    json_object: bool = False  # any JSON object

    def __post_init__(self) -> None:
        given = [f for f in FIELDS if getattr(self, f) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequest(f"structured_outputs: give exactly one of {', '.join(FIELDS)}; "
                                 f"got {', '.join(given) or 'none'}", field="structured_outputs")
        if self.json is not None:
            try:
                schema = json.loads(self.json) if isinstance(self.json, str) else self.json
                text = json.dumps(schema, sort_keys=True)
            except (TypeError, ValueError) as e:
                raise InvalidRequest(f"structured_outputs.json is not JSON: {e}",
                                     field="structured_outputs.json") from e
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequest("structured_outputs.json must be a JSON schema object",
                                     field="structured_outputs.json")
            object.__setattr__(self, "json", text)
        if self.choice is not None:
            choice = tuple(self.choice) if isinstance(self.choice, (list, tuple)) else None
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise InvalidRequest("structured_outputs.choice must be a non-empty list of "
                                     "non-empty strings", field="structured_outputs.choice")
            object.__setattr__(self, "choice", choice)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequest(f"structured_outputs.{name} must be a non-empty string",
                                     field=f"structured_outputs.{name}")

    @property
    def field(self) -> str:
        return next(f for f in FIELDS if getattr(self, f) not in (None, False))


@dataclasses.dataclass(frozen=True)
class CompiledGrammar:
    """A validated llguidance grammar (serialized)."""

    text: str


def bitmask_words(vocab_size: int) -> int:
    """Width of a packed mask row: one bit per token, 32 tokens an int32 word."""
    return -(-vocab_size // 32)


class GrammarCompiler:
    """One per engine: llguidance's view of the model's vocabulary (built once, ~1 s for a
    50k vocabulary), and the specs -> grammars step."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        eos = list(tokenizer.eos_token_ids)
        self.vocab_size = vocab_size
        self.ll_tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos or None)

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """The spec's grammar; InvalidRequest naming the field when llguidance refuses it."""
        field = spec.field
        name = f"structured_outputs.{field}"
        try:
            if field == "json":
                text = llguidance.LLMatcher.grammar_from_json_schema(spec.json)
            elif field == "json_object":
                text = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
            elif field == "regex":
                text = llguidance.LLMatcher.grammar_from_regex(spec.regex)
            elif field == "choice":
                text = llguidance.grammar_from("choice", list(spec.choice))
            else:
                text = llguidance.LLMatcher.grammar_from_lark(spec.grammar)
        except ValueError as e:
            raise InvalidRequest(f"{name}: {e}", field=name) from e
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            text, self.ll_tokenizer)
        if is_error:
            raise InvalidRequest(f"{name} is not a usable grammar: {messages[0]}", field=name)
        return CompiledGrammar(text)

    def matcher(self, grammar: CompiledGrammar) -> "SequenceGrammar":
        return SequenceGrammar(llguidance.LLMatcher(self.ll_tokenizer, grammar.text,
                                                    log_level=0), self.vocab_size)


class SequenceGrammar:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._m = matcher
        self._words = bitmask_words(vocab_size)

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Write this sequence's allowed next tokens into `bitmask[row]` (i32[S, words])."""
        if bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.shape[1] != self._words:
            raise ValueError(f"bitmask must be int32 [rows, {self._words}], got "
                             f"{bitmask.dtype} {bitmask.shape}")
        llguidance.numpy.fill_next_token_bitmask(self._m, bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False when the grammar did not allow it (the matcher is
        then in its error state: `error` says why)."""
        return bool(self._m.consume_token(int(token))) and not self._m.is_error()

    @property
    def finished(self) -> bool:
        """The grammar reached its end: nothing may follow (the sequence stops)."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None

    @staticmethod
    def allows_nothing(bitmask: np.ndarray, row: int) -> bool:
        return not bitmask[row].any()
