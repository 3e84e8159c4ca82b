"""GGUF vocabularies -> `tokenizers` pipelines, one builder per `tokenizer.ggml.model` kind.

Data flow:
  GGUF metadata (`tokenizer.ggml.*`, read by `tokenizer.Tokenizer.from_gguf`) -> `build_backend`
  picks the builder by `tokenizer.ggml.model`:
    "gpt2"  byte-level BPE: tokens spelled in GPT-2's byte alphabet + the file's merges, a split
            regex chosen by `tokenizer.ggml.pre`, ByteLevel decoder;
    "llama" SentencePiece (Llama 2, Mistral, TinyLlama, Gemma, Phi-3): tokens with `▁` for a
            space, `<0x00>`..`<0xFF>` byte-fallback pieces, and BPE merges taken from the file or
            derived from the vocabulary (by score; by file position for Gemma), with the
            normalizer / pre-tokenizer / decoder the architecture's SentencePiece form uses;
    "gemma4" Gemma 4's SentencePiece-style BPE as llama.cpp reads it (its pre-type GEMMA4):
            every space written `▁` (nothing prepended), the text cut into runs of newlines
            and runs of anything else, the file's merges over whole code points (no byte
            alphabet), `<0xNN>` byte fallback, BOS added unless the file says otherwise;
  -> control tokens as special added tokens, user-defined tokens as plain added tokens (both
  matched whole), the file's bos/eos/unk/pad tokens special; the BOS/EOS post-processor, the
  chat template and the eos ids are the caller's (`from_gguf`), `ADD_BOS_DEFAULT` gives the
  add_bos_token a file of each kind implies when it does not say.
Each pipeline encodes and decodes like `transformers.AutoTokenizer.from_pretrained(dir,
gguf_file=...)` on the same file. No jax here.
"""

from __future__ import annotations

from typing import Literal

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

__all__ = ["ADD_BOS_DEFAULT", "build_backend", "byte_alphabet"]

# GGUF token types (gguf.TokenType / llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4
_SPACE = "\u2581"  # SentencePiece's spelling of a space ("▁")

# add_bos_token when the file has no tokenizer.ggml.add_bos_token: llama.cpp (and transformers)
# add BOS to a SentencePiece vocabulary that does not say otherwise, never to a byte-level one.
ADD_BOS_DEFAULT = {"gpt2": False, "llama": True, "gemma4": True}

# Split regexes for `tokenizer.ggml.pre` values whose merges were learned on a non-GPT-2 split.
# The patterns are the published ones of those tokenizers (tiktoken-style for Llama 3, Qwen2's).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}
# llama.cpp splits every digit off before the GPT-2 regex for these; transformers' GGUF
# conversion does not (it uses the plain GPT-2 split), see `from_gguf(compat=...)`.
_DIGIT_SPLIT_PRES = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                     "minerva")
# Architectures whose SentencePiece vocabulary is Gemma's: no prefix space, whitespace-run
# tokens stored with real spaces, merge priority = file order (its scores do not follow it).
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")

Compat = Literal["transformers", "llama.cpp"]


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable char map: printable latin-1 bytes map to themselves, the other
    bytes to chars from U+0100 on, so every byte string is spelled in visible characters."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = (b for b in range(256) if b not in keep)
    spelled = {b: chr(b) for b in keep}
    spelled.update({b: chr(0x100 + n) for n, b in enumerate(extra)})
    return spelled


def build_backend(md: dict, where: str, compat: Compat = "transformers") -> _Backend:
    """The `tokenizers` pipeline (no post-processor yet) of a GGUF's vocabulary; `where` (the
    file) names the source in errors. An unknown `tokenizer.ggml.model` is refused by name."""
    kind = md.get("tokenizer.ggml.model")
    tokens = md.get("tokenizer.ggml.tokens")
    if kind not in ("gpt2", "llama", "gemma4"):
        raise ValueError(f"{where}: tokenizer.ggml.model={kind!r} is not supported (byte-level "
                         "BPE 'gpt2', SentencePiece 'llama' and Gemma 4's 'gemma4' are)")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{where}: GGUF lacks tokenizer.ggml.tokens (a list of strings)")
    types = md.get("tokenizer.ggml.token_type")
    if types is None:
        types = [1] * len(tokens)
    if not isinstance(types, list) or len(types) != len(tokens):
        raise ValueError(f"{where}: tokenizer.ggml.token_type has "
                         f"{len(types) if isinstance(types, list) else type(types).__name__} "
                         f"entries for {len(tokens)} tokens")
    if kind == "gpt2":
        return _byte_level(md, tokens, types, where, compat)
    if kind == "gemma4":
        return _gemma4(md, tokens, types, where)
    return _sentencepiece(md, tokens, types, where, compat)


