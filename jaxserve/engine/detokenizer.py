"""Incremental detokenization with stop strings, one `IncrementalDetokenizer` per sequence.

Plain Python (no jax). Data flow: each generated token id -> `tokenizers`' DecodeStream, which
buffers bytes until they form whole UTF-8 characters (a multi-byte character split across
tokens is never emitted broken) -> appended to `text` -> stop-string search over the new tail
-> `pop_delta()` hands out everything except a held-back tail that could still turn into the
start of a stop string. So a streamed delta never contains text that a later token reveals to
be part of a stop string. When a stop string completes, the text is cut before it (or after it
with `include_stop_str_in_output`) and the sequence finishes with STOP_STRING.
"""

from __future__ import annotations

from tokenizers import Tokenizer as _Backend
from tokenizers.decoders import DecodeStream

from jaxserve.engine.sampling_params import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, backend: _Backend, params: SamplingParams):
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self._skip_special = params.skip_special_tokens
        self._stops = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._ids: list[int] = []
        self.text = ""  # all text so far (cut at a stop string once one is found)
        self._emitted = 0  # characters of `text` already handed out
        self._pending = False  # DecodeStream holds bytes not yet forming a character
        self.stopped = False  # a stop string was found

    def add_token(self, token_id: int) -> bool:
        """Append one token's text; True when it completed a stop string."""
        if self.stopped:
            return True
        self._ids.append(token_id)
        piece = self._stream.step(self._backend, token_id)
        if piece is None:
            self._pending = True
            return False
        self._pending = False
        start = max(0, len(self.text) - self._max_stop + 1)
        self.text += piece
        return self._find_stop(start)

    def _find_stop(self, start: int) -> bool:
        if not self._stops:
            return False
        best = -1
        best_len = 0
        for s in self._stops:
            i = self.text.find(s, start)
            if i != -1 and (best == -1 or i < best):
                best, best_len = i, len(s)
        if best == -1:
            return False
        self.text = self.text[: best + best_len] if self._include_stop else self.text[:best]
        self.stopped = True
        return True

    def _held_back(self) -> int:
        """Length of the tail of `text` that is a proper prefix of some stop string."""
        if self.stopped or not self._stops:
            return 0
        tail = self.text[-(self._max_stop - 1):] if self._max_stop > 1 else ""
        for n in range(len(tail), 0, -1):
            suffix = tail[-n:]
            if any(s.startswith(suffix) for s in self._stops):
                return n
        return 0

    def pop_delta(self) -> str:
        """New text safe to show now (nothing that may become part of a stop string)."""
        end = len(self.text) - self._held_back()
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta

    def finish(self, drop_last_token: bool = False) -> str:
        """Final delta when the sequence ends; `drop_last_token` leaves out an EOS/stop id.

        Bytes still buffered (an unfinished UTF-8 character) are decoded with replacement
        characters, exactly as a one-shot decode of the same ids would show them.
        """
        if not self.stopped:
            ids = self._ids[:-1] if drop_last_token else self._ids
            full = self._backend.decode(ids, skip_special_tokens=self._skip_special)
            if drop_last_token or self._pending:
                # Re-derive from a whole decode: the stream may hold the dropped id's bytes.
                if full.startswith(self.text[: self._emitted]):
                    self.text = full
        delta = self.text[self._emitted:]
        self._emitted = len(self.text)
        return delta
