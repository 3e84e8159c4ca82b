"""Small SentencePiece-style vocabularies in tiny GGUF files, for the SPM tokenizer tests.

`llama_vocab()` lays a vocabulary out as Llama 2 / Mistral GGUFs do: <unk> (type UNKNOWN), <s>,
</s>, the 256 byte-fallback pieces <0x00>..<0xFF> (type BYTE), a couple of control and
user-defined tokens, then pieces learned by a few hundred BPE merges over `CORPUS` (score -rank,
so the score order is the merge order) and last the single characters (lowest scores).
`gemma_vocab()` lays it out as Gemma's files do: <pad> <eos> <bos> <unk> <mask>, an unused
slot, <start_of_turn>/<end_of_turn> (control), HTML-ish user-defined tokens, whitespace-run
tokens stored with real spaces ("  "), the byte pieces, the learned pieces in merge order with
scores that do NOT follow that order (Gemma's converter must use the file order), optionally
the merges themselves (newer converters store them). Characters outside `CORPUS` (emoji, most
CJK, accented letters but é) have no piece, so byte fallback spells them.
`write_spm_gguf` writes one into a tensor-less GGUF with the gguf package's writer.
"""

from __future__ import annotations

import collections
import dataclasses
import pathlib
import random

import gguf

SPACE = "\u2581"
T = gguf.TokenType

CORPUS = (
    "The quick brown fox jumps over the lazy dog. Hello, world! It's a test of the tokenizer, "
    "and these are the words that the merges are learned from: there, their, then, other, "
    "another, together, weather, whether, mother, brother, thinking, things, nothing, something, "
    "interesting, international, internet, interpretation, tokenization, transformation. "
    "def tokenize(text):\n\treturn text.split()\n\nfor i in range(10):\n    print(i, i * 2)\n"
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 2024 3.14 -42; symbols: ( ) [ ] { } < > = + - * / % "
    "# @ & | ^ ~ ` \" ' ? ! : ; _ $ \\ café 你好 你好世界"
)


@dataclasses.dataclass(frozen=True)
class SpmVocab:
    """One SentencePiece vocabulary as a GGUF stores it (tokenizer.ggml.* arrays and ids)."""

    tokens: tuple[str, ...]
    scores: tuple[float, ...]
    types: tuple[int, ...]
    merges: tuple[str, ...] | None
    bos: int
    eos: int
    unk: int
    pad: int | None


def learn_merges(corpus: str, count: int) -> list[tuple[str, str]]:
    """`count` BPE merges over the corpus's words, each spelled `▁word` (SentencePiece's view
    of a space-separated word); the most frequent pair first, ties by the pair itself."""
    words = collections.Counter(SPACE + w for w in corpus.split(" ") if w)
    spelled = {w: list(w) for w in words}
    merges: list[tuple[str, str]] = []
    for _ in range(count):
        pairs: collections.Counter[tuple[str, str]] = collections.Counter()
        for w, n in words.items():
            parts = spelled[w]
            for a, b in zip(parts, parts[1:]):
                pairs[(a, b)] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        for w in words:
            parts, out, k = spelled[w], [], 0
            while k < len(parts):
                if k + 1 < len(parts) and (parts[k], parts[k + 1]) == best:
                    out.append(parts[k] + parts[k + 1])
                    k += 2
                else:
                    out.append(parts[k])
                    k += 1
            spelled[w] = out
    return merges


def _chars() -> list[str]:
    return sorted(set(CORPUS.replace(" ", SPACE)) | {SPACE})


def _pieces(merges: list[tuple[str, str]], head: set[str]) -> list[str]:
    """The pieces the merges produce, in merge order, less those the head already has."""
    return [p for p in dict.fromkeys(a + b for a, b in merges) if p not in head]


BYTES = [f"<0x{b:02X}>" for b in range(256)]


