#!/usr/bin/env python
"""How often a small model at temperature 1.0 gets a complete, valid JSON answer when it asks
for one: JSON-schema requests per whitespace mode, and forced tool calls with and without
`parallel_tool_calls: false` and `strict: true` (issue #29 item 4).

Data flow: ONE `jaxserve serve` subprocess (the bundled SmolLM2-135M unless --model; every
port explicit, `front_overhead_server.serve`) -> this process sends OpenAI chat requests
to /v1/chat/completions, --concurrency at a time (aiohttp), at temperature 1.0, each with
its own seed:
  - schemas: --num-requests requests spread over the five SCHEMAS (flat, nested, arrays,
    enums, and one without additionalProperties: false), each as response_format json_schema,
    once per --whitespace mode, spelled as a client would:
      before    the engine before issue #29: any whitespace run between tokens, and objects
                without additionalProperties open (written out: whitespace_pattern
                "[ \\t\\n\\r]*" and `"additionalProperties": true` where the schema says
                nothing);
      flexible  structured_outputs {"whitespace_pattern": "[ \\t\\n\\r]*"} alone: the
                whitespace of before, the objects closed as now;
      default   nothing: the bounded default (one space, or a newline and an indent <= 16),
                listed-property objects closed;
      compact   structured_outputs {"disable_any_whitespace": true};
      dumps     json.dumps' spacing (", " and ": ", nothing else): disable_any_whitespace
                and the schema's own x-guidance separators (the forced tool calls' form);
  - tool calls: --num-tool-requests requests over the TOOL_PROMPTS with the three TOOLS and
    tool_choice "required", as: parallel_before (parallel_tool_calls true, the parameters
    opened as before), parallel (true, the default), parallel_false, and
    parallel_false_strict ("strict": true on every function).
-> per row: the fraction of answers that are valid (the content parses as JSON and validates
against its schema with jsonschema; a tool answer: finish_reason "tool_calls" and every call's
arguments parse and validate against its function's parameters), how many ended at the length
limit, the mean completion tokens (the server's usage), for tool rows the mean calls per
answer, and how many invalid answers hold a whitespace gap the bounded default cannot write
(two newlines, or a newline and 17 blanks). A table on stdout; everything, with the first
invalid answers' text, in --json.

CPU-heavy (520 requests of up to --max-tokens tokens by default): try it on a few first,
    python scripts/bench/bench_json_validity.py --num-requests 5 --num-tool-requests 3
then the full run:
    python scripts/bench/bench_json_validity.py \\
        --json benchmarks/results/json_validity_2026-12-04/json_validity.json
`--bound-schemas` adds maxLength / maxItems where the schemas have none (what a schema author
can do about content that runs on); the figures: benchmarks/results/json_validity_2026-12-04/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import re
import statistics
import sys
import time
from typing import Any

import aiohttp
import jsonschema
from front_overhead_server import Ports, free_port, serve
from tqdm.auto import tqdm

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string"}},
        "required": ["name", "age", "email"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "order_id": {"type": "integer"},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string"},
            "address": {"type": "object", "properties": {
                "city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"], "additionalProperties": False}},
            "required": ["name", "address"], "additionalProperties": False}},
        "required": ["order_id", "customer"], "additionalProperties": False},
    "arrays": {"type": "object", "properties": {
        "title": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "ratings": {"type": "array", "items": {"type": "integer", "minimum": 1,
                                               "maximum": 5}}},
        "required": ["title", "tags", "ratings"], "additionalProperties": False},
    "enums": {"type": "object", "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "language": {"enum": ["en", "fr", "de", "es"]}},
        "required": ["sentiment", "confidence", "language"], "additionalProperties": False},
    "open": {"type": "object", "properties": {
        "city": {"type": "string"}, "country": {"type": "string"},
        "population": {"type": "integer", "minimum": 0}},
        "required": ["city", "population"]},
}
ASKS = {
    "flat": "Describe a fictional person as JSON with their name, age and email.",
    "nested": "Write a JSON order with an order id and the customer's name and address.",
    "arrays": "Give a JSON summary of a movie: its title, a few tags and some ratings.",
    "enums": "Classify the sentiment and language of 'I love this phone!' as JSON.",
    "open": "Give the city of Paris as JSON with its country and population.",
}
TOOLS = [
    {"type": "function", "function": {
        "name": "book_flight", "description": "Book a flight between two cities",
        "parameters": {"type": "object", "properties": {
            "origin": {"type": "string"}, "destination": {"type": "string"},
            "date": {"type": "string", "description": "YYYY-MM-DD"},
            "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["origin", "destination", "date"]}}},
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather now in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search_hotels", "description": "Find hotels in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "nights": {"type": "integer", "minimum": 1},
            "max_price": {"type": "number"}},
            "required": ["city", "nights"]}}},
]
TOOL_PROMPTS = [
    "Book me a flight from Paris to Rome on 2026-05-01.",
    "What's the weather like in Tokyo?",
    "Find me a hotel in Berlin for three nights under 150 euros.",
    "I need to fly from New York to London next Friday with my wife.",
    "Is it raining in Seattle right now, in fahrenheit?",
]
FLEXIBLE = {"whitespace_pattern": "[ \t\n\r]*"}
WHITESPACE = {"before": FLEXIBLE, "flexible": FLEXIBLE, "default": None,
              "compact": {"disable_any_whitespace": True},
              "dumps": {"disable_any_whitespace": True}}
DUMPS = {"x-guidance": {"item_separator": ", ", "key_separator": ": "}}
# (parallel_tool_calls, strict, parameters opened as before)
TOOL_MODES = {"parallel_before": (True, False, True), "parallel": (True, False, False),
              "parallel_false": (False, False, False),
              "parallel_false_strict": (False, True, False)}


def opened(schema: Any) -> Any:
    """`schema` with `"additionalProperties": true` on each object that lists properties and
    says nothing of others: how the engine read it before issue #29 (the bench's schemas
    nest only through properties and items)."""
    if not isinstance(schema, dict):
        return schema
    out = {k: ({n: opened(v) for n, v in s.items()} if k == "properties" else
               opened(s) if k == "items" else s) for k, s in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = True
    return out


def bounded(schema: Any) -> Any:
    """`schema` with `maxLength` on each string and `maxItems` on each array that has
    none (--bound-schemas: what a schema author can do about content that runs on)."""
    if not isinstance(schema, dict):
        return schema
    out = {k: ({n: bounded(v) for n, v in s.items()} if k == "properties" else
               bounded(s) if k == "items" else s) for k, s in schema.items()}
    if out.get("type") == "string":
        out.setdefault("maxLength", MAX_LENGTH)
    if out.get("type") == "array":
        out.setdefault("maxItems", MAX_ITEMS)
    return out


MAX_LENGTH, MAX_ITEMS = 64, 8
# A gap the bounded default cannot write: two newlines, or a newline and 17 blanks (a raw
# newline is always between JSON tokens: inside a string it is escaped).
WHITESPACE_RUN = re.compile(r"\n[ \t]*\n|\n[ \t]{17,}")


def schema_body(name: str, mode: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    schema = bounded(SCHEMAS[name]) if args.bound_schemas else SCHEMAS[name]
    body: dict[str, Any] = {
        "messages": [{"role": "system", "content": "You answer in JSON."},
                     {"role": "user", "content": ASKS[name]}],
        "response_format": {"type": "json_schema", "json_schema": {
            "name": name,
            "schema": opened(schema) if mode == "before" else
            {**DUMPS, **schema} if mode == "dumps" else schema}}}
    if WHITESPACE[mode] is not None:
        body["structured_outputs"] = WHITESPACE[mode]
    return {**body, **_common(seed, args)}


def tool_body(i: int, mode: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    parallel, strict, before = TOOL_MODES[mode]
    tools = [{"type": "function", "function": {
        **t["function"], **({"strict": True} if strict else {}),
        **({"parameters": opened(t["function"]["parameters"])} if before else {})}}
        for t in TOOLS]
    body = {"messages": [{"role": "user", "content": TOOL_PROMPTS[i % len(TOOL_PROMPTS)]}],
            "tools": tools, "tool_choice": "required"}
    if not parallel:
        body["parallel_tool_calls"] = False
    return {**body, **_common(seed, args)}


def _common(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    return {"temperature": 1.0, "seed": seed,
            "max_completion_tokens": args.max_tokens}


def judge_schema(schema: dict[str, Any], reply: dict[str, Any]) -> tuple[bool, str]:
    """(valid, why not): the content parses as JSON and validates against the schema."""
    text = reply["choices"][0]["message"]["content"] or ""
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError) as e:
        return False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return True, ""


def judge_tools(reply: dict[str, Any]) -> tuple[bool, str, int]:
    """(valid, why not, calls): the answer ended with tool calls and each call's arguments
    parse and validate against the client's own parameters schema (not the strict one)."""
    choice = reply["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    if choice["finish_reason"] != "tool_calls" or not calls:
        return False, f"finish_reason {choice['finish_reason']}", len(calls)
    for call in calls:
        try:
            jsonschema.validate(json.loads(call["function"]["arguments"]),
                                by_name[call["function"]["name"]])
        except (ValueError, KeyError, jsonschema.ValidationError) as e:
            return False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}", len(calls)
    return True, "", len(calls)


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
               gate: asyncio.Semaphore, bar: tqdm) -> dict[str, Any]:
    async with gate:
        async with session.post(url, json=body) as resp:
            reply = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {reply}")
    bar.update(1)
    return reply


