"""Tool calls out of a sample's text: one incremental parser per output format.

Data flow: a sample's text, as the engine detokenizes it (whole, or in stream deltas) ->
`parser.feed(piece)` ... `parser.finish()` -> events, in order: content text (`str`) and
`CallDelta`s (a call's first delta carries its id and name, later ones append to its
arguments) -> the front maps them to OpenAI's `message.tool_calls` (`assemble`) or to
`delta.tool_calls` entries. A response is always parsed this way, whole or streamed, so a
stream's deltas add up to exactly the non-streamed message.

Formats, for tool_choice "auto" (the served model's, `--tool-call-parser`):
  - `hermes` (Qwen2/2.5/3, Hermes, the fallback prompt): every
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` is a call; text around them is
    content. A call is buffered until its closing tag: JSON that is not such an object stays
    content, tags included (never an error).
  - `llama3_json` (Llama 3.1/3.2 JSON tool calling): an output that starts (after whitespace
    and an optional `<|python_tag|>`) with a JSON object {"name": ..., "parameters": {...}}
    ("arguments" is read too) is a call, then more such objects separated by `;`; from the
    first text that is not one on, the rest is content.
The forced choices, whose text a grammar shapes (`tools.guide`): `NamedParser` (the text is
the named function's arguments, streamed as they come) and `RequiredParser` (a JSON array of
{"name", "parameters"} objects; each call's arguments stream once its name is known).
Content: with calls, trailing whitespace is dropped and whitespace alone is no content (None);
without calls it is the text exactly. `parallel=False` keeps the first call only,
`max_calls` (the server's --max-tool-calls) the first that many.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import re
import uuid
from typing import Any, Callable, Union

from jaxserve.engine.json_text import parse_or_none

HERMES, LLAMA3_JSON = "hermes", "llama3_json"
FORMATS = (HERMES, LLAMA3_JSON)
PYTHON_TAG = "<|python_tag|>"


def new_call_id() -> str:
    """OpenAI's shape of a tool call id: `call_` and 24 random characters."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclasses.dataclass
