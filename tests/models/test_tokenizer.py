"""Tokenizer tests against transformers as the oracle.

Our `Tokenizer.from_gguf` builds its `tokenizers` pipeline from GGUF metadata with our own code;
transformers builds one from the same file with its own conversion. Both must give identical ids
and identical decoded text on a few hundred deterministic strings, and a `save()`d tokenizer must
reload identically in our `from_hf_dir` and in `transformers.AutoTokenizer`.
"""

from __future__ import annotations

import json
import random

import gguf
import pytest

from jaxserve.models.bundled import bundled_model_path
from jaxserve.models.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")

FRAGMENTS = [
    # ASCII prose, contractions, punctuation
    "The quick brown fox jumps over the lazy dog.", "Hello, world!", "I'm sure they'll say it's fine.",
    "Don't stop; we've got 'quotes' and \"double quotes\".", "What?! No... really???",
    "e-mail: someone@example.com, url: https://example.org/a?b=c&d=e#frag",
    "UPPER lower MiXeD CamelCaseWord snake_case_word kebab-case-word",
    "A sentence.  Two spaces.   Three spaces.", "--- *** ___ ### !!! ??? ...",
    # digits and numbers
    "12345", "3.14159", "-42", "1,000,000", "2024-01-31T12:34:56Z", "0x1F", "1e-10", "v1.2.3",
    "Call 555-0100 at 9am", "x1y2z3", "10000000000000000000", "½ ² ³ ٣ ①", "a  1", "x\n\n2",
    "total:   42", "\t7", "pi is 3.14 and e is 2.718",
    # accents, combining marks, other scripts
    "café naïve façade Ångström über", "e\u0301 combining acute", "Ελληνικά κείμενα", "Привет, мир!",
    "你好，世界！", "日本語のテキストです。", "漢字とカタカナ", "안녕하세요 세계", "مرحبا بالعالم",
    "שלום עולם", "नमस्ते दुनिया", "สวัสดีชาวโลก", "Tiếng Việt có dấu",
    # emoji incl. ZWJ sequences, skin tones, flags, variation selectors
    "👍", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "❤️", "🤦🏼‍♂️", "🇫🇷🇯🇵", "emoji in text 😀 ok", "🧑🏿‍💻 codes",
    # code with tabs and newlines
    "def f(x):\n\treturn x * 2\n", "for (int i = 0; i < n; ++i) {\n    sum += a[i];\n}",
    "import numpy as np\n\n\nclass A:\n    pass\n", "SELECT * FROM t WHERE id = 42;",
    "<div class=\"a\">&amp;</div>", "{\"key\": [1, 2, 3], \"nested\": {\"x\": null}}",
    "#include <stdio.h>\r\nint main() { return 0; }\r\n", "    indented\n        more\n\ttab",
    # whitespace runs, leading/trailing spaces
    " ", "  ", "   ", " " * 7, "\t", "\t\t\t", "\n", "\n\n", "\n" * 5, "\r\n", " \n \n ", "\u00a0nbsp",
    "  leading", "trailing  ", "  both  ", " a b  c   d    e ", "line1\n\nline2\n\n\nline3",
    "\u3000ideographic space", "zero\u200bwidth",
    # empty string
    "",
]

SPECIAL_STRINGS = [
    "<|im_start|>user\nHello<|im_end|>\n", "<|im_start|>assistant\n", "text<|endoftext|>more",
    "<|im_end|><|im_end|>", " <|im_start|> spaced ", "<|endoftext|>", "a<|im_start|>b<|im_end|>c",
    "<repo_name>x<file_sep>y", "<|im_start", "im_end|>",
]


def _strings() -> list[str]:
    rng = random.Random(20240531)
    out = FRAGMENTS + SPECIAL_STRINGS
    out += ["a" * 3000, "ab " * 700, "😀" * 300, "12" * 500, " " * 100, "\n" * 60, "la " * 10 + "\t" * 9]
    seps = ["", " ", "  ", "\n", "\t", "\n\n", " \t ", "   "]
    pool = FRAGMENTS + SPECIAL_STRINGS
    for _ in range(200):
        parts = rng.sample(pool, rng.randint(2, 4))
        text = "".join(p + rng.choice(seps) for p in parts)
        out.append(text if rng.random() < 0.7 else rng.choice(seps) + text)
    return out


STRINGS = _strings()


@pytest.fixture(scope="module")
def bundled():
    return bundled_model_path()


@pytest.fixture(scope="module")
def ours(bundled) -> Tokenizer:
    return Tokenizer.from_gguf(bundled)


@pytest.fixture(scope="module")
def hf(bundled):
    from support.bundled_hf import bundled_hf_tokenizer  # transformers' reading of `bundled`

    return bundled_hf_tokenizer()


@pytest.fixture(scope="module")
def hf_ids(hf) -> dict[tuple[str, bool], list[int]]:
    return {(s, a): hf(s, add_special_tokens=a)["input_ids"] for s in STRINGS for a in (True, False)}


def test_string_set_is_large_and_varied():
    assert len(set(STRINGS)) >= 200
    assert "" in STRINGS and any(len(s) > 2000 for s in STRINGS)