async def served_name(session: aiohttp.ClientSession, ports: Ports) -> str:
    async with session.get(f"http://127.0.0.1:{ports.http}/v1/models") as resp:
        return (await resp.json())["data"][0]["id"]


async def measure(args: argparse.Namespace, ports: Ports) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{ports.http}/v1/chat/completions"
    names = list(SCHEMAS)
    jobs: list[tuple[str, str, int, dict[str, Any]]] = []  # (row kind, mode, index, body)
    for mode in args.whitespace:
        jobs += [("schema", mode, i, schema_body(names[i % len(names)], mode, i, args))
                 for i in range(args.num_requests)]
    for mode in args.tool_modes:
        jobs += [("tools", mode, i, tool_body(i, mode, 1000 + i, args))
                 for i in range(args.num_tool_requests)]
    gate = asyncio.Semaphore(args.concurrency)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    with tqdm(total=len(jobs), desc="requests", unit="req") as bar:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            model = await served_name(session, ports)
            replies = await asyncio.gather(*(post(session, url, {**body, "model": model},
                                                  gate, bar) for *_, body in jobs))
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for (kind, mode, i, _), reply in zip(jobs, replies):
        row = rows.setdefault((kind, mode), {"kind": kind, "mode": mode, "requests": 0,
                                             "valid": 0, "length": 0, "tokens": [],
                                             "whitespace_runs": 0,
                                             "calls": [], "per_schema": {}, "invalid": []})
        if kind == "schema":
            name = names[i % len(names)]
            ok, why = judge_schema(bounded(SCHEMAS[name]) if args.bound_schemas else
                                   SCHEMAS[name], reply)
            per = row["per_schema"].setdefault(name, {"requests": 0, "valid": 0})
            per["requests"] += 1
            per["valid"] += ok
        else:
            ok, why, calls = judge_tools(reply)
            row["calls"].append(calls)
        row["requests"] += 1
        row["valid"] += ok
        row["length"] += reply["choices"][0]["finish_reason"] == "length"
        row["tokens"].append(reply["usage"]["completion_tokens"])
        if not ok:
            text = reply["choices"][0]["message"]["content"] or ""
            row["whitespace_runs"] += WHITESPACE_RUN.search(text) is not None
        if not ok and len(row["invalid"]) < 5:
            msg = reply["choices"][0]["message"]
            row["invalid"].append({"index": i, "why": why, "content": (msg["content"] or "")[:300],
                                   "tool_calls": (msg.get("tool_calls") or [])[:3]})
    out = []
    for row in rows.values():
        tokens, calls = row.pop("tokens"), row.pop("calls")
        row.update(valid_fraction=row["valid"] / row["requests"],
                   mean_tokens=statistics.fmean(tokens),
                   mean_calls=statistics.fmean(calls) if calls else None)
        out.append(row)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'rows':<30} {'requests':>8} {'valid JSON':>10} {'length':>7} "
             f"{'mean tokens':>11} {'mean calls':>10} {'ws runs':>7}"]
    for r in rows:
        calls = "" if r["mean_calls"] is None else f"{r['mean_calls']:.2f}"
        lines.append(f"{r['kind'] + ': ' + r['mode']:<30} {r['requests']:>8} "
                     f"{100 * r['valid_fraction']:>9.1f}% {r['length']:>7} "
                     f"{r['mean_tokens']:>11.1f} {calls:>10} {r['whitespace_runs']:>7}")
    return "\n".join(lines)


