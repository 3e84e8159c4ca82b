"""vLLM's allowed_token_ids and bad_words end to end on a tiny random model, against a greedy
full-sequence rollout whose argmax is taken over the tokens the oracle allows (computed here
from the fields' definitions, independently of `jaxserve.engine.token_filter`), with filtered
and plain requests sharing overlapped steps, and nothing compiled after warmup (a filter is
the step's token mask, which the sampler's masked branch applies: no new executable).

The word tokenizer reads "w17" as token 17, so a bad word is written by its ids."""

from __future__ import annotations

import functools
from typing import Callable, Sequence as GenericSequence

import numpy as np
import pytest
from support.engine_fixtures import VOCAB, tiny_model

from jaxserve import LLM, SamplingParams
from jaxserve.engine.batch import fill_bitmask
from jaxserve.engine.sequence import FinishReason, Sequence
from jaxserve.engine.token_filter import compile_filter, pack
from jaxserve.models import decoder

MODEL = tiny_model()
PROMPTS = [[5, 9, 11, 40], [7, 3, 100, 12, 60, 8], [150, 42]]
N = 8


@functools.lru_cache(maxsize=None)
def _logits(seq: tuple[int, ...]) -> np.ndarray:
    T = 1 << (len(seq) - 1).bit_length()
    tokens = np.zeros((1, T), np.int32)
    tokens[0, : len(seq)] = seq
    logits = decoder.forward_jit(MODEL.params, tokens, np.array([len(seq)], np.int32),
                                 cfg=MODEL.config)
    return np.asarray(logits[0, len(seq) - 1])


def masked_rollout(prompt: GenericSequence[int], n: int,
                   allowed: Callable[[list[int]], np.ndarray]) -> list[int]:
    """Oracle: greedy decoding with the plain forward, the argmax over `allowed(output)`
    (bool[V]) at each step."""
    out: list[int] = []
    for _ in range(n):
        logits = _logits(tuple(prompt) + tuple(out))
        out.append(int(np.argmax(np.where(allowed(out), logits, -np.inf))))
    return out


def only(ids: GenericSequence[int]) -> Callable[[list[int]], np.ndarray]:
    mask = np.zeros(VOCAB, bool)
    mask[list(ids)] = True
    return lambda out: mask


def without(words: GenericSequence[GenericSequence[int]]) -> Callable[[list[int]], np.ndarray]:
    """vLLM's bad_words on token sequences: a word's last token is banned when the output
    ends with the rest of it (a one-token word always)."""
    def allowed(out: list[int]) -> np.ndarray:
        mask = np.ones(VOCAB, bool)
        for w in words:
            if len(w) == 1 or out[len(out) - len(w) + 1:] == list(w[:-1]):
                mask[w[-1]] = False
        return mask
    return allowed


def words(*ids: GenericSequence[int]) -> list[str]:
    return [" ".join(f"w{t}" for t in w) for w in ids]


@pytest.fixture
def llm(small_llm: LLM) -> LLM:
    """conftest's session engine (SMALL_CONFIG) over MODEL."""
    return small_llm