class CallDelta:
    """A piece of tool call `index`: the first carries `id` and `name`; `arguments` is
    appended to the call's arguments text (JSON once the call is complete)."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


Event = Union[str, CallDelta]  # str: content text


def assemble(events: list[Event]) -> tuple[str | None, list[dict[str, str]]]:
    """The message of a whole output's events: (content, [{"id", "name", "arguments"}]);
    content is None when calls were made and no text was left around them."""
    calls: list[dict[str, str]] = []
    text = []
    for e in events:
        if isinstance(e, str):
            text.append(e)
        elif e.id is not None:
            calls.append({"id": e.id, "name": e.name or "", "arguments": e.arguments})
        else:
            calls[e.index]["arguments"] += e.arguments
    content = "".join(text)
    return (content or None) if calls else content, calls


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that starts `marker` (it may become the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _call_of(obj: Any, keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call object, or None when it is not one: an object
    with a non-empty string "name" and its arguments under one of `keys` as an object (or as
    JSON text of one); absent arguments are {}."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):
        args = parse_or_none(args)
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


class ToolParser(abc.ABC):
    """Feed a sample's text in pieces, then `finish`; each returns the events it completed.
    `calls`: how many calls it has started (a response made calls when > 0)."""

    def __init__(self, parallel: bool = True, new_id: Callable[[], str] = new_call_id,
                 max_calls: int | None = None):
        self.parallel = parallel
        # None past the first without `parallel`, none past `max_calls` (--max-tool-calls).
        self.limit = 1 if not parallel else max_calls
        self.calls = 0  # calls started
        self._new_id = new_id
        self._held_ws = ""  # trailing whitespace of the content, not sent yet

    @abc.abstractmethod
    def feed(self, text: str) -> list[Event]:
        """The events the text so far completes (a piece may complete none)."""

    @abc.abstractmethod
    def finish(self) -> list[Event]:
        """The events of the text still held, the output having ended."""

    def _content(self, text: str) -> list[Event]:
        """Content text, its trailing whitespace held until more text follows."""
        text = self._held_ws + text
        body = text.rstrip()
        self._held_ws = text[len(body):]
        return [body] if body else []

    def _content_end(self) -> list[Event]:
        held, self._held_ws = self._held_ws, ""
        return [held] if held and not self.calls else []

    def _start(self, name: str, arguments: str = "") -> list[Event]:
        """A new call (none past `limit`)."""
        if self.limit is not None and self.calls >= self.limit:
            return []
        self.calls += 1
        return [CallDelta(self.calls - 1, arguments, self._new_id(), name)]


class HermesParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, parallel: bool = True, new_id: Callable[[], str] = new_call_id,
                 max_calls: int | None = None):
        super().__init__(parallel, new_id, max_calls)
        self._buf = ""
        self._in_call = False

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            marker = self.END if self._in_call else self.START
            at = self._buf.find(marker)
            if at < 0:
                if not self._in_call:  # content up to what may be a marker's start
                    keep = _held_prefix(self._buf, self.START)
                    out += self._content(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                return out
            before, self._buf = self._buf[:at], self._buf[at + len(marker):]
            if self._in_call:
                out += self._call(before, self.START + before + self.END)
            else:
                out += self._content(before)
            self._in_call = not self._in_call

    def finish(self) -> list[Event]:
        # An unclosed call counts when its JSON is complete (the model ended right after it).
        out = self._call(self._buf, self.START + self._buf) if self._in_call \
            else self._content(self._buf)
        self._buf, self._in_call = "", False
        return out + self._content_end()

    def _call(self, body: str, raw: str) -> list[Event]:
        call = _call_of(parse_or_none(body), ("arguments", "parameters"))
        return self._content(raw) if call is None else self._start(*call)


class _Brackets:
    """Where a JSON object or array ends, read incrementally: feed `end_in` the value's text so
    far (from its opening bracket) as it grows; brackets count outside strings only."""

    def __init__(self) -> None:
        self._depth, self._in_string, self._escaped, self._read = 0, False, False, 0

    def end_in(self, text: str) -> int | None:
        """The index after the value's closing bracket, or None while it is incomplete."""
        for i in range(self._read, len(text)):
            ch = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._read = i + 1
                    return i + 1
        self._read = len(text)
        return None


class Llama3JsonParser(ToolParser):
    def __init__(self, parallel: bool = True, new_id: Callable[[], str] = new_call_id,
                 max_calls: int | None = None):
        super().__init__(parallel, new_id, max_calls)
        self._buf = ""  # text not decided yet: the lead, then one object arriving
        self._lead = ""  # whitespace and <|python_tag|> before the first object
        self._mode = "start"  # -> "calls" (JSON objects) or "text" (content from here on)
        self._object: _Brackets | None = None  # the object in `_buf`, once it has begun

    def feed(self, text: str) -> list[Event]:
        if self._mode == "text":
            return self._content(text)
        self._buf += text
        if self._mode == "start":
            body = self._buf.lstrip()
            if body.startswith(PYTHON_TAG):
                body = body[len(PYTHON_TAG):].lstrip()
            if not body or PYTHON_TAG.startswith(body):
                return []  # whitespace, or what may become the tag
            if body[0] != "{":
                return self._to_text("")
            self._lead = self._buf[:len(self._buf) - len(body)]  # no content once calls come
            self._buf, self._mode = body, "calls"
        out: list[Event] = []
        while self._mode == "calls":
            if self._object is None:
                rest = self._buf.lstrip()
                if self.calls:
                    rest = rest.lstrip(";").lstrip()  # the separator between calls
                if not rest:
                    self._buf = rest
                    break
                if rest[0] != "{":
                    return out + self._to_text(rest)
                self._buf, self._object = rest, _Brackets()
            end = self._object.end_in(self._buf)
            if end is None:
                break
            call = _call_of(parse_or_none(self._buf[:end]), ("parameters", "arguments"))
            if call is None:  # not a call: the rest is content
                return out + self._to_text(self._buf)
            out += self._start(*call)
            self._buf, self._object = self._buf[end:], None
        return out

    def _to_text(self, rest: str) -> list[Event]:
        """Content from here on: `rest`, or before any call the whole text so far."""
        text = rest if self.calls else self._lead + self._buf
        self._mode, self._buf, self._lead, self._object = "text", "", "", None
        return self._content(text)

    def finish(self) -> list[Event]:
        # An unfinished object, or a lead still undecided, is content.
        out = self._to_text(self._buf.lstrip().lstrip(";") if self.calls else self._buf)
        return out + self._content_end()


