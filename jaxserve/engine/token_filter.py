"""vLLM's token filters, `allowed_token_ids` and `bad_words`, as the step's token mask.

Plain numpy (no jax). Data flow: a request's SamplingParams -> `compile_filter` at admission
(`EngineLimits.admit`: the ids checked against the vocabulary, each bad word tokenized) -> a
`TokenFilter` carried by the `Admitted` request and shared by its n sequences (it holds no
per-sequence state) -> each step that samples the sequence, `TokenFilter.fill` writes (or,
under a grammar, ANDs) its allowed next tokens into the row of the step's packed bitmask
(`batch.fill_bitmask`), the same i32[S, ceil(V / 32)] mask the sampler's masked branch
already applies for grammars: a filter adds no device array, no static argument and so no
executable (nothing compiles while serving).

What is allowed, as vLLM does it:
  - `allowed_token_ids`: only those ids (EOS too is masked unless listed);
  - `bad_words`: each word is tokenized alone in two forms, as written (leading spaces
    dropped) and with one leading space (kept only when it is another token sequence of the
    same length, as vLLM keeps it), without special tokens. A word of one token is never
    sampled; a word of k > 1 tokens forbids its last token whenever the sequence's last k - 1
    generated tokens are its first k - 1 (the prompt is not looked at, as in vLLM).
The words of several tokens depend on the sequence's output, so a step that masks such a row
behind a step in flight fills its mask late, once those tokens are in (`pipeline.Pipeline`,
as for grammars: `TokenFilter.follows_output`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from jaxserve.engine.errors import InvalidRequest
from jaxserve.engine.sampling_params import SamplingParams


def bitmask_words(vocab_size: int) -> int:
    """W, the width of a packed token mask row: one bit per token, 32 tokens an int32 word."""
    return -(-vocab_size // 32)


def pack(allowed: np.ndarray) -> np.ndarray:
    """bool[V] -> i32[W]: bit t % 32 of word t // 32 set = token t allowed (the grammar
    bitmask's layout)."""
    words = bitmask_words(len(allowed))
    bits = np.zeros(words * 32, np.uint8)
    bits[: len(allowed)] = allowed
    return np.packbits(bits, bitorder="little").view(np.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class TokenFilter:
    """A request's allowed_token_ids and bad_words, compiled against the vocabulary."""

    static: np.ndarray  # i32[W] packed: the allowed ids minus the one-token bad words
    # Words of several tokens: (the first k - 1 ids, the last id), checked every step.
    words: tuple[tuple[tuple[int, ...], int], ...] = ()

    @property
    def follows_output(self) -> bool:
        """Whether the mask depends on the sequence's generated tokens."""
        return bool(self.words)

    def fill(self, bitmask: np.ndarray, row: int, output_token_ids: Sequence[int],
             combine: bool = False) -> None:
        """Write the allowed next tokens of a sequence that generated `output_token_ids`
        into `bitmask[row]` (i32[S, W]); `combine`: AND them with what the row holds (a
        grammar's mask)."""
        mask = self.static.copy()
        bits = mask.view(np.uint32)
        for prefix, last in self.words:
            k = len(prefix)
            if k <= len(output_token_ids) and tuple(output_token_ids[-k:]) == prefix:
                bits[last // 32] &= np.uint32(0xFFFFFFFF ^ (1 << (last % 32)))
        if combine:
            bitmask[row] &= mask
        else:
            bitmask[row] = mask


def compile_filter(params: SamplingParams, vocab_size: int,
                   encode: Callable[[str], list[int]] | None) -> TokenFilter | None:
    """The request's filter (None: it has neither field), its allowed ids already checked
    against the vocabulary (`EngineLimits.check_params`); InvalidRequest naming the field
    for a word that tokenizes to nothing or outside the vocabulary, or bad_words without a
    tokenizer (`encode`: text -> ids, without special tokens)."""
    allowed_ids, bad = params.allowed_token_ids, params.bad_words
    if allowed_ids is None and not bad:
        return None
    allowed = np.ones(vocab_size, bool)
    if allowed_ids is not None:
        allowed[:] = False
        allowed[list(allowed_ids)] = True
    words: list[tuple[tuple[int, ...], int]] = []
    for i, word in enumerate(bad):
        for ids in _word_forms(i, word, vocab_size, encode):
            if len(ids) == 1:
                allowed[ids[0]] = False
            else:
                words.append((tuple(ids[:-1]), ids[-1]))
    return TokenFilter(pack(allowed), tuple(dict.fromkeys(words)))


def _word_forms(i: int, word: str, vocab_size: int,
                encode: Callable[[str], list[int]] | None) -> list[list[int]]:
    """The token sequences of bad word `i`: as written without its leading spaces, and with
    one leading space when that is a different sequence of the same length (vLLM's rule: a
    word in the middle of a text usually starts with a space token)."""
    if encode is None:
        raise InvalidRequest("bad_words needs the model's tokenizer; this engine has none",
                             "bad_words")
    bare = encode(word.lstrip())
    if not bare:
        raise InvalidRequest(f"bad_words[{i}] tokenizes to no tokens", "bad_words")
    forms = [bare]
    spaced = encode(" " + word.lstrip())
    if spaced and len(spaced) == len(bare) and spaced[0] != bare[0]:
        forms.append(spaced)
    for ids in forms:
        for t in ids:
            if not 0 <= t < vocab_size:
                raise InvalidRequest(f"bad_words[{i}] tokenizes to id {t}, outside the "
                                     f"model's vocabulary [0, {vocab_size})", "bad_words")
    return forms
