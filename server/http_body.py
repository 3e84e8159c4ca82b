"""Reading an HTTP request's JSON body, with every wire-level bound the HTTP front promises.

Data flow of `read_json(request, ...)`:
  Content-Type -> JSON when absent, `application/json` or `application/*+json` (the types
  FastAPI, hence vLLM, parses as JSON); any other media type -> 415; a charset other than
  UTF-8 (or its ASCII subset) -> 415 naming it (RFC 8259: JSON on the wire is UTF-8)
  -> Content-Length over the app's `client_max_size` -> 413 before a byte of the body is read
  -> the body, read within `body_timeout` seconds (-> 408 and the connection is closed; a
  slow body cannot hold a connection and a handler forever) and at most `client_max_size`
  bytes (aiohttp counts the decompressed bytes; -> 413)
  -> strict UTF-8 decoding (invalid bytes -> 400)
  -> `json_depth(text)` (`engine/json_text.py`) without recursion; deeper than `max_depth`
  -> 400 (the C json parser recurses per level and would raise RecursionError on a body of
  100k `[`)
  -> `json.loads` (-> 400 with the parser's position).

A JSON-escaped lone surrogate (`"\\ud800"`) is valid JSON and comes through as a Python str
holding it; whether a text field may hold one is admission's call, not this layer's. Error
messages here never echo body text.
"""

from __future__ import annotations

import asyncio
import codecs
import json
from typing import Any

from aiohttp import web

from jaxserve.engine.json_text import json_depth, no_constant
from jaxserve.server.openai_schema import ApiError, bad_request

MAX_JSON_DEPTH = 32  # OpenAI's bodies nest 3 deep (a batch of token-id prompts)
_UTF8_CHARSETS = ("utf-8", "ascii")  # codecs' canonical names; ASCII is a subset of UTF-8
def _unsupported(message: str) -> ApiError:
    return ApiError(415, message, None, "invalid_request_error", "unsupported_media_type")


def check_content_type(request: web.Request) -> None:
    """415 unless the body is declared as (or not declared otherwise than) UTF-8 JSON."""
    if "Content-Type" not in request.headers:
        return  # curl-style clients: parsed as JSON, as FastAPI does
    media = request.content_type  # aiohttp: lower-cased, parameters stripped
    if media != "application/json" and not (
            media.startswith("application/") and media.endswith("+json")):
        raise _unsupported(f"Content-Type {media!r} is not JSON: send the body with "
                           "'Content-Type: application/json'")
    charset = request.charset
    if charset is None:
        return
    try:
        name = codecs.lookup(charset).name
    except LookupError:
        name = None
    if name not in _UTF8_CHARSETS:
        raise _unsupported(f"charset {charset!r} is not supported: send the JSON body "
                           "as UTF-8 (charset=utf-8 or none)")


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than the limit of {limit} bytes", None,
                    "invalid_request_error", "request_too_large")


async def read_body(request: web.Request, limit: int, body_timeout: float) -> bytes:
    """The raw body, bounded in size (`limit`: the app's client_max_size, which aiohttp
    enforces while reading) and in time."""
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit)
    try:
        async with asyncio.timeout(body_timeout):
            return await request.read()
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {body_timeout:g} s",
                       None, "invalid_request_error", "request_timeout") from None
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(limit) from None


async def read_json(request: web.Request, limit: int, body_timeout: float,
                    max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The body as a JSON value, or ApiError (400 / 408 / 413 / 415); see the module doc."""
    check_content_type(request)
    raw = await read_body(request, limit, body_timeout)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 (byte {e.start})") from None
    depth = json_depth(text)
    if depth > max_depth:
        raise bad_request(f"the request body nests {depth} levels deep; at most {max_depth} "
                          "are allowed")
    try:
        return json.loads(text, parse_constant=no_constant)
    except ValueError as e:  # JSONDecodeError; also a number too long to convert
        raise bad_request(f"the request body is not valid JSON: {_position(e)}") from None


def _position(error: ValueError) -> str:
    if isinstance(error, json.JSONDecodeError):
        return f"{error.msg} at line {error.lineno} column {error.colno}"
    return str(error)  # our NaN refusal, or int() refusing a number of > 4300 digits
