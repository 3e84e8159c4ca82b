"""Host side of `jaxserve batch`: JSONL lines in, validated requests out; resume; ordered writer.

Plain Python (no jax, no model): everything here is tested without running an engine.

- `parse_line`: one input line -> a `LineRequest` (id, prompt or chat messages, the model it
  names, SamplingParams) or a `LineError` naming what is wrong (invalid JSON, missing/bad id,
  unknown key, both or neither of prompt/messages, a bad prompt, a model that is not a string,
  a sampling value SamplingParams rejects).
- `recover_output`: the resume scan of an existing OUT file. A trailing line that is cut short
  (no newline) or is not a JSON object was being written when the last run died: the file is
  truncated to the end of the last good line and that line is redone. Every good record counts
  as done, error records too (a bad line fails again the same way); `retry_errors` rewrites OUT
  without its error records (atomically: temp file + rename) so those lines run again.
- `ResultWriter`: one `os.write` of a complete `json + "\\n"` per record on an O_APPEND file,
  fsync'd every `fsync_interval` seconds and at close, so a crash leaves at most one partial
  last line, which `recover_output` cuts off.
- `OrderedSink`: results arrive in completion order, keyed by input line number; it writes the
  contiguous prefix so OUT follows the input order.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import pathlib
import time
from typing import Any, Iterator, Mapping

from jaxserve.engine.sampling_params import FIELDS as SAMPLING_FIELDS
from jaxserve.engine.sampling_params import SamplingParams

log = logging.getLogger("jaxserve.batch")

SAMPLING_KEYS = frozenset(f.name for f in SAMPLING_FIELDS)
REQUEST_KEYS = frozenset(("id", "prompt", "messages", "model"))
RequestId = str | int


@dataclasses.dataclass(frozen=True)
class LineRequest:
    """A valid input line: exactly one of `prompt` / `messages` is set."""

    line: int  # 1-based line number in IN
    id: RequestId
    prompt: str | list[int] | None
    messages: list[dict[str, Any]] | None
    params: SamplingParams
    model: str | None = None  # a LoRA adapter's name, or the base model's (None: the base)


@dataclasses.dataclass(frozen=True)
class LineError:
    """A line that cannot run; `id` is None when the line has no usable id."""

    line: int
    id: RequestId | None
    error: str

    def record(self) -> dict[str, Any]:
        rec: dict[str, Any] = {"id": self.id, "error": self.error}
        if self.id is None:
            rec["line"] = self.line
        return rec


def id_key(rid: RequestId) -> str:
    """Identity of an id across runs: 5 and "5" are different ids."""
    return json.dumps(rid)


def _usable_id(rid: object) -> bool:
    if isinstance(rid, bool):
        return False
    return isinstance(rid, int) or (isinstance(rid, str) and bool(rid))


def parse_line(text: str, line: int,
               defaults: Mapping[str, Any] | None = None) -> LineRequest | LineError:
    """Validate one JSONL line. `defaults` are SamplingParams fields used where the line gives
    none (the CLI's sampling flags)."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, a number over 4300 digits,
        return LineError(line, None, f"invalid JSON: {e}")  # nesting deeper than the stack
    if not isinstance(obj, dict):
        return LineError(line, None, f"a line must be a JSON object, got {type(obj).__name__}")
    if "id" not in obj:
        return LineError(line, None, "missing 'id'")
    rid = obj["id"]
    if not _usable_id(rid):
        return LineError(line, None, f"id={rid!r} must be a non-empty string or an integer")
    unknown = sorted(set(obj) - REQUEST_KEYS - SAMPLING_KEYS)
    if unknown:
        return LineError(line, rid, f"unknown key{'s' if len(unknown) > 1 else ''} "
                                    f"{', '.join(map(repr, unknown))}: a line holds 'id', "
                                    "'prompt' or 'messages', 'model', and SamplingParams "
                                    "fields")
    prompt = obj.get("prompt")
    messages = obj.get("messages")
    if (prompt is None) == (messages is None):
        return LineError(line, rid, "give exactly one of 'prompt' and 'messages'"
                         if prompt is None else "give either 'prompt' or 'messages', not both")
    # JSON shapes only: empty prompts, roles and token ranges are admission's checks.
    ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                           for t in prompt)
    if prompt is not None and not isinstance(prompt, str) and not ids:
        return LineError(line, rid, "prompt must be a string or a list of integer token ids")
    if messages is not None and not (isinstance(messages, list) and all(
            isinstance(m, dict) for m in messages)):
        return LineError(line, rid, "messages must be a list of {\"role\", \"content\"} "
                                    "objects")
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        return LineError(line, rid, f"model={model!r:.60} must be a string (the base model's "
                                    "name or a LoRA adapter's)")
    kwargs = dict(defaults or {})
    kwargs.update({k: v for k, v in obj.items() if k in SAMPLING_KEYS})
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:  # names the field and the allowed range
        return LineError(line, rid, str(e))
    except TypeError as e:  # e.g. "stop": 5 (not a list)
        given = sorted(k for k in obj if k in SAMPLING_KEYS)
        return LineError(line, rid, f"bad sampling parameter among {', '.join(given)}: {e}")
    return LineRequest(line, rid, prompt, messages, params, model)