@pytest.mark.parametrize("add_special", [True, False])
def test_encode_matches_transformers(ours, hf_ids, add_special):
    mismatches = [s for s in STRINGS if ours.encode(s, add_special) != hf_ids[(s, add_special)]]
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[0]!r}"


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(ours, hf, hf_ids, skip):
    for s in STRINGS:
        ids = hf_ids[(s, False)]
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), s


def test_roundtrip_without_specials(ours):
    for s in STRINGS:
        if not any(t in s for t in ("<|", "<repo_name>", "<file_sep>")):
            assert ours.decode(ours.encode(s)) == s
            assert ours.decode(ours.encode(s), skip_special_tokens=False) == s


def test_special_token_facts(ours):
    assert (ours.bos_token_id, ours.eos_token_ids, ours.pad_token_id) == (1, (2,), 2)
    assert ours.vocab_size == 49152
    assert ours.encode("<|im_start|>", add_special_tokens=True) == [1]  # add_bos_token is False
    assert ours.token_to_id("<|im_end|>") == 2 and ours.id_to_token(0) == "<|endoftext|>"
    assert {0, 1, 2} <= set(ours.all_special_ids)
    assert ours.decode([1, 2, 0]) == "" and ours.decode([1, 2], False) == "<|im_start|><|im_end|>"
    assert ours.chat_template and "<|im_start|>" in ours.chat_template


def test_smollm_pretokenizer_divergence(bundled, ours, hf):
    # transformers splits SmolLM text with the plain GPT-2 regex; llama.cpp (and SmolLM's own
    # tokenizer.json) split digits off first, which groups the whitespace before a digit.
    assert hf.convert_ids_to_tokens(ours.encode("a  1")) == ["a", "Ġ", "Ġ", "1"]
    cpp = Tokenizer.from_gguf(bundled, compat="llama.cpp")
    assert [cpp.id_to_token(i) for i in cpp.encode("a  1")] == ["a", "ĠĠ", "1"]
    same = [s for s in STRINGS if not any(c.isspace() for c in s)]
    assert all(cpp.encode(s) == ours.encode(s) for s in same)


def test_save_reload_matches(ours, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    ours.save(out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == ours.chat_template and config["add_bos_token"] is False
    assert config["added_tokens_decoder"]["2"]["content"] == "<|im_end|>"
    again = Tokenizer.from_hf_dir(out)
    theirs = transformers.AutoTokenizer.from_pretrained(str(out))
    for s in STRINGS:
        for add in (True, False):
            expect = ours.encode(s, add)
            assert again.encode(s, add) == expect, s
            assert theirs(s, add_special_tokens=add)["input_ids"] == expect, s
    assert (again.bos_token_id, again.eos_token_ids, again.pad_token_id) == (1, (2,), 2)
    assert again.chat_template == ours.chat_template


def test_hf_dir_generation_config_eos(ours, tmp_path):
    ours.save(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert Tokenizer.from_hf_dir(tmp_path).eos_token_ids == (2, 0)


def _tiny_tokenizer_gguf(path) -> None:
    """A tiny byte-level vocab with add_bos_token=True, a Llama-3 split, a user-defined token,
    and a control token spelled outside the byte alphabet (kept a plain token by both sides)."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "1 2", "Ġ Ġ"]
    tokens = ["<unk>", "<s>", "</s>", "<think>", "<｜end▁of▁sentence｜>", *alphabet,
              *("".join(m.split()) for m in merges)]
    types = [3, 3, 3, 4, 3] + [1] * (len(tokens) - 5)
    w = gguf.GGUFWriter(str(path), arch="llama")
    for key, value in {"llama.block_count": 1, "llama.context_length": 64,
                       "llama.embedding_length": 32, "llama.feed_forward_length": 64,
                       "llama.attention.head_count": 2, "llama.attention.head_count_kv": 2,
                       "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
                       "tokenizer.ggml.unknown_token_id": 0}.items():
        w.add_uint32(key, value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "llama-bpe")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_tiny_gguf_bos_and_added_tokens(tmp_path):
    path = tmp_path / "tok.gguf"
    _tiny_tokenizer_gguf(path)
    ours = Tokenizer.from_gguf(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    samples = ["the thin 123 cat", " a  the", "<think>x</think>", "<s>hi</s>", "", "ab\n\n12  a",
               "<｜end▁of▁sentence｜>", "héllo 👍"] + STRINGS[:60]
    for s in samples:
        for add in (True, False):
            ids = ours.encode(s, add)
            assert ids == theirs(s, add_special_tokens=add)["input_ids"], (s, add)
            for skip in (True, False):
                assert ours.decode(ids, skip) == theirs.decode(ids, skip_special_tokens=skip), s
    assert ours.encode("x")[0] == 1 and ours.encode("x", add_special_tokens=False)[0] != 1
    ours.save(tmp_path / "saved")
    again = Tokenizer.from_hf_dir(tmp_path / "saved")
    reloaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "saved"))
    for s in samples:
        assert again.encode(s) == ours.encode(s) == reloaded(s)["input_ids"], s


def test_errors(tmp_path, ours):
    with pytest.raises(TypeError):
        ours.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
