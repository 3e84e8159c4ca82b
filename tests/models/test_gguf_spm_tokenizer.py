"""SentencePiece GGUF vocabularies (`tokenizer.ggml.model = "llama"`) against transformers.

Small SPM vocabularies (support.spm_vocab: learned pieces with scores, the 256 byte-fallback
pieces, control and user-defined tokens) are written into tiny GGUF files in the Llama 2 /
Mistral layout (prefix space via Metaspace, merges derived from the scores), the Gemma layout
(no prefix space, whitespace-run tokens stored with real spaces, merges by file order or stored
in the file) and Phi-3's (prefix space via a normalizer). Our `Tokenizer.from_gguf` must give
the same ids as `transformers.AutoTokenizer.from_pretrained(dir, gguf_file=...)` on a fixed set
of strings and on Hypothesis-generated text, with and without special tokens, the same decoded
text, and decode(encode(text)) must give the text back (byte fallback included). A `save()`d
tokenizer must load back identically in transformers and in `from_hf_dir`.
"""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from support.spm_vocab import SPACE, gemma_vocab, llama_vocab, write_spm_gguf
from support.tiers import fuzz_examples

from jaxserve.models.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEMPLATE = "{% for m in messages %}<start_of_turn>{{ m['content'] }}<end_of_turn>{% endfor %}"

# name -> (vocabulary, architecture, flags written into the file)
CASES = {
    "llama": (llama_vocab, "llama", dict(chat_template=TEMPLATE)),  # no add_bos flag: BOS on
    "llama-eos": (llama_vocab, "llama", dict(add_bos=False, add_eos=True)),
    "gemma2": (lambda: gemma_vocab(with_merges=False), "gemma2",
               dict(add_bos=True, add_eos=False, add_space_prefix=False, eot=7,
                    chat_template=TEMPLATE)),
    "gemma3-merges": (lambda: gemma_vocab(with_merges=True), "gemma3",
                      dict(add_bos=True, add_space_prefix=False)),
    "phi3": (llama_vocab, "phi3", dict(add_bos=True)),
}

SPECIALS = ["<s>", "</s>", "<unk>", "[INST]", "[/INST]", "<think>", "</think>", "<bos>", "<eos>",
            "<pad>", "<mask>", "<unused0>", "<start_of_turn>", "<end_of_turn>", "<table>", "<b>"]

STRINGS = [
    # ASCII prose and code
    "The quick brown fox jumps over the lazy dog.", "Hello, world!", "It's the weather, whether",
    "interesting international internet", "tokenization transformation", "nothing something",
    "def tokenize(text):\n\treturn text.split()\n", "for i in range(10):\n    print(i, i * 2)",
    "3.14 -42 2024 100", "x = {a: [1, 2], b: (3 + 4) * 5}", "UPPER lower MiXeD", "a", "zz",
    # whitespace: leading, trailing, runs, newlines, tabs
    " ", "  ", "   ", " " * 7, "\t", "\t\t\t", "\n", "\n\n", "\n" * 5, "\r\n", " \n \n ",
    "  leading", "trailing  ", "  both  ", " a b  c   d    e ", "line1\n\nline2\n\n\nline3",
    "tab\tsep\t\tvalues", "\u00a0nbsp", "\u3000ideographic", "zero\u200bwidth",
    # in the vocabulary (é, 你好) and outside it: byte fallback
    "café", "你好世界", "你好，世界！", "日本語のテキストです。", "안녕하세요", "Привет, мир!",
    "naïve façade Ångström über", "e\u0301 combining", "مرحبا", "नमस्ते",
    "👍", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "emoji in text 😀 ok", "\x00\x01\x7f", "\U0010fffd",
    # special and added tokens written in the text, and near misses
    "<s>hello</s>", "[INST] hi [/INST] there", "<think>plan</think> answer", "<bos>x<eos>",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", "<table><b>bold</b>",
    "<mask> <pad> <unk> <unused0>", " <s> spaced </s> ", "<0x41><0x0A>", "<s", "think>",
    "a<s>b", "<s><s>", "[INST]", "<end_of_turn>",
    SPACE + "literal" + SPACE + "spm" + SPACE + "space",
    "",
]


def _long_strings() -> list[str]:
    out = ["the " * 300, "a" * 2000, "😀" * 100, " " * 64, "\n" * 40]
    for i, s in enumerate(STRINGS):  # pairs of the fixed strings, joined by a few separators
        out.append(s + ["", " ", "  ", "\n", "\t"][i % 5] + STRINGS[(7 * i + 3) % len(STRINGS)])
    return out