def llama_vocab(n_merges: int = 240) -> SpmVocab:
    head = [("<unk>", T.UNKNOWN), ("<s>", T.CONTROL), ("</s>", T.CONTROL)]
    head += [(b, T.BYTE) for b in BYTES]
    head += [("[INST]", T.CONTROL), ("[/INST]", T.CONTROL),
             ("<think>", T.USER_DEFINED), ("</think>", T.USER_DEFINED)]
    merges = learn_merges(CORPUS, n_merges)
    pieces = _pieces(merges, {t for t, _ in head})
    chars = [c for c in _chars() if c not in pieces]
    tokens = [t for t, _ in head] + pieces + chars
    types = [int(k) for _, k in head] + [int(T.NORMAL)] * (len(pieces) + len(chars))
    scores = [0.0] * len(head) + [-float(i) for i in range(len(pieces))]
    scores += [-1e4 - i for i in range(len(chars))]
    assert len(set(tokens)) == len(tokens)
    return SpmVocab(tuple(tokens), tuple(scores), tuple(types), None, bos=1, eos=2, unk=0, pad=None)


def gemma_vocab(n_merges: int = 240, with_merges: bool = False) -> SpmVocab:
    head = [("<pad>", T.CONTROL), ("<eos>", T.CONTROL), ("<bos>", T.CONTROL),
            ("<unk>", T.UNKNOWN), ("<mask>", T.CONTROL), ("<unused0>", T.UNUSED),
            ("<start_of_turn>", T.CONTROL), ("<end_of_turn>", T.CONTROL),
            ("<table>", T.USER_DEFINED), ("<b>", T.USER_DEFINED),
            # whitespace runs as Gemma's files spell them (real spaces), one of them user-defined
            ("  ", T.NORMAL), ("   ", T.USER_DEFINED), ("\n\n", T.NORMAL), ("\t\t", T.NORMAL)]
    head += [(b, T.BYTE) for b in BYTES]
    merges = learn_merges(CORPUS, n_merges)
    pieces = _pieces(merges, {t for t, _ in head})
    chars = [c for c in _chars() if c not in pieces]
    tokens = [t for t, _ in head] + pieces + chars
    types = [int(k) for _, k in head] + [int(T.NORMAL)] * (len(pieces) + len(chars))
    # Scores that contradict the file order: a converter ranking merges by them would differ.
    rng = random.Random(7)
    scores = [0.0] * len(head) + [-rng.uniform(0, 1000) for _ in pieces + chars]
    stored = None
    if with_merges:  # the learned merges, plus the ones building the respelled space runs
        stored = tuple([f"{SPACE} {SPACE}", f"{SPACE}{SPACE} {SPACE}", "\n \n", "\t \t"]
                       + [f"{a} {b}" for a, b in merges])
    assert len(set(tokens)) == len(tokens)
    return SpmVocab(tuple(tokens), tuple(scores), tuple(types), stored, bos=2, eos=1, unk=3, pad=0)


def write_spm_gguf(path: pathlib.Path, vocab: SpmVocab, *, arch: str = "llama",
                   add_bos: bool | None = None, add_eos: bool | None = None,
                   add_space_prefix: bool | None = None, chat_template: str | None = None,
                   eot: int | None = None, model: str = "llama", scores: bool = True) -> None:
    """A tensor-less GGUF of architecture `arch` carrying `vocab`; the add_* flags are only
    written when given (a file without add_bos_token gets llama.cpp's default, BOS on);
    `model` (tokenizer.ggml.model) and `scores=False` (no tokenizer.ggml.scores) make a file
    the tokenizer must refuse."""
    w = gguf.GGUFWriter(str(path), arch=arch)
    for key, value in {"block_count": 1, "context_length": 128, "embedding_length": 32,
                       "feed_forward_length": 64, "attention.head_count": 2,
                       "attention.head_count_kv": 2, "attention.key_length": 16,
                       "attention.value_length": 16, "vocab_size": len(vocab.tokens)}.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre("default")
    w.add_token_list(list(vocab.tokens))
    if scores:
        w.add_token_scores(list(vocab.scores))
    w.add_token_types(list(vocab.types))
    if vocab.merges is not None:
        w.add_token_merges(list(vocab.merges))
    w.add_bos_token_id(vocab.bos)
    w.add_eos_token_id(vocab.eos)
    w.add_unk_token_id(vocab.unk)
    if vocab.pad is not None:
        w.add_pad_token_id(vocab.pad)
    if eot is not None:
        w.add_uint32("tokenizer.ggml.eot_token_id", eot)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
