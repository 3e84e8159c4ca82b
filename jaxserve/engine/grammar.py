"""Grammar-constrained decoding, host side: specs compiled by llguidance, a matcher per sequence.

Data flow:
  `StructuredOutputs` (`structured_outputs.py`: exactly one of json / regex / choice / grammar
  / json_object) -> `GrammarCompiler.compile` once per request, at admission: the spec becomes an
  llguidance grammar, validated against the model's vocabulary, and a bad one raises
  InvalidRequest naming the field (`structured_outputs.json`, ...) -> `GrammarCompiler.matcher`
  once per sequence (n > 1: one each; kept across preemption, since a recomputed sequence
  keeps its output tokens) -> each
  step: `SequenceGrammar.fill(bitmask, row)` writes the row's allowed tokens into the step's
  packed mask i32[S, ceil(vocab / 32)] (bit t % 32 of word t // 32: token t allowed), the
  sampler masks with it, then `accept(token)` advances the matcher. `finished` (the grammar
  reached its end) finishes the sequence with STOP; a row with no allowed token finishes it
  with ERROR and the reason (`batch.fill_bitmask`) rather than sampling from nothing.

llguidance builds its token trie from the model's `tokenizers` JSON (`Tokenizer.backend`), so
HF and GGUF-loaded tokenizers work alike. EOS is allowed exactly where the grammar may end.
"""

from __future__ import annotations

import dataclasses
import logging

import llguidance
import llguidance.numpy
import numpy as np

from jaxserve.engine.batch import bitmask_words
from jaxserve.engine.errors import InvalidRequest
from jaxserve.engine.structured_outputs import StructuredOutputs
from jaxserve.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def grammar_compiler(tokenizer: Tokenizer, vocab_size: int) -> "GrammarCompiler | None":
    """The engine's compiler, or None (logged) when llguidance cannot read the tokenizer's
    vocabulary: structured_outputs requests are then refused at admission, nothing else
    changes."""
    try:
        return GrammarCompiler(tokenizer, vocab_size)
    except Exception as e:  # noqa: BLE001 - any tokenizer llguidance cannot take
        log.warning("structured outputs are off: llguidance cannot read this tokenizer: %r", e)
        return None


@dataclasses.dataclass(frozen=True)
class CompiledGrammar:
    """A validated llguidance grammar (serialized)."""

    text: str


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
        except Exception as e:  # noqa: BLE001 - whatever the library refuses a spec with
            raise InvalidRequest(f"{name}: {e}", field=name) from e
        try:
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
                text, self.ll_tokenizer)
        except Exception as e:  # noqa: BLE001 - as above
            is_error, messages = True, [str(e)]
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

    def advance(self, token: int, num_output_tokens: int) -> bool:
        """`accept`, raising ValueError with the reason when the token was not allowed (the
        sampler masks with this grammar, so it means a bug or a corrupt step). Returns
        whether the grammar has now ended."""
        if not self.accept(token):
            raise ValueError(f"structured_outputs: output token {num_output_tokens - 1} (id "
                             f"{token}) is not allowed by the grammar: {self.error}")
        return self.finished

    @property
    def finished(self) -> bool:
        """The grammar reached its end: nothing may follow (the sequence stops)."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None