ALL = STRINGS + _long_strings()


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory) -> tuple[str, pathlib.Path, Tokenizer, object]:
    make, arch, flags = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    write_spm_gguf(root / "tok.gguf", make(), arch=arch, **flags)
    ours = Tokenizer.from_gguf(root / "tok.gguf")
    theirs = transformers.AutoTokenizer.from_pretrained(str(root), gguf_file="tok.gguf")
    return request.param, root, ours, theirs


@pytest.mark.parametrize("add_special", [True, False])
def test_encode_matches_transformers(case, add_special):
    _, _, ours, theirs = case
    bad = [s for s in ALL
           if ours.encode(s, add_special) != theirs(s, add_special_tokens=add_special)["input_ids"]]
    assert not bad, f"{len(bad)} of {len(ALL)} differ, first {bad[0]!r}"


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(case, skip):
    _, _, ours, theirs = case
    for s in ALL:
        ids = theirs(s, add_special_tokens=True)["input_ids"]
        assert ours.decode(ids, skip) == theirs.decode(ids, skip_special_tokens=skip), s


def test_decode_restores_text(case):
    name, _, ours, _ = case
    for s in ALL:
        if any(t in s for t in SPECIALS) or SPACE in s:
            continue  # added tokens are dropped by skip; a literal ▁ reads back as a space
        # The Llama form prepends a space on encode and strips one leading space on decode,
        # so a text that starts with a space loses it (SentencePiece's legacy behaviour, and
        # transformers' for the same file: test_decode_matches_transformers).
        want = s[1:] if name.startswith("llama") and s.startswith(" ") else s
        assert ours.decode(ours.encode(s)) == want, s
        assert ours.decode(ours.encode(s, False), skip_special_tokens=False) == want, s


def test_pieces_and_special_facts(case):
    name, _, ours, theirs = case
    tokens = [ours.id_to_token(i) for i in ours.encode("hello world", add_special_tokens=False)]
    if name.startswith("gemma"):  # no prefix space; a space is written ▁
        assert not tokens[0].startswith(SPACE) and "".join(tokens) == f"hello{SPACE}world"
        assert (ours.bos_token_id, ours.pad_token_id, ours.unk_token_id) == (2, 0, 3)
        assert ours.decode([ours.token_to_id("<start_of_turn>")]) == ""
        assert ours.encode("<start_of_turn>", False) == [6]
        assert ours.encode("<table>", False) == [8] and ours.decode([8]) == "<table>"
        assert ours.encode("a  b", False)[1] == ours.token_to_id(SPACE * 2)  # respelled "  "
    else:
        assert tokens[0].startswith(SPACE) and "".join(tokens) == f"{SPACE}hello{SPACE}world"
        assert (ours.bos_token_id, ours.unk_token_id, ours.pad_token_id) == (1, 0, None)
        assert ours.encode("[INST]", False) == [ours.token_to_id("[INST]")]
    # "ñ" has no piece: its two UTF-8 bytes
    pieces = [ours.id_to_token(i) for i in ours.encode("ñ", False)]
    assert pieces[-2:] == ["<0xC3>", "<0xB1>"]
    assert ours.add_bos_token == (name != "llama-eos") and ours.add_eos_token == (name == "llama-eos")
    assert (ours.encode("x")[0] == ours.bos_token_id) == ours.add_bos_token
    assert (ours.encode("x")[-1] == ours.eos_token_ids[0]) == ours.add_eos_token
    assert ours.vocab_size == len(theirs)
    assert set(ours.all_special_ids) >= set(theirs.all_special_ids)
    assert ours.chat_template == (TEMPLATE if name in ("llama", "gemma2") else None)
    if name == "gemma2":
        assert ours.eos_token_ids == (1, 7)  # <eos> and the end-of-turn token
        text = ours.apply_chat_template([{"role": "user", "content": "hi"}])
        assert ours.encode(text, False) == theirs(text, add_special_tokens=False)["input_ids"]


def test_max_token_bytes_bounds_encoding(case):
    _, _, ours, _ = case
    bound = ours.max_token_bytes
    assert bound is not None
    for s in ALL:
        assert len(s.encode("utf-8")) <= bound * max(1, len(ours.encode(s, False))), s


