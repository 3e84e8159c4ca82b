"""Tokenizer: text <-> token ids, plus the chat template, for GGUF files and HF checkpoint folders.

Data flow:
  GGUF metadata (`tokenizer.ggml.*`, via `gguf_header.read_gguf_metadata`) -> `from_gguf`:
  `gguf_vocab.build_backend` builds the `tokenizers.Tokenizer` of the file's kind (byte-level
  BPE "gpt2" or SentencePiece "llama": vocab, merges, pre-tokenizer/normalizer/decoder, control
  tokens as special added tokens), then the BOS/EOS post-processor, so that it encodes exactly
  like `transformers.AutoTokenizer.from_pretrained(dir, gguf_file=...)`;
  or `tokenizer.json` + `tokenizer_config.json` (+ special_tokens_map.json, generation_config.json,
  chat_template.jinja) -> `from_hf_dir`;
  -> `Tokenizer` (encode/decode/special ids/`apply_chat_template` via `chat_template.ChatTemplate`)
  -> `save(dir)` writes tokenizer.json + tokenizer_config.json that transformers loads identically.
No jax here: the HTTP/scheduler side tokenizes on the host.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
from typing import Iterable, Literal, Mapping

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as _Backend

from .chat_template import ChatTemplate
from .gguf_header import read_gguf_metadata
from .gguf_vocab import ADD_BOS_DEFAULT, build_backend, byte_alphabet


def _template_processor(bos: str | None, bos_id: int | None, eos: str | None,
                        eos_id: int | None, add_bos: bool, add_eos: bool) -> processors.TemplateProcessing:
    """The BOS/EOS post-processor shaped the way transformers rebuilds it from add_bos/eos_token."""
    add_bos = add_bos and bos is not None and bos_id is not None
    add_eos = add_eos and eos is not None and eos_id is not None
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    special = ([(bos, bos_id)] if add_bos else []) + ([(eos, eos_id)] if add_eos else [])
    return processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair),
                                         special_tokens=special)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special-token and chat-template facts a server needs."""

    def __init__(self, backend: _Backend, *, bos_token: str | None = None,
                 eos_token: str | None = None, pad_token: str | None = None,
                 unk_token: str | None = None, add_bos_token: bool = False,
                 add_eos_token: bool = False, extra_eos_ids: Iterable[int] = (),
                 chat_template: str | None = None, model_max_length: int | None = None) -> None:
        self._backend = backend
        self.bos_token, self.eos_token = bos_token, eos_token
        self.pad_token, self.unk_token = pad_token, unk_token
        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        eos = [self.token_to_id(eos_token)] if eos_token is not None else []
        self.eos_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys(int(i) for i in [*eos, *extra_eos_ids] if i is not None))

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_gguf(cls, path: str | os.PathLike,
                  compat: Literal["transformers", "llama.cpp"] = "transformers") -> "Tokenizer":
        """The tokenizer of a GGUF's `tokenizer.ggml.*` metadata: byte-level BPE
        (`tokenizer.ggml.model` "gpt2"), SentencePiece ("llama": Llama 2, Mistral, Gemma) or
        Gemma 4's ("gemma4": a BPE with stored merges, as llama.cpp reads it).

        compat="transformers" (default) encodes exactly like transformers' GGUF tokenizer.
        compat="llama.cpp" follows llama.cpp where the two differ: it splits digits for the
        `smollm`-like byte-level pre-tokenizers (as SmolLM's original HF tokenizer.json does;
        the two differ only where whitespace precedes a numeral, "a  1": `a Ġ Ġ 1` vs
        `a ĠĠ 1`; " ²"), and honours a SentencePiece file's `add_space_prefix=false`.
        """
        if compat not in ("transformers", "llama.cpp"):
            raise ValueError(f"compat={compat!r} must be 'transformers' or 'llama.cpp'")
        md = read_gguf_metadata(path)
        backend = build_backend(md, os.fspath(path), compat)
        tokens = md["tokenizer.ggml.tokens"]

        def named(key: str) -> str | None:
            i = md.get(f"tokenizer.ggml.{key}")
            return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

        bos, eos, unk, pad = (named(k) for k in ("bos_token_id", "eos_token_id",
                                                 "unknown_token_id", "padding_token_id"))
        add_bos = bool(md.get("tokenizer.ggml.add_bos_token",
                              ADD_BOS_DEFAULT[md["tokenizer.ggml.model"]]))
        add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
        backend.post_processor = _template_processor(
            bos, backend.token_to_id(bos) if bos else None, eos,
            backend.token_to_id(eos) if eos else None, add_bos, add_eos)
        # End-of-turn tokens stop generation too (llama.cpp's end-of-generation set).
        extra = [md[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
                 if isinstance(md.get(k), int)]
        arch = md.get("general.architecture")
        ctx = md.get(f"{arch}.context_length")
        template = md.get("tokenizer.chat_template")
        return cls(backend, bos_token=bos, eos_token=eos, pad_token=pad, unk_token=unk,
                   add_bos_token=add_bos, add_eos_token=add_eos, extra_eos_ids=extra,
                   chat_template=template if isinstance(template, str) else None,
                   model_max_length=ctx if isinstance(ctx, int) else None)

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load `tokenizer.json` + `tokenizer_config.json` (+ optional companions) from a folder."""
        root = pathlib.Path(path)
        if not (root / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{root}: no tokenizer.json (only fast tokenizers are supported)")
        try:
            backend = _Backend.from_file(str(root / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise ValueError(f"{root / 'tokenizer.json'}: cannot load: {e}") from None
        config = _read_json(root / "tokenizer_config.json")
        special_map = _read_json(root / "special_tokens_map.json")

        def special(name: str) -> str | None:
            value = config.get(name, special_map.get(name))
            return value.get("content") if isinstance(value, Mapping) else value

        bos, eos, unk, pad = (special(n) for n in ("bos_token", "eos_token", "unk_token", "pad_token"))
        # Tokens the config declares but tokenizer.json lacks are added, as transformers does.
        for entry in (config.get("added_tokens_decoder") or {}).values():
            content = entry.get("content") if isinstance(entry, Mapping) else None
            if isinstance(content, str) and backend.token_to_id(content) is None:
                flags = {k: bool(entry.get(k, False)) for k in ("lstrip", "rstrip", "single_word")}
                backend.add_tokens([AddedToken(content, special=bool(entry.get("special")),
                                               normalized=bool(entry.get("normalized", False)),
                                               **flags)])
        for token in (bos, eos, unk, pad):
            if isinstance(token, str) and backend.token_to_id(token) is None:
                backend.add_special_tokens([AddedToken(token, special=True, normalized=False)])
        add_bos, add_eos = bool(config.get("add_bos_token")), bool(config.get("add_eos_token"))
        # Like transformers: explicit add_bos/eos_token flags rebuild the post-processor;
        # otherwise tokenizer.json's own post-processor decides.
        if "add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None:
            backend.post_processor = _template_processor(
                bos, backend.token_to_id(bos) if bos else None,
                eos, backend.token_to_id(eos) if eos else None, add_bos, add_eos)
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        if (root / "chat_template.jinja").is_file():  # newer transformers save it separately
            template = (root / "chat_template.jinja").read_text(encoding="utf-8")
        gen_eos = _read_json(root / "generation_config.json").get("eos_token_id")
        extra = gen_eos if isinstance(gen_eos, list) else ([gen_eos] if gen_eos is not None else [])
        max_len = config.get("model_max_length")
        return cls(backend, bos_token=bos, eos_token=eos, pad_token=pad, unk_token=unk,
                   add_bos_token=add_bos, add_eos_token=add_eos, extra_eos_ids=extra,
                   chat_template=template if isinstance(template, str) else None,
                   model_max_length=max_len if isinstance(max_len, int) and max_len < 2**31 else None)

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text are matched whole."""
        if not isinstance(text, str):
            raise TypeError(f"encode() needs a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (special tokens dropped unless skip_special_tokens=False)."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        """Size of the id space, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(int(token_id))

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    @property
    def unk_token_id(self) -> int | None:
        return self._id(self.unk_token)

    @property
    def all_special_ids(self) -> tuple[int, ...]:
        """Ids decode(skip_special_tokens=True) drops, plus the named bos/eos/unk/pad ids."""
        ids = {i for i, t in self._backend.get_added_tokens_decoder().items() if t.special}
        ids.update(i for i in (self.bos_token_id, self.pad_token_id, self.unk_token_id,
                               *self.eos_token_ids) if i is not None)
        return tuple(sorted(ids))

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """The most UTF-8 bytes of input one token covers, or None when the tokenizer may drop
        or merge input (`_covers_every_byte`): admission refuses a text over max_model_len
        times this many bytes without tokenizing it. Computed once from the vocabulary: each
        token's length in bytes of text (a byte-level character is one byte, `<0x0A>` is
        counted as its 6 UTF-8 bytes, an added token is its text), at least 4 (an `unk` per
        character). Bytes a byte-level vocabulary cannot spell (SmolLM2 lacks 21 of 256, six
        of them control characters) are dropped by the tokenizer but counted by the bound."""
        spec = json.loads(self._backend.to_str())
        if not _covers_every_byte(spec):
            return None
        # A byte-level token spells each byte with one character of the byte alphabet.
        one_byte = set(byte_alphabet().values()) if _is_byte_level(spec) else set()
        longest = max(sum(1 if c in one_byte else len(c.encode("utf-8")) for c in t)
                      for t in self._backend.get_vocab(with_added_tokens=True))
        return max(longest, 4)

    @property
    def backend(self) -> _Backend:
        """The underlying `tokenizers.Tokenizer` (e.g. for offsets or streaming decode)."""
        return self._backend

    # ------------------------------------------------------------------ chat
    @functools.cached_property
    def _compiled_template(self) -> ChatTemplate:
        # Compiled on first use so a checkpoint with a broken template still serves completions.
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template; send a plain prompt instead")
        return ChatTemplate(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False, **kwargs: object) -> str | list[int]:
        """Render `messages` with the checkpoint's template (as HF does, special tokens such as
        bos_token are template variables); `tokenize` encodes without adding BOS/EOS again."""
        variables: dict[str, object] = {k: v for k, v in
                                        (("unk_token", self.unk_token), ("pad_token", self.pad_token))
                                        if v is not None}
        variables.update(kwargs)
        bos = variables.pop("bos_token", self.bos_token)
        eos = variables.pop("eos_token", self.eos_token)
        text = self._compiled_template.render(
            messages, add_generation_prompt=add_generation_prompt,
            bos_token=bos, eos_token=eos, **variables)  # type: ignore[arg-type]
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # ------------------------------------------------------------------ export
    def save(self, directory: str | os.PathLike) -> None:
        """Write tokenizer.json + tokenizer_config.json (config.json/generation_config.json,
        which carry the model's eos ids, are the checkpoint writer's job)."""
        root = pathlib.Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(root / "tokenizer.json"))
        added = {
            str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                     "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
            for i, t in sorted(self._backend.get_added_tokens_decoder().items())
        }
        config: dict[str, object] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token, "eos_token": self.eos_token,
            "pad_token": self.pad_token, "unk_token": self.unk_token,
            "add_bos_token": self.add_bos_token, "add_eos_token": self.add_eos_token,
            # HF's WordPiece-era cleanup would eat spaces before punctuation in BPE output.
            "clean_up_tokenization_spaces": False,
            "added_tokens_decoder": added,
        }
        if self.model_max_length is not None:
            config["model_max_length"] = self.model_max_length
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (root / "tokenizer_config.json").write_text(
            json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# Normalizers and pre-tokenizers that never remove input text (expanding it is fine: more
# text only means more tokens); `Split` / `Punctuation` only with a keeping behavior.
_KEEPING_NORMALIZERS = ("Prepend", "Replace")
_KEEPING_PRE_TOKENIZERS = ("ByteLevel", "Metaspace", "Digits", "Split", "Punctuation",
                           "UnicodeScripts")


def _parts(component: dict | None) -> list[dict]:
    if component is None:
        return []
    if component.get("type") == "Sequence":
        inner = component.get("normalizers") or component.get("pretokenizers") or []
        return [p for c in inner for p in _parts(c)]
    return [component]


def _is_byte_level(spec: dict) -> bool:
    return any(t.get("type") == "ByteLevel" for t in _parts(spec.get("pre_tokenizer")))


def _covers_every_byte(spec: dict) -> bool:
    """Whether each token of this tokenizer (a `tokenizers` JSON spec) stands for a bounded
    piece of the input: no normalizer or pre-tokenizer that deletes or shrinks text (NFKC,
    Strip, whitespace splitting), and a model that never merges unknown input into one token
    (byte-level or byte-fallback BPE/Unigram, or BPE with one `unk` per unknown character)."""
    for n in _parts(spec.get("normalizer")):
        if n.get("type") not in _KEEPING_NORMALIZERS:
            return False
        if n.get("type") == "Replace":
            pattern = (n.get("pattern") or {}).get("String")
            if pattern is None or len(n.get("content", "").encode()) < len(pattern.encode()):
                return False
    for t in _parts(spec.get("pre_tokenizer")):
        if t.get("type") not in _KEEPING_PRE_TOKENIZERS or t.get("behavior") == "Removed":
            return False
    model = spec.get("model") or {}
    byte_level = _is_byte_level(spec)
    if model.get("type") == "BPE":
        return bool(byte_level or model.get("byte_fallback")
                    or (model.get("unk_token") is not None and not model.get("fuse_unk")))
    if model.get("type") == "Unigram":
        return bool(byte_level or model.get("byte_fallback"))
    return False  # WordLevel / WordPiece: an unknown word of any length is one token


def _read_json(path: pathlib.Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
