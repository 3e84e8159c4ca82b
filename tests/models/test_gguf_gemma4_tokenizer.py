"""Gemma 4 GGUF vocabularies (`tokenizer.ggml.model = "gemma4"`) against two oracles.

llama.cpp's converter writes Gemma 4's tokenizer as its own kind: a BPE over code points with
the merges in the file, spaces as `▁`, and (llama.cpp's pre-type GEMMA4) the text cut into
newline runs and the rest before merging. A small Gemma-layout vocabulary
(support.spm_vocab.gemma_vocab with its merges, some of which join a newline to its
neighbours) is written as such a file. `Tokenizer.from_gguf` must encode exactly as
support.gemma4_bpe, a plain-Python reading of llama.cpp's steps, on fixed and generated text;
on text without newlines also as transformers' GemmaTokenizer built from the same vocabulary
and merges (which cuts no newlines); and decode must give the text back.
"""

from __future__ import annotations

import pathlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import gemma4_bpe
from support.spm_vocab import SPACE, gemma_vocab, write_spm_gguf
from support.tiers import fuzz_examples

from jaxserve.models.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

STRINGS = [
    "The quick brown fox jumps over the lazy dog.", "Hello, world!", "a", "", " ", "   ",
    "  leading", "trailing  ", " a b  c   d    e ", "tab\tsep\t\tvalues",
    "def tokenize(text):\n\treturn text.split()\n\nfor i in range(10):\n    print(i, i * 2)\n",
    "line1\n\nline2\n\n\nline3", "\n", "\n\n", "\n" * 5, "x\ny", ")\n\nfor", "\r\n",
    "café 你好世界", "naïve façade", "👍🏽 emoji 😀", "日本語のテキスト", "\x00\x01",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", "<table><b>x</b>",
    "<bos>x<eos>", "a<mask>b",
]
SPECIALS = ["<pad>", "<eos>", "<bos>", "<mask>", "<start_of_turn>", "<end_of_turn>",
            "<table>", "<b>"]


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """(vocabulary, ours) for a tokenizer.ggml.model="gemma4" file."""
    vocab = gemma_vocab(with_merges=True)
    path = tmp_path_factory.mktemp("gemma4") / "tok.gguf"
    write_spm_gguf(path, vocab, arch="gemma4", model="gemma4", add_space_prefix=False)
    return vocab, Tokenizer.from_gguf(path)


def _expected(vocab, text: str, add_bos: bool) -> list[int]:  # noqa: ANN001
    tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in vocab.tokens]
    return gemma4_bpe.encode(tokens, vocab.merges, SPECIALS, text,
                             bos=vocab.bos if add_bos else None)


def _uncut(vocab, text: str) -> list[int]:  # noqa: ANN001
    """The same BPE without llama.cpp's newline cut: the whole text one piece."""
    tokens = list(vocab.tokens)
    return gemma4_bpe.merge_piece(text.replace(" ", SPACE), {t: i for i, t in enumerate(tokens)},
                                  {tuple(m.split(" ")): r for r, m in enumerate(vocab.merges)})


def test_the_merges_cross_newlines_so_the_cut_matters(gemma4) -> None:  # noqa: ANN001
    """The vocabulary has merges joining a newline to other characters: without the cut,
    some fixed string tokenizes differently (so the tests below can fail)."""
    vocab, _ = gemma4
    assert any("\n" in m and m.strip("\n ") for m in vocab.merges)
    differs = [s for s in STRINGS if "<" not in s and _uncut(vocab, s) != _expected(vocab, s, False)]
    assert differs


@pytest.mark.parametrize("add_special", [True, False])
def test_encode_matches_llama_cpp_reading(gemma4, add_special: bool) -> None:  # noqa: ANN001
    vocab, ours = gemma4
    bad = [s for s in STRINGS if ours.encode(s, add_special) != _expected(vocab, s, add_special)]
    assert not bad, f"{len(bad)} of {len(STRINGS)} differ, first {bad[0]!r}"


def test_newline_free_text_matches_transformers_gemma_tokenizer(gemma4) -> None:  # noqa: ANN001
    vocab, ours = gemma4
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in vocab.tokens]
    theirs = GemmaTokenizer(vocab={t: i for i, t in enumerate(tokens)},
                            merges=[tuple(m.split(" ")) for m in vocab.merges])
    flat = [s for s in STRINGS if "\n" not in s and "<" not in s]
    for s in flat:
        assert ours.encode(s, False) == theirs(s, add_special_tokens=False)["input_ids"], s


def test_decode_restores_text_and_facts(gemma4) -> None:  # noqa: ANN001
    vocab, ours = gemma4
    for s in STRINGS:
        if "<" in s:
            continue
        assert ours.decode(ours.encode(s)) == s, s
    assert ours.add_bos_token and ours.encode("x")[0] == vocab.bos == ours.bos_token_id
    assert [ours.id_to_token(i) for i in ours.encode("ñ", False)] == ["<0xC3>", "<0xB1>"]
    assert ours.encode("<start_of_turn>", False) == [6]
    assert ours.decode([6]) == "" and ours.decode([8]) == "<table>"


def test_a_file_without_merges_is_refused_by_name(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "tok.gguf"
    write_spm_gguf(path, gemma_vocab(with_merges=False), arch="gemma4", model="gemma4")
    with pytest.raises(ValueError, match="gemma4.*lacks tokenizer.ggml.merges"):
        Tokenizer.from_gguf(path)


PROPERTY = settings(max_examples=fuzz_examples(150), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])
TEXT = st.lists(st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters=SPACE + "<"),
            max_size=20),
    st.sampled_from([" ", "  ", "\n", "\n\n", "\t", "the", "for", "(text):", "你好", "é"])),
    max_size=8).map("".join)


@PROPERTY
@given(text=TEXT)
def test_encode_property(gemma4, text: str) -> None:  # noqa: ANN001
    vocab, ours = gemma4
    assert ours.encode(text, False) == _expected(vocab, text, False)
    assert ours.decode(ours.encode(text, False)) == text