def _modes(choices: tuple[str, ...]):  # noqa: ANN202 - an argparse type
    def parse(text: str) -> list[str]:
        out = [x.strip() for x in text.split(",") if x.strip()]
        if set(out) - set(choices):
            raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated subset of "
                                             f"{', '.join(choices)}")
        return out
    return parse


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    ap.add_argument("--model", default=None, help="a model path (default: the bundled one)")
    ap.add_argument("--num-requests", type=int, default=100,
                    help="schema requests per whitespace mode (over the 5 schemas)")
    ap.add_argument("--num-tool-requests", type=int, default=30,
                    help="forced tool-call requests per tool mode")
    ap.add_argument("--whitespace", type=_modes(tuple(WHITESPACE)),
                    default=[m for m in WHITESPACE if m != "dumps"],
                    help="before,flexible,default,compact,dumps (a subset; '' none; "
                         "default: all but dumps)")
    ap.add_argument("--tool-modes", type=_modes(tuple(TOOL_MODES)), default=list(TOOL_MODES),
                    help="parallel_before,parallel,parallel_false,parallel_false_strict "
                         "(a subset; '' none)")
    ap.add_argument("--bound-schemas", action="store_true",
                    help=f"add maxLength {MAX_LENGTH} to strings and maxItems {MAX_ITEMS} to "
                         "arrays that have none (the replies are judged against that)")
    ap.add_argument("--max-tokens", type=int, default=512, help="per request (the issue's)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=3600.0, help="per request, seconds")
    ap.add_argument("--server-timeout", type=float, default=900.0,
                    help="seconds for the server to load and compile")
    ap.add_argument("--json", default=None, help="write every figure here")
    args = ap.parse_args(argv)
    flags = ["--max-num-seqs", str(args.concurrency), "--max-model-len", "2048"]
    ports = Ports(free_port(), free_port(), free_port())
    t0 = time.perf_counter()
    with serve(args.model, ports, flags, args.server_timeout):
        rows = asyncio.run(measure(args, ports))
    print(table(rows))
    if args.json:
        path = pathlib.Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"argv": sys.argv[1:], "server_flags": flags,
                                    "bound_schemas": args.bound_schemas,
                                    "wall_s": time.perf_counter() - t0, "rows": rows,
                                    "schemas": SCHEMAS, "tools": TOOLS}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
