"""Bounds on what an untrusted chat template may build while it renders.

A request's own template (`--trust-request-chat-template`) is code from the caller: inside
jinja's sandbox it cannot reach Python objects, but it can still ask for a string of any size
in one expression (`messages|tojson(indent=10**8)`, `'x'|center(10**9)`, `'%999999999s' % x`,
`s|replace('a', s)` chained), and the render runs before anything else looks at the prompt.
`BoundedSandbox(max_chars)` is jinja's ImmutableSandboxedEnvironment where nothing the
template computes may exceed `max_chars` characters, checked *before* the value is built
wherever the size follows from the arguments, and after it everywhere else:
  - every filter (wrapped at construction; `map('center', ...)` reaches the wrapped ones) and
    every call (`environment.call`: string methods, globals, macros) goes through
    `check_call`: integer arguments over the bound (a width, a count, a length), format specs
    with such a width (`'{:999999999}'.format`, the `format` filter), and the known
    amplifiers (`replace`, `join`, `indent`, `tojson`'s indent and separators, `center`,
    `ljust`...) estimated from their arguments; then the result's size;
  - the binary operators `*`, `%`, `**` and `+` (jinja's intercepted_binops): a repeat count
    times the operand's length, `%` format widths, exponents, then the result's size;
  - the namespace's attributes (the one place a loop can carry a value to the next
    iteration, so the one place a doubling can compound) are checked when set
    (`chat_template._Namespace`, with `chars`);
  - `render_bounded` streams the output (`Template.generate`) and stops once it passes the
    bound, so a loop that prints bounded pieces cannot run past it either.
`max_chars` is the request's prompt bound (`EngineLimits.max_prompt_bytes`: a longer text
cannot fit in max_model_len tokens, and a character is at least a byte), so nothing a valid
prompt needs is refused. What this does not bound is time: a template that loops without
building anything (nested `range(100000)` loops) holds its thread until it ends.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Callable, Iterable

from jinja2.environment import Environment
from jinja2.nodes import EvalContext
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_JSON_INDENT = 16  # HF templates use tojson(indent=2 | 4); more only serves to blow up
_DIGITS = re.compile(r"\d+")
# Calls whose integer arguments are not sizes: range is capped by the sandbox (MAX_RANGE).
_NOT_SIZES = frozenset({"range", "safe_range"})


class TemplateTooLarge(ValueError):
    """A value the template asked for would pass the render bound."""


def chars(value: object, limit: int) -> int:
    """The characters `value` holds (strings, and containers' items and keys, counted once
    per reference), counted up to `limit` + 1 and no further (a list of the same long string
    a million times stops early). Other values count 1; without recursion."""
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            total += len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += len(v)
            stack.extend(v)
        else:
            total += 1
    return total


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment whose filters, calls and operators refuse values over
    `max_chars` characters (module docstring). Filters added after construction are not
    wrapped: add them through `add_filter`."""

    intercepted_binops = frozenset({"*", "%", "**", "+"})

    def __init__(self, max_chars: int, **options: Any) -> None:
        super().__init__(**options)
        self.max_chars = max_chars
        for name, fn in list(self.filters.items()):
            self.filters[name] = self._bounded_filter(name, fn)

    def add_filter(self, name: str, fn: Callable[..., Any]) -> None:
        self.filters[name] = self._bounded_filter(name, fn)

    def _bounded_filter(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)  # keeps jinja_pass_arg: jinja passes the context as before
        def bounded(*args: Any, **kwargs: Any) -> Any:
            # A leading environment / eval context / context is jinja's, not the template's.
            lead = 1 if args and _is_jinja_arg(args[0]) else 0
            values = list(args[lead:])
            if name == "join" and values and not isinstance(values[0], (str, list, tuple)):
                values[0] = list(values[0])  # a generator (map, select...): sized first
                args = (*args[:lead], *values)
            self.check_call(f"the {name} filter", name, values, kwargs)
            return self.check_result(f"the {name} filter", fn(*args, **kwargs))

        return bounded

    # ------------------------------------------------------------------ checks
    def check_result(self, what: str, value: Any) -> Any:
        n = chars(value, self.max_chars)
        if n > self.max_chars:
            raise TemplateTooLarge(f"{what} made a value of over {self.max_chars} characters, "
                                   "the render bound")
        return value

    def _refuse(self, what: str, why: str) -> TemplateTooLarge:
        return TemplateTooLarge(f"{what}: {why}; the render bound is {self.max_chars} "
                                "characters")

    def check_call(self, what: str, name: str, args: list[Any], kwargs: dict[str, Any]) -> None:
        """Before a filter or a method runs: its integer arguments, format widths and the
        size its output would reach, each against the bound."""
        limit = self.max_chars
        for a in (*args, *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > limit and \
                    name not in _NOT_SIZES:
                raise self._refuse(what, f"an argument of {a}")
        if name == "tojson":
            self._check_tojson(what, args, kwargs)
        if name in ("format", "str.format", "str.format_map") and args and \
                isinstance(args[0], str):
            self._check_widths(what, args[0])
        estimate = _estimate(name, args, kwargs, limit)
        if estimate > limit:
            raise self._refuse(what, f"its result would be about {estimate} characters long")

    def _check_tojson(self, what: str, args: list[Any], kwargs: dict[str, Any]) -> None:
        indent = kwargs.get("indent", args[2] if len(args) > 2 else None)
        if isinstance(indent, str):
            indent = len(indent)
        if isinstance(indent, int) and indent > MAX_JSON_INDENT:
            raise TemplateTooLarge(f"{what}: indent={indent} is over {MAX_JSON_INDENT}")

    def _check_widths(self, what: str, spec: str) -> None:
        for digits in _DIGITS.findall(spec):
            if len(digits) > len(str(self.max_chars)) or int(digits) > self.max_chars:
                raise self._refuse(what, f"a format width of {digits[:20]}")

    # ------------------------------------------------------------------ jinja's hooks
    def call(__self, __context: Context, __obj: Any, *args: Any,  # noqa: N805
             **kwargs: Any) -> Any:
        name = getattr(__obj, "__name__", "")
        # The sandbox hands out str.format / format_map wrapped (its safe formatter), the
        # bound method under __wrapped__.
        owner = getattr(__obj, "__self__", None)
        if owner is None:
            owner = getattr(getattr(__obj, "__wrapped__", None), "__self__", None)
        values = list(args)
        if isinstance(owner, (str, list, dict, tuple)):
            # A bound method: its object is the first value (`s.replace(a, b)` is checked as
            # str.replace(s, a, b)).
            name = f"{type(owner).__name__}.{name}"
            if name == "str.join" and args and not isinstance(args[0], (str, list, tuple)):
                args = (list(args[0]), *args[1:])  # a generator: sized first
            values = [owner, *args]
        what = f"{name or 'a call'}()"
        __self.check_call(what, name, values, kwargs)
        return __self.check_result(what, super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        what = f"the {operator} operator"
        limit = self.max_chars
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and \
                        len(seq) * n > limit:
                    raise self._refuse(what, f"{len(seq)} items x {n}")
        elif operator == "%" and isinstance(left, str):
            self._check_widths(what, left)
            for a in right if isinstance(right, tuple) else (right,):
                if isinstance(a, int) and not isinstance(a, bool) and abs(a) > limit:
                    raise self._refuse(what, f"an argument of {a}")  # '%*d' % (width, x)
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and \
                abs(left) > 1 and right * max(abs(left).bit_length(), 1) > 64 * limit:
            raise self._refuse(what, f"{left} ** {right}")
        return self.check_result(what, super().call_binop(context, operator, left, right))


def render_bounded(chunks: Iterable[str], max_chars: int) -> str:
    """The rendered text from a template's generator, stopping once it passes `max_chars`."""
    out, total = [], 0
    for chunk in chunks:
        total += len(chunk)
        if total > max_chars:
            raise TemplateTooLarge(f"the rendered prompt is over {max_chars} characters, the "
                                   "render bound (the longest text max_model_len tokens hold)")
        out.append(chunk)
    return "".join(out)


def _is_jinja_arg(a: object) -> bool:
    return isinstance(a, (Environment, EvalContext, Context))


def _estimate(name: str, args: list[Any], kwargs: dict[str, Any], limit: int) -> int:
    """An upper estimate of the characters a filter or method named `name` returns for these
    arguments (`args[0]`: the filtered value, or the method's object), where it may return
    more than its arguments hold (0 elsewhere: padding to a width is bounded by the width,
    which `check_call` bounds)."""
    def arg(i: int, key: str, default: Any = None) -> Any:
        return kwargs.get(key, args[i] if len(args) > i else default)

    value = arg(0, "s")
    if name in ("replace", "str.replace") and isinstance(value, str):
        old, new = arg(1, "old", ""), arg(2, "new", "")
        if isinstance(old, str) and isinstance(new, str):
            hits = len(value) + 1 if not old else value.count(old)
            return len(value) + hits * max(0, len(new) - len(old))
    if name in ("join", "str.join"):
        items, sep = (value, arg(1, "d", "")) if name == "join" else (arg(1, "iterable"), value)
        items = items if isinstance(items, (list, tuple, str)) else ()
        return chars(items, limit) + len(items) * (len(sep) if isinstance(sep, str) else 0)
    if name == "indent" and isinstance(value, str):
        width = arg(1, "width", 4)
        pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        return len(value) + (value.count("\n") + 1) * pad
    if name == "str.expandtabs" and isinstance(value, str):
        size = arg(1, "tabsize", 8)
        return len(value) + value.count("\t") * (size if isinstance(size, int) else 8)
    if name == "tojson":
        indent = arg(2, "indent", None)
        pad = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
        seps = arg(3, "separators", None) or ()
        sep = sum(len(x) for x in seps if isinstance(x, str)) if seps else 3
        return _json_size(value, min(max(pad, 0), MAX_JSON_INDENT), sep, limit)
    return 0


def _json_size(value: Any, pad: int, sep: int, limit: int) -> int:
    """An upper estimate of json.dumps(value, indent=pad) with separators of `sep` characters
    in all: each string as JSON (escaped as with ensure_ascii, the longer form), each item
    or key a separator and, indented, a line of `pad` per nesting level; counted up to
    `limit` + 1 and no further, without recursion."""
    total, stack = 0, [(value, 1)]
    while stack and total <= limit:
        v, depth = stack.pop()
        line = sep + (1 + pad * depth if pad else 0)
        if isinstance(v, str):
            total += len(json.dumps(v)) + line
        elif isinstance(v, dict):
            total += 2 + line
            stack.extend((k, depth + 1) for k in v)
            stack.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, (list, tuple)):
            total += 2 + line
            stack.extend((x, depth + 1) for x in v)
        else:
            total += 24 + line  # a number, a bool, null
    return total
