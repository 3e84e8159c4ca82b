"""JSON-lines files for the batch command's tests."""

from __future__ import annotations

import json
import pathlib
from typing import Any


def write_jsonl(path: pathlib.Path, lines: list[Any]) -> pathlib.Path:
    """One line per item: a str as it is (a malformed line, say), anything else as JSON."""
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def read_jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]
