"""The configuration page's tables, generated from the code (docs/hooks.py puts them into
configuration.md on every `mkdocs build`, so the page cannot go stale): every EngineConfig
field with its flag, type, default and help (flags from `jaxserve.cli.flags.add_engine_flags`,
per-command defaults from `jaxserve.cli.main.build_parser`); serve's server flags and the
ServerConfig fields they fill; the multi-host flags; the sampling registry (type, default,
allowed values in the rules' own words, wire names on gRPC (read from the proto) / HTTP / CLI,
device column); the environment variables the sources read; each subcommand's own flags.

A mismatch between the code and what this module knows by name (a serve flag that fills no
known ServerConfig field, a sampling field missing from the proto, an undescribed
environment variable) is logged as a warning, which `mkdocs build --strict` turns into a
failure. Nothing here imports jax (jaxserve.config, jaxserve.cli, jaxserve.engine and
jaxserve.server.config import without it). `python docs/gen_config.py` prints the tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import html
import logging
import pathlib
import re
import sys
from typing import Any, Iterable

ROOT = pathlib.Path(__file__).resolve().parents[1]
log = logging.getLogger("mkdocs.plugins.jaxserve_docs")

# What each environment variable the code reads means (found by scanning the sources for
# JAXSERVE_*; one that is read but not described here is a build warning).
ENV_VARS = {
    "JAXSERVE_COMPILATION_CACHE_DIR": "JAX's persistent compilation cache directory of the "
        "`jaxserve` command (default `~/.cache/jaxserve/xla`; empty: leave JAX's own setting, "
        "i.e. no cache unless JAX is told otherwise). A second start then skips XLA compiles.",
    "JAXSERVE_KERNEL_CACHE_DIR": "where the C++ CPU kernels are compiled to on first use "
        "(default `~/.cache/jaxserve/kernels`).",
    "JAXSERVE_API_KEY": "an API key `jaxserve serve` accepts (besides `--api-key` / "
        "`--api-key-file`); `jaxserve client` sends it when `--api-key` is not given.",
    "JAXSERVE_RUN_SLOW": "`1`: run the tests marked `slow` (the slow tier).",
    "JAXSERVE_FUZZ_EXAMPLES": "examples per property of the fuzz tests (loaders, fronts); "
        "more for a longer run.",
    "JAXSERVE_TEST_XLA_CACHE": "the test session's XLA compilation cache directory (default: "
        "a fresh temporary one; a lasting directory reuses compiles across runs; empty: "
        "none).",
    "JAXSERVE_TEST_XLA_FLAGS": "XLA flags the test session adds to `XLA_FLAGS` (default on a "
        "host without a GPU / TPU: `--xla_backend_optimization_level=0`, faster compiles of "
        "the tiny test models; empty: XLA's defaults).",
    "JAXSERVE_ARGS": "`scripts/peer/side_by_side.sh`: extra `jaxserve serve` flags.",
    "JAXSERVE_TEST_WORKERS": "`scripts/test.sh`: pytest-xdist worker processes (default 2; "
        "`0` runs the tests in the pytest process itself).",
    "JAXSERVE_TEST_SESSION_DIR": "set by the test session's controller, not by a user: the "
        "directory its xdist workers share (the bundled model's transformers conversion, "
        "made once per session).",
}
ENV_SCAN = ("jaxserve", "models", "server", "kernels_pallas", "scripts", "tests")

# Chat's names of registry fields that /v1/chat/completions takes under another name (the
# other fields keep theirs). Each is checked against the chat front's source below.
CHAT_NAMES = {
    "max_tokens": ("`max_completion_tokens` (or `max_tokens`); unset: up to max_model_len",
                   "max_completion_tokens"),
    "logprobs": ("`logprobs: true` + `top_logprobs: N`", "top_logprobs"),
    "structured_outputs": ("`structured_outputs`, `response_format`, `guided_*`; a forced "
                           "tool call", "response_format"),
}
COMPLETION_NAMES = {
    "max_tokens": "`max_tokens` (default 16, OpenAI's; null: up to max_model_len)",
    "structured_outputs": "`structured_outputs`, `response_format`, `guided_*`",
}
# serve's flags that fill a ServerConfig field of another name.
SERVER_FLAG_FIELDS = {
    "served_model_names": ("--served-model-name",),
    "api_keys": ("--api-key", "--api-key-file"),
    "client_priority_range": ("--client-priority-min", "--client-priority-max"),
    "port": ("--port", "--no-grpc"),
    "http_port": ("--http-port", "--no-http"),
}


# ----------------------------------------------------------------------------- helpers
def _esc(text: Any) -> str:
    """`text` as a markdown table cell: no raw HTML, no column breaks, no emphasis."""
    out = html.escape(str(text), quote=False).replace("|", r"\|").replace("*", r"\*")
    return " ".join(out.split())


def _code(text: Any) -> str:
    return f"`{text}`" if str(text) else ""  # a pipe inside a code span needs no escape


def _table(head: Iterable[str], rows: Iterable[Iterable[str]]) -> str:
    head = list(head)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _default(value: Any) -> str:
    if value is None:
        return "None"
    if value == () or value == []:
        return "()"
    return repr(value)


def _shown(default: Any) -> bool:
    """Whether a flag's default goes in the default column: a plain value, not "off" (None,
    False, an empty list) nor an object whose help text states it (e.g. a length spec)."""
    if default is None or default is False or default == []:
        return False
    return isinstance(default, (int, float, str, tuple))


def _strip_default(action: argparse.Action) -> str:
    """A flag's help without the ` (default: X)` that add_engine_flags / add_sampling_flags
    append (the table shows the default); any other mention of a default stays."""
    text = action.help or ""
    suffix = f" (default: {action.default})"
    return text[:-len(suffix)] if text.endswith(suffix) else text


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    from jaxserve.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _flags(action: argparse.Action) -> str:
    return " / ".join(_code(s) for s in action.option_strings) or _code(action.dest)


def _group(parser: argparse.ArgumentParser, title_start: str) -> list[argparse.Action]:
    for g in parser._action_groups:
        if (g.title or "").startswith(title_start):
            return list(g._group_actions)
    return []


# ----------------------------------------------------------------------------- engine
def engine_section() -> str:
    from jaxserve.cli.flags import add_engine_flags
    from jaxserve.config import EngineConfig

    p = argparse.ArgumentParser(add_help=False)
    add_engine_flags(p)
    actions = {a.dest[len("engine_"):]: a for a in p._actions if a.dest.startswith("engine_")}
    rows = []
    lora_flags = [a for a in p._actions if a.dest.startswith("lora_")]
    for f in dataclasses.fields(EngineConfig):
        if f.name == "lora_config":  # vLLM's flags, one row each (`flags.add_lora_flags`)
            rows += [[_code(f"lora_config.{a.dest[len('lora_'):]}"), _flags(a),
                      _code("LoRAConfig"), _code(_default(a.default)), _esc(_strip_default(a))]
                     for a in lora_flags]
            continue
        a = actions.get(f.name)
        if a is None:
            log.warning("EngineConfig.%s has no CLI flag in add_engine_flags", f.name)
            continue
        help_ = _esc(_strip_default(a))
        if a.choices:
            help_ += " (one of: " + ", ".join(_code(c) for c in a.choices) + ")"
        rows.append([_code(f.name), _flags(a), _code(f.type), _code(_default(f.default)),
                     help_])
    out = ["## Engine: `EngineConfig`", "",
           "`jaxserve.config.EngineConfig`: what `LLM(...)` takes as keyword arguments and "
           "every command that builds an engine takes as flags (one flag per field, "
           "generated from the dataclass by `jaxserve.cli.flags.add_engine_flags`). Sizes "
           "take a unit (`2GiB`, `512MiB`); `int | None` fields take `none`.", "",
           _table(["field", "CLI flag", "type", "default", "help"], rows), "",
           commands_engine_differences()]
    return "\n".join(out)


def commands_engine_differences() -> str:
    from jaxserve.config import EngineConfig

    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    rows = []
    for name, sp in _subparsers().items():
        given = {a.dest[len("engine_"):]: a for a in sp._actions if a.dest.startswith("engine_")}
        if not given:
            continue
        has_lora = any(a.dest == "lora_enable_lora" for a in sp._actions)  # add_lora_flags
        missing = [n for n in defaults
                   if n not in given and not (n == "lora_config" and has_lora)]
        changed = [f"{_code('--' + n.replace('_', '-'))} = {_code(_default(a.default))}"
                   for n, a in given.items() if a.default != defaults[n]]
        rows.append([_code(f"jaxserve {name}"), ", ".join(changed) or "-",
                     ", ".join(_code("--" + n.replace("_", "-")) for n in missing) or "-"])
    return "\n".join(["Commands that take the engine flags, and where they differ from the "
                      "table:", "", _table(["command", "other defaults", "flags it lacks"],
                                           rows)])


# ----------------------------------------------------------------------------- server
def server_section() -> str:
    from jaxserve.server.config import ServerConfig

    serve = _subparsers()["serve"]
    actions = _group(serve, "server")
    by_flag = {s: a for a in actions for s in a.option_strings}
    rows, used = [], set()
    for a in actions:
        help_ = _esc(_strip_default(a))
        default = _code(_default(a.default)) if _shown(a.default) else "-"
        rows.append([_flags(a), default, help_])
    fields = []
    for f in dataclasses.fields(ServerConfig):
        flags = SERVER_FLAG_FIELDS.get(f.name, ("--" + f.name.replace("_", "-"),))
        known = [s for s in flags if s in by_flag]
        for s in flags:
            if s not in by_flag:
                log.warning("ServerConfig.%s: serve has no flag %s (docs/gen_config.py "
                            "SERVER_FLAG_FIELDS)", f.name, s)
        used.update(known)
        fields.append([_code(f.name), _code(f.type), _code(_default(f.default)),
                       ", ".join(_code(s) for s in known) or "-"])
    for a in actions:
        if not used.intersection(a.option_strings):
            log.warning("serve flag %s fills no ServerConfig field the docs know of "
                        "(docs/gen_config.py SERVER_FLAG_FIELDS)", a.option_strings[0])
    return "\n".join([
        "## Server: `jaxserve serve` flags and `ServerConfig`", "",
        "The network-facing knobs, besides the engine flags above. What each limit and "
        "timeout does to a client past it: [Request limits and connections]"
        "(serving/limits.md).", "",
        _table(["flag", "default", "help"], rows), "",
        "Code that embeds a server (`jaxserve.server.app.GrpcServer`, "
        "`jaxserve.server.background.BackgroundServer`) passes a "
        "`jaxserve.server.config.ServerConfig`; its fields and the flags that fill them:", "",
        _table(["field", "type", "default", "serve flags"], fields)])


def distributed_section() -> str:
    from jaxserve.config import DistributedConfig

    serve = _subparsers()["serve"]
    actions = [a for a in serve._actions if a.dest in ("coordinator", "num_processes",
                                                       "process_id")]
    rows = [[_flags(a), _code(_default(a.default)), _esc(_strip_default(a))]
            for a in actions]
    names = ", ".join(_code(f.name) for f in dataclasses.fields(DistributedConfig))
    users = [n for n, sp in _subparsers().items()
             if any(a.dest == "coordinator" for a in sp._actions)]
    return "\n".join([
        "## Several hosts: `DistributedConfig`", "",
        f"`jaxserve.config.DistributedConfig` ({names}); the flags of "
        + ", ".join(_code(f"jaxserve {u}") for u in users)
        + ". How a job runs: [Scaling out](scaling.md#several-hosts).", "",
        _table(["flag", "default", "help"], rows)])


# ----------------------------------------------------------------------------- sampling
def _proto_sampling_fields() -> dict[str, str]:
    text = (ROOT / "server" / "proto" / "jaxserve.proto").read_text()
    m = re.search(r"message SamplingParams \{(.*?)\n\}", text, re.S)
    if m is None:
        log.warning("server/proto/jaxserve.proto has no message SamplingParams")
        return {}
    out = {}
    for line in m.group(1).splitlines():
        f = re.match(r"\s*((?:optional |repeated )?(?:map<[^>]+>|\w+))\s+(\w+)\s*=\s*\d+;",
                     line)
        if f:
            out[f.group(2)] = f.group(1)
    return out


def sampling_section() -> str:
    from jaxserve.engine import sampling_params as sp

    proto = _proto_sampling_fields()
    chat_src = "".join((ROOT / "server" / f).read_text()
                       for f in ("openai_chat_schema.py", "openai_structured.py"))
    for name, (_, token) in CHAT_NAMES.items():
        if name not in sp.BY_NAME or token not in chat_src:
            log.warning("docs/gen_config.py CHAT_NAMES[%r]: %r is not in the chat front's source",
                        name, token)
    commands = _subparsers()
    with_flags = {n: {a.dest for a in p._actions} for n, p in commands.items()
                  if _group(p, "sampling")}
    rows, wire = [], []
    for f in sp.FIELDS:
        kind = f.type.__name__
        if f.type is tuple:
            kind = f"list of {f.item.__name__}"
        elif f.type is dict:
            kind = f"mapping token id -> {f.item.__name__}"
        if f.optional:
            kind += " or None"
        allowed = _esc(f.rule.text) if f.rule is not None else "true / false"
        rows.append([_code(f.name), _esc(kind), _code(_default(f.default)), allowed,
                     _esc(f.help)])
        if f.name not in proto:
            log.warning("sampling field %s is not in the proto's SamplingParams", f.name)
        grpc = f"{_code('sampling.' + f.name)} ({_esc(proto.get(f.name, 'missing'))})"
        completions = COMPLETION_NAMES.get(f.name, _code(f.name))
        chat = CHAT_NAMES[f.name][0] if f.name in CHAT_NAMES else _code(f.name)
        flag = "--" + f.name.replace("_", "-")
        lacking = sorted(n for n, dests in with_flags.items() if f.name not in dests)
        cli = _code(flag) + (f" (not on {', '.join(lacking)})" if lacking else "")
        column = (f"column (pad {f.device.pad:g}{', penalty' if f.device.penalty else ''})"
                  if f.device is not None else "-")
        wire.append([_code(f.name), grpc, completions, chat, cli, column])
    return "\n".join([
        "## Sampling: `SamplingParams`", "",
        "`jaxserve.SamplingParams` is the one registry of per-request sampling fields "
        "(`jaxserve/engine/sampling_params.py`): each field is declared once, with its rule, "
        "help and device column, and the gRPC mapping, the HTTP body parsing, the CLI flags, "
        "the batch job's line keys and the step's sampling matrix follow from that "
        "declaration. The allowed values below are the rules' own texts (what an error "
        "message states). Checks against the model come on top, at admission: `top_k`, "
        "`stop_token_ids` and `logit_bias` ids within the vocabulary, prompt + `max_tokens` "
        "within max_model_len and the KV cache, `min_tokens` <= `max_tokens`, a "
        "`structured_outputs` spec the grammar library accepts (see "
        "[Request limits](serving/limits.md)).", "",
        _table(["field", "type", "default", "allowed values", "help"], rows), "",
        "Where each field travels: the gRPC `SamplingParams` message (proto type), the "
        "OpenAI HTTP bodies, the CLI flags (`generate`, `client`, `batch`; in `batch` a flag "
        "applies to lines that give no value, and a line's keys are the field names) and, "
        "for fields the sampler reads, a column of the step's `f32[S, K]` sampling matrix "
        "(its padding value; *penalty*: a non-padding value needs the token history).", "",
        _table(["field", "gRPC", "/v1/completions", "/v1/chat/completions", "CLI flag",
                "device"], wire), "",
        "Per-command sampling defaults (where a command's flag default differs from "
        "`SamplingParams`'):", "", sampling_defaults(commands)])


def sampling_defaults(commands: dict[str, argparse.ArgumentParser]) -> str:
    from jaxserve.engine import sampling_params as sp

    rows = []
    for name, p in commands.items():
        acts = {a.dest: a for a in _group(p, "sampling")}
        if not acts:
            continue
        changed = [f"{_code('--' + f.name.replace('_', '-'))} = {_code(_default(a.default))}"
                   for f in sp.FIELDS if (a := acts.get(f.name)) is not None
                   and a.default not in (f.default, None, [], ())]
        rows.append([_code(f"jaxserve {name}"), ", ".join(changed) or "-"])
    return _table(["command", "defaults"], rows)


# ----------------------------------------------------------------------------- env, commands
def env_section() -> str:
    found: dict[str, set[str]] = {}
    for part in ENV_SCAN:
        base = ROOT / part
        files = [base] if base.is_file() else sorted(base.rglob("*"))
        for p in files:
            if p.suffix not in (".py", ".sh") or "__pycache__" in p.parts:
                continue
            for name in re.findall(r"\bJAXSERVE_[A-Z_]+\b", p.read_text(errors="replace")):
                found.setdefault(name, set()).add(str(p.relative_to(ROOT)))
    rows = []
    for name in sorted(found):
        if any(w.startswith("jaxserve/engine/") for w in found[name]):
            log.warning("%s is read in jaxserve/engine, which the page says reads none", name)
        if name not in ENV_VARS:
            log.warning("environment variable %s (read in %s) is not described in "
                        "docs/gen_config.py ENV_VARS", name, ", ".join(sorted(found[name])))
        where = sorted(found[name])
        shown = ", ".join(_code(w) for w in where[:3]) + (" ..." if len(where) > 3 else "")
        rows.append([_code(name), _esc(ENV_VARS.get(name, "")), shown])
    for name in ENV_VARS:
        if name not in found:
            log.warning("docs/gen_config.py ENV_VARS describes %s, which no source reads", name)
    return "\n".join(["## Environment variables", "",
                      "Read at the edge only (the command line, `RuntimeConfig.from_env`, the "
                      "kernel build, the tests); the engine itself reads none.", "",
                      _table(["variable", "meaning", "read in"], rows)])


def commands_section() -> str:
    out = ["## Command-line reference", "",
           "Each subcommand's own flags (`jaxserve COMMAND --help` prints the same). The "
           "engine, server, several-hosts and sampling flags are in the tables above."]
    skip = ("engine", "sampling", "server", "several hosts")
    for name, p in _subparsers().items():
        rows = []
        for g in p._action_groups:
            if (g.title or "").startswith(skip):
                continue
            for a in g._group_actions:
                if isinstance(a, argparse._HelpAction):
                    continue
                default = _code(_default(a.default)) \
                    if a.option_strings and _shown(a.default) else "-"
                help_ = _esc(_strip_default(a))
                if a.choices and not isinstance(a.choices, dict):
                    help_ += " (one of: " + ", ".join(_code(c) for c in a.choices) + ")"
                rows.append([_flags(a) if a.option_strings else _code(a.metavar or a.dest),
                             default, help_])
        takes = [t for t in skip if _group(p, t)]
        out += ["", f"### `jaxserve {name}`", "", _esc(p.description or ""), ""]
        if takes:
            out += ["Also takes the " + ", ".join(takes) + " flags.", ""]
        if rows:
            out.append(_table(["argument", "default", "help"], rows))
    return "\n".join(out)


def configuration_markdown() -> str:
    """The page's generated part (needs jaxserve installed, as the docs build's venv has it)."""
    sections = [engine_section(), server_section(), distributed_section(),
                sampling_section(), env_section(), commands_section()]
    return "\n\n".join(sections) + "\n"


if __name__ == "__main__":
    logging.basicConfig(format="%(levelname)s %(message)s")
    sys.stdout.write(configuration_markdown())
