"""Chat templates: a checkpoint's jinja template + OpenAI-style messages -> one prompt string.

Data flow: template source (from GGUF metadata `tokenizer.chat_template` or tokenizer_config.json)
-> `ChatTemplate` compiles it once in jinja2's `ImmutableSandboxedEnvironment`, configured the way
HF transformers renders templates (trim_blocks, lstrip_blocks, loopcontrols, its `tojson`,
`raise_exception`, `strftime_now`), so a prompt renders byte-identically to
`tokenizer.apply_chat_template(..., tokenize=False)` -> `render(messages, ...)` validates the
messages and copies them (and every extra variable) into plain JSON-like python values, so the
template can reach no caller object's methods -> the prompt string, which the tokenizer then
encodes.
`template_variables(source)` lists the variables a template reads (jinja's static analysis,
nothing runs): whether it renders `tools`, for instance.

The template is untrusted text from the checkpoint: it runs only inside the sandbox, which denies
underscore attributes and mutation of the values it gets; nothing else from the checkpoint runs.
A template from a request (`ChatTemplate(source, max_chars=...)`) is also bounded in what it
builds (`template_limits`: every filter, call and operator, the namespace's values and the
streamed output, against `max_chars`), and one that jinja cannot parse or compile (nested
thousands deep: a RecursionError in jinja's recursive parser) is a ChatTemplateError.
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.utils
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .template_limits import BoundedSandbox, TemplateTooLarge, chars, render_bounded


class ChatTemplateError(ValueError):
    """The template failed to compile or render, or it called `raise_exception`."""


class ChatTemplateSecurityError(ChatTemplateError, SecurityError):
    """The template tried something the sandbox forbids (e.g. `''.__class__.__mro__`)."""


def _raise_exception(message: object) -> None:
    # Templates call this to reject conversations they cannot format (e.g. roles out of order).
    raise ChatTemplateError(f"chat template raised an exception: {message}")


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF's override: jinja's own tojson HTML-escapes `<>&'` and takes only `indent`; templates are
    # written against HF's version (unescaped, non-ASCII kept, json.dumps options exposed).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _DictFactory:
    """`dict(...)` / `dict.fromkeys(...)` for templates, without exposing the `dict` type itself."""

    def __call__(self, *args: object, **kwargs: object) -> dict:
        return dict(*args, **kwargs)  # type: ignore[arg-type]

    def fromkeys(self, keys: Sequence[object], value: object = None) -> dict:
        return dict.fromkeys(keys, value)  # type: ignore[arg-type]


class _Namespace(jinja2.utils.Namespace):
    """jinja's `namespace()`, refusing underscore names so a template cannot shadow internals,
    and values over `max_chars` characters where a subclass sets it (`_Namespace.bounded`: a
    loop's one way to carry a growing value to its next iteration)."""

    max_chars: int | None = None

    @classmethod
    def bounded(cls, max_chars: int) -> type["_Namespace"]:
        return type("namespace", (cls,), {"max_chars": max_chars})

    def __init__(*args: object, **kwargs: object) -> None:  # noqa: N805 -- jinja's own signature
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)  # type: ignore[call-overload]
        for name, value in attrs.items():
            type(self)._check(self, name, value)
        jinja2.utils.Namespace.__init__(self, attrs)  # type: ignore[arg-type]

    def __setitem__(self, name: str, value: object) -> None:
        type(self)._check(self, name, value)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    def _check(self, name: object, value: object) -> None:
        # Called through the class: jinja's Namespace resolves instance attributes from the
        # template's values only.
        _Namespace._check_name(name)
        limit = type(self).max_chars
        if limit is not None and chars(value, limit) > limit:
            raise TemplateTooLarge(f"namespace attribute {name!r} would hold over {limit} "
                                   "characters, the render bound")

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise ChatTemplateSecurityError(
                f"chat template may not set namespace attribute {name!r}")