class NamedParser(ToolParser):
    """tool_choice naming a function: the whole text is that function's arguments."""

    def __init__(self, name: str, new_id: Callable[[], str] = new_call_id):
        super().__init__(False, new_id)
        self.name = name

    def feed(self, text: str) -> list[Event]:
        if not self.calls:
            return self._start(self.name, text)
        return [CallDelta(0, text)] if text else []

    def finish(self) -> list[Event]:
        return [] if self.calls else self._start(self.name)


# An item's start up to its parameters (whose opening brace must have arrived: the
# whitespace before it is then all read).
_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,'
                   r'\s*"parameters"\s*:\s*(?=\{)')
# After whitespace, the structural character each state reads: "[" opens the array, "{"
# starts an item (then its head), "," separates items, "}" closes an item, "]" ends.
_EXPECTED = {"open": "[", "item": "{,]", "tail": "}"}


class RequiredParser(ToolParser):
    """tool_choice "required": `[{"name": ..., "parameters": {...}}, ...]` (the grammar's
    shape, properties in the schema's order). Reading stops at anything else; when no call
    was read, the whole text is content."""

    def __init__(self, parallel: bool = True, new_id: Callable[[], str] = new_call_id,
                 max_calls: int | None = None):
        super().__init__(parallel, new_id, max_calls)
        self._text = ""  # everything fed
        self._pos = 0  # what is read
        self._state = "open"  # open -> item -> head -> args -> tail -> item ... -> done
        self._args_start = 0
        self._args: _Brackets | None = None
        self._index: int | None = None  # the call being read, when it is sent

    def feed(self, text: str) -> list[Event]:
        self._text += text
        out: list[Event] = []
        while self._state != "done":
            if self._state == "head":
                m = _HEAD.match(self._text, self._pos)
                if m is None:
                    break  # still arriving (or never: then it is read no further)
                self._pos = self._args_start = m.end()
                started = self._start(json.loads(m.group(1)))
                self._index = self.calls - 1 if started else None
                out += started
                self._state, self._args = "args", _Brackets()
            elif self._state == "args":
                assert self._args is not None
                end = self._args.end_in(self._text[self._args_start:])
                stop = len(self._text) if end is None else self._args_start + end
                if stop > self._pos and self._index is not None:
                    out.append(CallDelta(self._index, self._text[self._pos:stop]))
                self._pos = stop
                if end is None:
                    break
                self._state = "tail"
            else:
                rest = self._text[self._pos:]
                body = rest.lstrip()
                if not body:
                    break
                ch = body[0]
                self._pos += len(rest) - len(body)
                if ch not in _EXPECTED[self._state] or ch == "]":
                    self._state = "done"
                elif ch == "{":
                    self._state = "head"  # the head's pattern reads the brace
                else:
                    self._pos += 1
                    self._state = "item"
        return out

    def finish(self) -> list[Event]:
        return [] if self.calls else self._content(self._text) + self._content_end()


def parser_for(fmt: str, parallel: bool = True, new_id: Callable[[], str] = new_call_id,
               max_calls: int | None = None) -> ToolParser:
    """The "auto" parser of a served format (`max_calls`: --max-tool-calls)."""
    cls = {HERMES: HermesParser, LLAMA3_JSON: Llama3JsonParser}[fmt]
    return cls(parallel, new_id, max_calls)