def _file_merges(md: dict, where: str) -> list[tuple[str, str]] | None:
    """`tokenizer.ggml.merges` as pairs, or None when the file has none."""
    merges = md.get("tokenizer.ggml.merges")
    if merges is None:
        return None
    if not isinstance(merges, list):
        raise ValueError(f"{where}: tokenizer.ggml.merges is a {type(merges).__name__}, not a list")
    pairs = []
    for n, merge in enumerate(merges):
        parts = merge.split(" ") if isinstance(merge, str) else []
        if len(parts) != 2:
            raise ValueError(f"{where}: tokenizer.ggml.merges[{n}]={merge!r} is not two tokens "
                             "separated by one space")
        pairs.append((parts[0], parts[1]))
    return pairs


def _add_file_tokens(backend: _Backend, md: dict, tokens: list[str], types: list,
                     control: list[str]) -> None:
    """Control tokens (`control`, already filtered by the caller) and the file's named
    bos/eos/unk/pad tokens become special added tokens: matched whole in text, dropped by
    decode(skip_special_tokens). User-defined tokens (e.g. `<think>`, Gemma's `<table>`) that are
    in the vocabulary become plain added tokens: llama.cpp matches them whole as well."""
    vocab = backend.get_vocab(with_added_tokens=False)
    named = [tokens[i] for i in (md.get(f"tokenizer.ggml.{k}") for k in
                                 ("bos_token_id", "eos_token_id", "unknown_token_id",
                                  "padding_token_id"))
             if isinstance(i, int) and 0 <= i < len(tokens)]
    named = [t for t in dict.fromkeys(named) if t in vocab and t not in control]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in [*control, *named]])
    known = backend.get_vocab(with_added_tokens=True)
    user = [t for t, k in zip(tokens, types) if k == _USER_DEFINED and t in known]
    if user:
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def _byte_level(md: dict, tokens: list[str], types: list, where: str,
                compat: Compat) -> _Backend:
    """GPT-2 style byte-level BPE (SmolLM, Llama 3, Qwen2/3 GGUFs)."""
    merges = _file_merges(md, where)
    if merges is None:
        raise ValueError(f"{where}: GGUF lacks tokenizer.ggml.merges (a byte-level BPE needs them)")
    alphabet = byte_alphabet()
    letters = set(alphabet.values())
    # Tokens outside the byte alphabet get spelled as their UTF-8 bytes (as transformers does).
    vocab = {(t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    backend = _Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                  byte_fallback=False, ignore_merges=False))
    pre = md.get("tokenizer.ggml.pre")
    if pre in _PRE_SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif compat == "llama.cpp" and pre in _DIGIT_SPLIT_PRES:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:  # "gpt2", "smollm", ...: the GPT-2 split, which transformers uses for all others
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a mislabelled normal token (adding it
    # would grow the vocabulary past the model's), so it stays a plain BPE token.
    control = [t for t, k in zip(tokens, types) if k == _CONTROL and set(t) <= letters]
    _add_file_tokens(backend, md, tokens, types, control)
    return backend


def _derived_merges(vocab: dict[str, int], priority: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every cut of a piece into two pieces
    that are both in the vocabulary is a merge producing it, ranked by the produced piece's
    priority (its SentencePiece score: the higher the likelier, so the earlier it merges), ties
    broken towards the longer left and then the longer right part, and among one piece's cuts by
    the ids of the parts. This is the order transformers' conversion of a SentencePiece
    vocabulary produces, so both tokenize alike."""
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, score in priority.items():
        cuts = [(piece[:k], piece[k:]) for k in range(1, len(piece))
                if piece[:k] in vocab and piece[k:] in vocab]
        cuts.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        ranked.extend((score, len(left), len(right), left, right) for left, right in cuts)
    # A stable sort: equal keys keep the order of the pieces, then of their cuts.
    ranked.sort(key=lambda m: m[:3], reverse=True)
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece(md: dict, tokens: list[str], types: list, where: str,
                   compat: Compat) -> _Backend:
    """A SentencePiece vocabulary as a byte-fallback BPE, shaped per architecture.

    Llama / Mistral / TinyLlama (and any other architecture): a Metaspace pre-tokenizer writes
    each space as `▁` and puts one `▁` in front of the text (only at its very start, not after a
    special token), the decoder turns `▁` back into spaces, `<0xNN>` pieces back into bytes and
    drops that one leading space. transformers ignores `tokenizer.ggml.add_space_prefix=false`
    here; compat="llama.cpp" honours it (no prefix, nothing stripped), as llama.cpp does.
    Gemma: a normalizer writes spaces as `▁` and nothing is prepended; whitespace-only tokens
    that the file spells with real spaces are respelled with `▁` so the text can reach them.
    Phi-3: the prefix `▁` comes from a normalizer, so a text's own leading spaces stay separate
    from it ("  hi" -> `▁▁▁hi`; Metaspace would give `▁▁hi`).
    """
    arch = md.get("general.architecture")
    gemma = arch in _GEMMA_ARCHS
    if gemma:
        spelled = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    else:
        spelled = list(tokens)
    vocab = {t: i for i, t in enumerate(spelled)}
    merges = _file_merges(md, where)
    if merges is None:
        if gemma:  # Gemma's scores do not follow its merge order; the file's order does
            priority: dict[str, float] = {t: -i for i, t in enumerate(spelled)}
        else:
            scores = md.get("tokenizer.ggml.scores")
            if not isinstance(scores, list) or len(scores) != len(tokens):
                raise ValueError(
                    f"{where}: a SentencePiece GGUF without tokenizer.ggml.merges needs "
                    f"tokenizer.ggml.scores, one per token ({len(tokens)}); got "
                    f"{len(scores) if isinstance(scores, list) else type(scores).__name__}")
            priority = dict(zip(spelled, (float(s) for s in scores)))
        merges = _derived_merges(vocab, priority)
    unk_id = md.get("tokenizer.ggml.unknown_token_id")
    unk = spelled[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    # Byte fallback spells a character without a piece as its UTF-8 bytes; only a file missing
    # some `<0xNN>` piece falls through to unk (transformers' Llama form has no unk there and
    # drops the character).
    backend = _Backend(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                                  byte_fallback=True))
    prefix = True
    if gemma:
        prefix = False
        backend.normalizer = normalizers.Replace(" ", _SPACE)
    elif arch == "phi3":
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE),
                                                   normalizers.Replace(" ", _SPACE)])
    else:
        prefix = not (compat == "llama.cpp"
                      and md.get("tokenizer.ggml.add_space_prefix") is False)
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=_SPACE, prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(
        steps + ([decoders.Strip(content=" ", left=1, right=0)] if prefix else []))
    # Every control token is special here: a SentencePiece vocabulary has no spelling rule that
    # would make one a mislabel.
    control = [t for t, k in zip(tokens, types) if k == _CONTROL]
    # As the file spells them: a user-defined whitespace run ("   ") is then no vocabulary entry
    # (respelled above) and stays out of the added tokens, as in transformers.
    _add_file_tokens(backend, md, tokens, types, control)
    return backend


# llama.cpp's pre-split for Gemma 4 (LLAMA_VOCAB_PRE_TYPE_GEMMA4): merges never cross a
# boundary between a run of newlines and the text around it.
_NEWLINE_RUNS = r"[^\n]+|[\n]+"


def _gemma4(md: dict, tokens: list[str], types: list, where: str) -> _Backend:
    """Gemma 4's vocabulary (`tokenizer.ggml.model` "gemma4"), as llama.cpp tokenizes it: a
    BPE over whole code points whose merges the file stores (Gemma 4's converter writes
    them; there are no scores to derive them from), spaces written `▁` by a normalizer with
    no prefix, the text then cut into newline runs and the rest, characters without a piece
    spelled as `<0xNN>` byte pieces, and the decoder undoing all three. The same shape as
    transformers' GemmaTokenizer, plus llama.cpp's newline cut."""
    merges = _file_merges(md, where)
    if merges is None:
        raise ValueError(f"{where}: a tokenizer.ggml.model='gemma4' GGUF lacks "
                         "tokenizer.ggml.merges (its BPE needs them)")
    # A whitespace-only token spelled with real spaces is respelled with `▁`, as for Gemma 2 / 3
    # files: text reaches the model only through the normalizer's `▁`.
    spelled = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    unk_id = md.get("tokenizer.ggml.unknown_token_id")
    unk = spelled[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    backend = _Backend(models.BPE(vocab={t: i for i, t in enumerate(spelled)}, merges=merges,
                                  unk_token=unk, fuse_unk=True, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", _SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(_NEWLINE_RUNS), behavior="isolated")
    backend.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    control = [t for t, k in zip(tokens, types) if k == _CONTROL]
    _add_file_tokens(backend, md, tokens, types, control)
    return backend
