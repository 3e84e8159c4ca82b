"""Grammar-constrained decoding, host side: specs compiled by llguidance, a matcher per sequence.

Data flow:
  `StructuredOutputs` (`structured_outputs.py`: exactly one of json / regex / choice /
  grammar / json_object) -> `GrammarCompiler.compile` once per request, at admission: the
  spec becomes an llguidance grammar (a schema's listed-property objects closed first,
  `schema_closure`), validated against the model's vocabulary, and a bad one raises
  InvalidRequest naming the field (`structured_outputs.json`, ...) ->
  `GrammarCompiler.matcher` once per sequence (n > 1: one each; kept across preemption,
  since a recomputed sequence keeps its output tokens) -> each step:
  `SequenceGrammar.fill(bitmask, row)` writes the row's allowed tokens into the step's packed
  mask i32[S, ceil(vocab / 32)] (bit t % 32 of word t // 32: token t allowed), the sampler
  masks with it, then `accept(token)` advances the matcher. `finished` (the grammar reached
  its end) finishes the sequence with STOP; a row with no allowed token finishes it with
  ERROR and the reason (`batch_mask.fill_bitmask`) rather than sampling from nothing.

llguidance builds its token trie from the model's `tokenizers` JSON (`Tokenizer.backend`), so
HF and GGUF-loaded tokenizers work alike. EOS is allowed exactly where the grammar may end.

Whitespace in the JSON kinds (`json_options`): llguidance's own default allows any run of
whitespace between two JSON tokens, and a small model at temperature 1.0 can fill its whole
budget with it inside an object (470 lines of it, seen in serving). The default here is
`BOUNDED_WHITESPACE` instead; the request's `disable_any_whitespace` / `whitespace_pattern`
choose another. They are llguidance's `defaults`, so a schema's own `x-guidance` options (the
tool-call grammars' compact separators, a client's) still win.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import llguidance
import llguidance.numpy
import numpy as np

from jaxserve.engine.batch import bitmask_words
from jaxserve.engine.errors import InvalidRequest
from jaxserve.engine.schema_closure import close_all_objects, close_listed_objects
from jaxserve.engine.structured_outputs import StructuredOutputs
from jaxserve.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Between two JSON tokens: nothing, one space, or one newline and an indent of at most 16
# spaces or tabs. json.dumps' spacing and a pretty-printed object (4 levels of 4, 8 of 2) both
# fit; a run longer than that cannot be written, so whitespace costs at most 17 bytes a gap.
BOUNDED_WHITESPACE = r"( |\n[ \t]{0,16})?"


def _closed(schema: object, disable_additional_properties: bool | None) -> object:
    """The schema whose objects may carry the keys the request's option says (unset: those
    that list their properties may carry no others)."""
    if disable_additional_properties is None:
        return close_listed_objects(schema)
    return close_all_objects(schema) if disable_additional_properties else schema


def json_options(spec: StructuredOutputs) -> dict[str, object]:
    """llguidance's JSON options for the spec's whitespace choice (its JSON kinds)."""
    if spec.disable_any_whitespace:  # ',' and ':' alone, as vLLM's option
        return {"whitespace_flexible": False}
    pattern = spec.whitespace_pattern
    return {"whitespace_flexible": False,
            "whitespace_pattern": BOUNDED_WHITESPACE if pattern is None else pattern}


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
        self._eos = frozenset(eos)
        self.ll_tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos or None)

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """The spec's grammar; InvalidRequest naming the field when llguidance refuses it."""
        field = spec.field
        name = f"structured_outputs.{field}"
        if spec.whitespace_pattern is not None:
            self._check_pattern(spec.whitespace_pattern)
        try:
            if field == "json":  # listed-property objects closed: `schema_closure`
                schema = json.loads(spec.json)
                if isinstance(schema, bool):  # options apply to an object schema only
                    schema = {} if schema else {"not": {}}
                text = llguidance.LLMatcher.grammar_from_json_schema(
                    _closed(schema, spec.disable_additional_properties),
                    defaults=json_options(spec))
            elif field == "json_object":
                text = llguidance.LLMatcher.grammar_from_json_schema(
                    {"type": "object"}, defaults=json_options(spec))
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
        self._check_first_steps(name, text)
        return CompiledGrammar(text)

    def _check_pattern(self, pattern: str) -> None:
        """A whitespace_pattern llguidance cannot read, or one that matches something other
        than JSON whitespace (space, tab, newline, carriage return: the JSON would not
        parse), is refused naming it. The second is run as a grammar: the pattern less
        every whitespace string, which must match nothing (its first step fails)."""
        name = "structured_outputs.whitespace_pattern"
        regex = pattern.translate(_LARK_ESCAPES)  # inside a Lark /.../ literal
        try:
            text = llguidance.LLMatcher.grammar_from_regex(pattern)
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
                text, self.ll_tokenizer)
            if not is_error:
                other = llguidance.LLMatcher.grammar_from_lark(
                    f"start: W\nW: /{regex}/ & ~/[ \\t\\n\\r]*/")
                mask = np.zeros((1, bitmask_words(self.vocab_size)), np.int32)
                if _step_error(self.matcher(CompiledGrammar(other)), mask) is None:
                    is_error, messages = True, [
                        "it matches text other than spaces, tabs and newlines"]
        except Exception as e:  # noqa: BLE001 - whatever the library refuses a regex with
            is_error, messages = True, [str(e)]
        if is_error:
            raise InvalidRequest(f"{name} is not a usable whitespace regex: "
                                 f"{_first_line(messages[0])}", field=name)

    def _check_first_steps(self, name: str, text: str) -> None:
        """Refuse a grammar that validates but cannot run: its first mask fails, errs or
        allows no token (not even EOS), or one step later it does, for a few of the tokens
        the first mask allows (the first, middle and last non-EOS ids). llguidance builds
        lexer states and parser rows lazily, so a grammar past its limits (a regex
        `a{1000000}`, 6,000 alternatives in one rule) or with no string at all (`$ref`s
        that loop, a regex that matches nothing) is found only by running it. Done here,
        before the request is queued, so that these are the caller's 400 and not a failed
        step after admission; a grammar that breaks deeper still fails its request then."""
        mask = np.zeros((1, bitmask_words(self.vocab_size)), np.int32)
        try:
            first = self.matcher(CompiledGrammar(text))
            why = _step_error(first, mask)
            allowed = [t for t in np.flatnonzero(_mask_bits(mask, self.vocab_size))
                       if t not in self._eos]
            picks = sorted({allowed[0], allowed[len(allowed) // 2], allowed[-1]}) \
                if why is None and allowed else []
            for token in picks:
                probe = first.copy()
                why = (_step_error(probe, mask) if probe.accept(int(token)) else
                       probe.error or "a token its first mask allows was refused")
                if why is not None:
                    break
        except Exception as e:  # noqa: BLE001 - whatever the library fails a step with
            why = str(e) or type(e).__name__
        if why is not None:
            raise InvalidRequest(f"{name} is not a usable grammar: {why}", field=name)

    def matcher(self, grammar: CompiledGrammar) -> "SequenceGrammar":
        return SequenceGrammar(llguidance.LLMatcher(self.ll_tokenizer, grammar.text,
                                                    log_level=0), self.vocab_size)


class SequenceGrammar:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._m = matcher
        self._vocab_size = vocab_size
        self._words = bitmask_words(vocab_size)

    def copy(self) -> "SequenceGrammar":
        """An independent matcher at the same position."""
        return SequenceGrammar(self._m.deep_copy(), self._vocab_size)

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
        """Why the matcher stopped with an error: the first line of llguidance's message (a
        dump of its state and the whole grammar follows)."""
        return _first_line(self._m.get_error()) if self._m.is_error() else None



_LARK_ESCAPES = str.maketrans({"/": "\\/", "\n": "\\n", "\r": "\\r", "\t": "\\t"})


def _first_line(error: str) -> str:
    """llguidance's error is its first line; a dump of the matcher's state follows."""
    return error.splitlines()[0] if error else error


def _mask_bits(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """Row 0 of a packed i32 mask as bool[vocab_size] (bit t % 32 of word t // 32)."""
    return np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:vocab_size].astype(bool)


def _step_error(seq: SequenceGrammar, mask: np.ndarray) -> str | None:
    """Fill `seq`'s next mask into row 0 of `mask`: None if it allows a token (or the
    grammar has ended), else why not."""
    mask[:] = 0
    seq.fill(mask, 0)
    if seq.error is not None:
        return seq.error
    if not mask.any() and not seq.finished:
        return "it allows no output (no token of the vocabulary can continue it)"
    return None