def _plain(value: object, where: str) -> object:
    """A copy of `value` made only of str/int/float/bool/None/list/dict: the sandbox then only ever
    sees builtin types whose safe methods it knows; anything else is refused with its location."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)  # a str subclass (enum, ...) could carry extra methods
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where} has a non-string key {k!r}")
            out[str.__str__(k)] = _plain(v, f"{where}.{k}")
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ValueError(f"{where} has unsupported type {type(value).__name__}; "
                     "use JSON values (str, number, bool, null, list, object)")


def validate_messages(messages: object) -> list[dict[str, object]]:
    """Check chat messages and return plain copies; errors name the message index and field.

    Each message is a dict with string `role` and `content`; other keys (`name`, `tool_calls`,
    ...) pass through as JSON values. Keys whose value is None are dropped, as HF does, because
    templates test for a key's presence rather than for None.
    """
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of {{role, content}} dicts, "
                         f"got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: a chat needs at least one message")
    out: list[dict[str, object]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', "
                             f"got {type(msg).__name__}")
        for field in ("role", "content"):
            if field not in msg or msg[field] is None:
                raise ValueError(f"messages[{i}] is missing the field {field!r}")
            if not isinstance(msg[field], str):
                raise ValueError(f"messages[{i}].{field} must be a string, "
                                 f"got {type(msg[field]).__name__}")
        if not msg["role"]:
            raise ValueError(f"messages[{i}].role must not be empty")
        plain = _plain({k: v for k, v in msg.items() if v is not None}, f"messages[{i}]")
        out.append(plain)  # type: ignore[arg-type]
    return out


class ChatTemplate:
    """A compiled chat template; compile once per tokenizer, render per request.

    `max_chars`: bound everything the template builds, and the prompt, to that many
    characters (`template_limits`); for a template from a request. None: unbounded (the
    checkpoint's own template, which the operator chose)."""

    def __init__(self, source: str, max_chars: int | None = None) -> None:
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError("chat template is empty")
        self.source = source
        self.max_chars = max_chars
        options = dict(trim_blocks=True, lstrip_blocks=True,
                       extensions=[jinja2.ext.loopcontrols])
        env = (ImmutableSandboxedEnvironment(**options) if max_chars is None
               else BoundedSandbox(max_chars, **options))
        if isinstance(env, BoundedSandbox):
            env.add_filter("tojson", _tojson)
        else:
            env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                           dict=_DictFactory(), namespace=_Namespace if max_chars is None
                           else _Namespace.bounded(max_chars))
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not compile: line {e.lineno}: {e.message}"
                                    ) from None
        except RecursionError:  # jinja parses and compiles recursively
            raise ChatTemplateError("chat template does not compile: it nests too deep "
                                    "(Python's recursion limit)") from None

    def render(self, messages: object, add_generation_prompt: bool = True,
               bos_token: str | None = None, eos_token: str | None = None,
               **extra: object) -> str:
        """Render `messages`; `extra` are further template variables (tools, unk_token, ...)."""
        context: dict[str, object] = {"tools": None, "documents": None}
        for key, value in extra.items():
            context[key] = _plain(value, key)
        context.update(messages=validate_messages(messages),
                       add_generation_prompt=bool(add_generation_prompt))
        # An unset token stays undefined (renders ""), as in HF; None would render "None".
        for key, token in (("bos_token", bos_token), ("eos_token", eos_token)):
            if token is not None:
                context[key] = str(token)
        try:
            if self.max_chars is None:
                return self._template.render(**context)
            return render_bounded(self._template.generate(**context), self.max_chars)
        except ChatTemplateError:
            raise
        except TemplateTooLarge as e:
            raise ChatTemplateError(f"chat template made too large a prompt: {e}") from None
        except RecursionError:  # a macro calling itself, a value nested past the limit
            raise ChatTemplateError("chat template failed to render: it recursed past "
                                    "Python's recursion limit") from None
        except SecurityError as e:
            raise ChatTemplateSecurityError(f"chat template blocked by the sandbox: {e}") from None
        except Exception as e:  # template bugs surface as TypeError, UndefinedError, ...
            raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}"
                                    ) from None


def render_chat_template(template: str, messages: object, add_generation_prompt: bool = True,
                         bos_token: str | None = None, eos_token: str | None = None,
                         **extra: object) -> str:
    """Compile `template` and render `messages` once (use `ChatTemplate` to reuse the compile)."""
    return ChatTemplate(template).render(messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos_token, eos_token=eos_token, **extra)


@functools.lru_cache(maxsize=32)
def template_variables(source: str) -> frozenset[str]:
    """The variables `source` reads from its context (jinja's static analysis: nothing runs),
    e.g. whether a template renders `tools`; empty when it does not compile."""
    env = ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols])
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
    except (jinja2.TemplateSyntaxError, RecursionError):  # RecursionError: nested too deep
        return frozenset()