def greedy(max_tokens: int = N, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def plain(prompt: GenericSequence[int]) -> list[int]:
    return masked_rollout(prompt, N, lambda out: np.ones(VOCAB, bool))


def test_filters_give_the_masked_argmax_and_leave_neighbours_alone(llm: LLM) -> None:
    free = [plain(p) for p in PROMPTS]
    # allowed_token_ids without the greedy first token (nor EOS: it is masked like any id)
    allow = [t for t in range(3, 60) if t != free[0][0]][::3] + [free[0][3]]
    # bad_words: a one-token word (a greedy token) and a two-token word made of the greedy
    # continuation, so its last token is banned exactly when the output reaches its prefix
    a, b = free[1][0], free[1][1]
    assert a >= 3 and b >= 3 and a != b  # ids the word tokenizer writes as "w<id>"
    bad = [[free[1][2]] if free[1][2] >= 3 else [57], [a, b]]
    params = [greedy(allowed_token_ids=allow), greedy(bad_words=words(*bad)), greedy()]
    # The compile guard counts the process's compiles, the oracle's too: count around the
    # engine's work only (the oracle runs after).
    before = llm.engine.stats().compiles_after_warmup
    outs = llm.generate(PROMPTS, params, use_tqdm=False)  # one batch: they share steps
    # Logprobs stay the model's own distribution's, as with a grammar or a bias.
    lp = llm.generate([PROMPTS[0]], greedy(1, allowed_token_ids=allow, logprobs=1),
                      use_tqdm=False)[0].outputs[0].logprobs[0]
    assert llm.engine.stats().compiles_after_warmup == before
    assert max(lp, key=lp.get) == free[0][0]
    got = [o.outputs[0].token_ids for o in outs]
    assert got[0] == masked_rollout(PROMPTS[0], N, only(allow)) and got[0] != free[0]
    assert set(got[0]) <= set(allow)
    assert got[1] == masked_rollout(PROMPTS[1], N, without(bad)) and got[1] != free[1]
    assert bad[0][0] not in got[1]
    assert (a, b) not in set(zip(got[1], got[1][1:]))
    assert got[2] == free[2]  # an unfiltered row (and the padding rows) unaffected


class _Grammar:
    """A grammar matcher's face as `fill_bitmask` sees it: it allows `ids`."""

    error = None

    def __init__(self, ids: GenericSequence[int]) -> None:
        self.ids = ids

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        bitmask[row] = pack(np.isin(np.arange(VOCAB), self.ids))


def _bits(row: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")).tolist())


def test_a_filter_is_anded_into_the_grammar_mask() -> None:
    filt = compile_filter(SamplingParams(allowed_token_ids=[4, 5, 6, 7, 8]), VOCAB, None)
    both = Sequence("a", [1], SamplingParams(), (2,), 0.0, grammar=_Grammar([2, 5, 7, 9]),
                   token_filter=filt)
    alone = Sequence("b", [1], SamplingParams(), (2,), 0.0, token_filter=filt)
    none = Sequence("c", [1], SamplingParams(), (2,), 0.0, grammar=_Grammar([2]),
                   token_filter=filt)
    errors: list = []
    mask, rows = fill_bitmask(4, VOCAB, [(0, both), (1, alone), (3, none)], errors)
    assert _bits(mask[0]) == {5, 7} and _bits(mask[1]) == {4, 5, 6, 7, 8}
    assert rows.tolist() == [True, True, False, False]  # the failed row is left free
    assert errors == [(none, "allowed_token_ids / bad_words and the grammar leave no token "
                             "of the vocabulary to sample after 0 output tokens")]


def test_no_token_left_fails_that_request_alone(llm: LLM) -> None:
    params = [greedy(allowed_token_ids=[5, 9], bad_words=["w9"]),
              greedy(allowed_token_ids=[5], bad_words=["w5"]), greedy()]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == [5] * N
    dead = outs[1].outputs[0]
    assert dead.finish_reason is FinishReason.ERROR and dead.token_ids == []
    assert "allowed_token_ids / bad_words leave no token" in outs[1].error
    assert outs[2].outputs[0].token_ids == plain(PROMPTS[2])


def test_ids_outside_the_vocabulary_are_refused_by_name(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"^allowed_token_ids\[1\]=211 is outside the "
                                         r"vocabulary \[0, 211\)"):
        llm.generate([PROMPTS[0]], greedy(allowed_token_ids=[4, 211]), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^allowed_token_ids\[0\]=1000000000000 must be"):
        greedy(allowed_token_ids=[10**12])
    with pytest.raises(ValueError, match=r"^allowed_token_ids must not be empty"):
        greedy(allowed_token_ids=[])
    with pytest.raises(ValueError, match=r"^bad_words\[0\]='  ' must be a string with"):
        greedy(bad_words=["  "])


def test_bad_word_forms_follow_vllm() -> None:
    """Each word tokenized bare and with a leading space; the spaced form is kept only when
    it differs from the bare one and has as many tokens (vLLM's rule)."""
    table = {"hat": [10], " hat": [11], "big hat": [12, 10], " big hat": [13, 10],
             "cat": [14], " cat": [14], "odd": [15], " odd": [16, 17]}
    f = compile_filter(SamplingParams(bad_words=["hat", " big hat", "cat", "odd"]), 64,
                       lambda text: table[text])
    assert f is not None and f.words == (((12,), 10), ((13,), 10))
    mask = np.zeros((1, 2), np.int32)
    f.fill(mask, 0, [])
    bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little").astype(bool)
    assert not bits[[10, 11, 14, 15]].any() and bits[[12, 13, 16, 17]].all()
    f.fill(mask, 0, [3, 13])  # the spaced prefix of "big hat" was generated: still banned
    bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little").astype(bool)
    assert not bits[10]
    assert compile_filter(SamplingParams(), 64, None) is None
