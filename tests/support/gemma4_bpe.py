"""A plain-Python reading of llama.cpp's Gemma 4 tokenizer (`tokenizer.ggml.model` "gemma4",
pre-type GEMMA4), the oracle the `gemma4` GGUF vocabulary builder is tested against.

The steps as llama.cpp's `llama-vocab.cpp` takes them for that pre-type: the text is cut at
the special (control and user-defined) tokens, matched whole, longest first; in each other
fragment every space becomes `▁` (U+2581, nothing prepended) and the fragment is split into
runs of newlines and runs of anything else (`[^\\n]+|[\\n]+`); each piece starts as its code
points and the adjacent pair of lowest merge rank is merged (the leftmost of equal rank),
again and again, while some pair has a rank; each resulting symbol is its token, or, when the
vocabulary lacks it, one `<0xNN>` token per UTF-8 byte. BOS in front when asked.
Written from that description, independent of `tokenizers`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

SPACE = "\u2581"


def encode(tokens: Sequence[str], merges: Sequence[str], specials: Sequence[str], text: str,
           bos: int | None = None) -> list[int]:
    """Token ids of `text` under the vocabulary `tokens`, the merges ("left right", in rank
    order) and the special tokens matched whole; `bos` prepended when given."""
    vocab = {t: i for i, t in enumerate(tokens)}
    rank = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
    ordered = sorted(set(specials), key=len, reverse=True)
    out = [] if bos is None else [bos]
    k, start = 0, 0
    while k <= len(text):
        hit = next((s for s in ordered if s and text.startswith(s, k)), None) \
            if k < len(text) else None
        if hit is None and k < len(text):
            k += 1
            continue
        out += _fragment(text[start:k], vocab, rank)
        if hit is None:
            break
        out.append(vocab[hit])
        k = start = k + len(hit)
    return out


def _fragment(text: str, vocab: dict[str, int], rank: dict[tuple[str, str], int]) -> list[int]:
    ids: list[int] = []
    for piece in re.findall(r"[^\n]+|\n+", text.replace(" ", SPACE)):
        ids += merge_piece(piece, vocab, rank)
    return ids


def merge_piece(piece: str, vocab: dict[str, int], rank: dict[tuple[str, str], int]) -> list[int]:
    """One pre-split piece's ids: lowest-rank merges over its code points, byte fallback."""
    symbols = list(piece)
    while len(symbols) > 1:
        ranked = [(rank[pair], i) for i, pair in enumerate(zip(symbols, symbols[1:]))
                  if pair in rank]
        if not ranked:
            break
        i = min(ranked)[1]  # the lowest rank; of equal ranks the leftmost
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
    ids: list[int] = []
    for s in symbols:
        if s in vocab:
            ids.append(vocab[s])
        else:
            ids += [vocab[f"<0x{b:02X}>"] for b in s.encode("utf-8")]
    return ids