def test_save_reloads_identically(case, tmp_path):
    _, _, ours, _ = case
    ours.save(tmp_path)
    again = Tokenizer.from_hf_dir(tmp_path)
    reloaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for s in ALL:
        for add in (True, False):
            expect = ours.encode(s, add)
            assert again.encode(s, add) == expect, s
            assert reloaded(s, add_special_tokens=add)["input_ids"] == expect, s
        ids = ours.encode(s)
        for skip in (True, False):
            assert reloaded.decode(ids, skip_special_tokens=skip) == ours.decode(ids, skip), s
    assert (again.bos_token_id, again.eos_token_ids[:1], again.unk_token_id) == \
        (ours.bos_token_id, ours.eos_token_ids[:1], ours.unk_token_id)
    assert again.add_bos_token == ours.add_bos_token and again.chat_template == ours.chat_template


# ------------------------------------------------------------------------------ properties
PROPERTY = settings(max_examples=fuzz_examples(200), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])
# Any text but surrogates; ▁ is SentencePiece's own space (it decodes to " "), so left out.
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters=SPACE),
               max_size=60)
MIXED = st.lists(st.one_of(TEXT, st.sampled_from([" ", "  ", "\n", "\t", "hello", "the",
                                                  "你好", "😀", "é"])), max_size=8).map("".join)


@pytest.fixture(scope="module")
def byte_fallback_pair(tmp_path_factory):
    """The Llama-layout and Gemma-layout tokenizers, ours and transformers'."""
    out = {}
    for name in ("llama", "gemma2"):
        make, arch, flags = CASES[name]
        root = tmp_path_factory.mktemp(f"prop-{name}")
        write_spm_gguf(root / "tok.gguf", make(), arch=arch, **flags)
        out[name] = (Tokenizer.from_gguf(root / "tok.gguf"),
                     transformers.AutoTokenizer.from_pretrained(str(root), gguf_file="tok.gguf"))
    return out


@PROPERTY
@given(text=st.one_of(TEXT, MIXED))
def test_roundtrip_and_ids_property(byte_fallback_pair, text):
    assume(not any(t in text for t in SPECIALS))
    for name, (ours, theirs) in byte_fallback_pair.items():
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs(text, add_special_tokens=False)["input_ids"], name
        # As in test_decode_restores_text: the Llama form loses one leading space.
        want = text[1:] if name == "llama" and text.startswith(" ") else text
        assert ours.decode(ids) == want, name
        assert ours.decode(ours.encode(text)) == want, name  # BOS dropped on the way back


# ------------------------------------------------------------------------------ llama.cpp, errors
def test_llama_cpp_compat_honours_add_space_prefix(tmp_path):
    write_spm_gguf(tmp_path / "tok.gguf", llama_vocab(), add_space_prefix=False)
    default = Tokenizer.from_gguf(tmp_path / "tok.gguf")  # transformers ignores the flag
    cpp = Tokenizer.from_gguf(tmp_path / "tok.gguf", compat="llama.cpp")
    text = "hello world  the end"
    plain = [cpp.id_to_token(i) for i in cpp.encode(text, False)]
    assert "".join(plain) == text.replace(" ", SPACE) and not plain[0].startswith(SPACE)
    assert default.id_to_token(default.encode(text, False)[0]).startswith(SPACE)
    for s in STRINGS:
        if not any(t in s for t in SPECIALS) and SPACE not in s:
            assert cpp.decode(cpp.encode(s)) == s, s


def test_errors_name_the_field(tmp_path):
    vocab = llama_vocab()
    bad = {"bert": dict(model="bert"), "scores": dict(scores=False),
           "types": dict(vocab=dataclasses.replace(vocab, types=(1, 1, 1))),
           "merges": dict(vocab=dataclasses.replace(vocab, merges=("a b c",)))}
    paths = {}
    for name, change in bad.items():
        paths[name] = tmp_path / f"{name}.gguf"
        write_spm_gguf(paths[name], **{"vocab": vocab, **change})
    with pytest.raises(ValueError, match=r"tokenizer.ggml.model='bert' is not supported"):
        Tokenizer.from_gguf(paths["bert"])
    with pytest.raises(ValueError, match=r"needs tokenizer.ggml.scores"):
        Tokenizer.from_gguf(paths["scores"])
    with pytest.raises(ValueError, match=r"tokenizer.ggml.token_type has 3 entries"):
        Tokenizer.from_gguf(paths["types"])
    with pytest.raises(ValueError, match=r"tokenizer.ggml.merges\[0\]='a b c'"):
        Tokenizer.from_gguf(paths["merges"])