def read_lines(path: pathlib.Path) -> Iterator[tuple[int, str | None, str | None]]:
    """Yield (line number, text, decode error) for each line of `path`; text None when the
    line is not UTF-8 (the error says so). A UTF-8 BOM at the start is dropped."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield n, None, f"line is not valid UTF-8: {e}"
                continue
            yield n, text.lstrip("\ufeff") if n == 1 else text, None


def count_lines(path: pathlib.Path) -> int:
    """Lines in `path` (a last line without a newline counts), reading 1 MiB at a time."""
    n = 0
    last = b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


# ----------------------------------------------------------------------------- resume
@dataclasses.dataclass
class ResumeState:
    """What an existing OUT already holds."""

    done_ids: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    done_lines: set[int] = dataclasses.field(default_factory=set)  # id-less error records
    records: int = 0
    truncated_bytes: int = 0  # cut off a partial last line
    dropped_errors: int = 0  # error records removed by retry_errors

    def occurrence_done(self, rid: RequestId, occurrence: int) -> bool:
        """Whether the `occurrence`-th (1-based) line with this id already has its record."""
        return occurrence <= self.done_ids[id_key(rid)]


def _good_record(raw: bytes) -> dict[str, Any] | None:
    if not raw.endswith(b"\n"):
        return None
    try:
        rec = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return rec if isinstance(rec, dict) and "id" in rec else None


def recover_output(path: pathlib.Path, retry_errors: bool = False) -> ResumeState:
    """Scan OUT for finished records; cut off a partial trailing line (see module doc)."""
    state = ResumeState()
    if not path.exists():
        return state
    keep: list[bytes] = []  # only with retry_errors: the lines to keep
    good_end = 0
    offset = 0
    bad_since: int | None = None  # offset where the current run of bad lines started
    with open(path, "r+b") as f:
        for raw in f:
            offset += len(raw)
            rec = _good_record(raw)
            if rec is None:
                bad_since = offset - len(raw) if bad_since is None else bad_since
                continue
            if bad_since is not None:
                log.warning("%s: ignoring a malformed line at byte %d", path, bad_since)
                bad_since = None
            good_end = offset
            if retry_errors and "error" in rec:
                state.dropped_errors += 1
                continue
            if retry_errors:
                keep.append(raw)
            state.records += 1
            if rec["id"] is None:
                if isinstance(rec.get("line"), int):
                    state.done_lines.add(rec["line"])
            else:
                state.done_ids[id_key(rec["id"])] += 1
        if good_end < offset:
            state.truncated_bytes = offset - good_end
            log.warning("%s: cut off %d bytes of a partial last line; that line is redone",
                        path, state.truncated_bytes)
            f.truncate(good_end)
            f.flush()
            os.fsync(f.fileno())
    if state.dropped_errors:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as t:
            t.writelines(keep)
            t.flush()
            os.fsync(t.fileno())
        os.replace(tmp, path)
    return state


# ----------------------------------------------------------------------------- writing
def encode_record(record: Mapping[str, Any]) -> bytes:
    """One JSON line, UTF-8, ending in a newline."""
    try:
        return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: fall back to \\u escapes
        return (json.dumps(record) + "\n").encode("ascii")


class ResultWriter:
    """Appends whole lines to OUT; each record is one write, fsync'd at intervals and at close."""

    def __init__(self, path: pathlib.Path, fsync_interval: float = 5.0):
        self.path = path
        self.fsync_interval = fsync_interval
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._last_sync = time.monotonic()
        self.records = 0

    def write(self, record: Mapping[str, Any]) -> None:
        data = memoryview(encode_record(record))
        while data:  # a regular file takes it in one write; loop for the odd short write
            data = data[os.write(self._fd, data):]
        self.records += 1
        if time.monotonic() - self._last_sync >= self.fsync_interval:
            self.sync()

    def sync(self) -> None:
        os.fsync(self._fd)
        self._last_sync = time.monotonic()

    def close(self) -> None:
        if self._fd >= 0:
            self.sync()
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "ResultWriter":
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class OrderedSink:
    """Takes each input line's result (a record, or None for nothing to write) in any order and
    writes the contiguous prefix in line order."""

    def __init__(self, writer: ResultWriter):
        self.writer = writer
        self.next_line = 1  # first line not yet written
        self._pending: dict[int, dict[str, Any] | None] = {}

    def put(self, line: int, record: dict[str, Any] | None) -> None:
        if line < self.next_line or line in self._pending:
            raise ValueError(f"line {line} already has a result")
        self._pending[line] = record
        while self.next_line in self._pending:
            rec = self._pending.pop(self.next_line)
            if rec is not None:
                self.writer.write(rec)
            self.next_line += 1

    @property
    def buffered(self) -> int:
        """Results held back because an earlier line is still running."""
        return len(self._pending)


__all__ = ["LineRequest", "LineError", "parse_line", "read_lines", "count_lines", "id_key",
           "ResumeState", "recover_output", "ResultWriter", "OrderedSink", "encode_record",
           "SAMPLING_KEYS"]
