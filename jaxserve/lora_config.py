"""Multi-LoRA settings: the frozen `LoRAConfig` and the `--lora-modules` parser.

A user writes vLLM's flags (`jaxserve serve --enable-lora --lora-modules a=/p/a b=/p/b
--max-loras 4 --max-lora-rank 16 --max-cpu-loras 8`) or its offline keywords
(`LLM(enable_lora=True, max_loras=4, max_lora_rank=16)`); `LoRAConfig.from_options` turns
them into this frozen section (None when LoRA is off), refusing a LoRA option given without
`enable_lora` by its name. It sits in the config layer beside `jaxserve.config` (which holds it
as `EngineConfig.lora_config`) and imports nothing else of jaxserve.

What each field sizes (docs/serving/lora.md):
- `max_loras`: adapter slots on the device. The step's LoRA stacks hold max_loras + 1 slots
  (slot 0 is "no adapter", all zeros); a row's slot is data, so switching, adding or mixing
  adapters never recompiles. A request whose adapter has no slot waits until one frees.
- `max_lora_rank`: every slot is padded to this rank; an adapter of a larger rank is refused
  when loaded.
- `max_cpu_loras`: adapters kept loaded in host memory (least recently used dropped first);
  None: as many as `max_loras`. Registered adapters beyond it are read from disk again when
  next needed.
- `lora_modules`: adapters registered at start-up, `(name, path)` pairs.
- `lora_dtype`: the stacks' dtype (`LORA_DTYPES`; auto: the model's, bfloat16 for a float32
  model with quantized weights: `serving.lora_build.stacks_dtype`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

# vLLM's largest supported rank; past it a "low-rank" adapter stops being small beside the
# base weights (the stacks are max_loras x L x (in + out) x rank per target module).
MAX_LORA_RANK_LIMIT = 512
MAX_LORA_NAME_CHARS = 128  # an adapter name is a model id on the wire: kept short
# The offline / CLI option names `from_options` reads (vLLM's).
OPTION_NAMES = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "lora_modules",
                "lora_dtype")
# vLLM's --lora-dtype: the adapter stacks' dtype; auto: the model's. On CPU, bfloat16 halves
# the bytes a decode step reads for the adapters (the kernel accumulates in float32).
LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")


def check_lora_name(name: object, what: str = "lora_name") -> str:
    """The adapter name, or ValueError naming `what`: a non-empty string of printable
    characters without spaces or '=' (a model id on the wire and a NAME=PATH on the CLI)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what} must be a non-empty string, got {name!r:.60}")
    if len(name) > MAX_LORA_NAME_CHARS or not name.isprintable() or any(
            c.isspace() or c == "=" for c in name):
        raise ValueError(f"{what}={name!r:.60} must be at most {MAX_LORA_NAME_CHARS} printable "
                         "characters without spaces or '='")
    return name


def _positive(name: str, value: object, upper: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1 or (
            upper is not None and value > upper):
        bound = f" in [1, {upper}]" if upper is not None else ""
        raise ValueError(f"{name}={value!r:.60} must be a positive integer{bound}")
    return value


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: tuple[tuple[str, str], ...] = ()
    lora_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype={self.lora_dtype!r:.40} must be one of {LORA_DTYPES}")
        _positive("max_loras", self.max_loras)
        _positive("max_lora_rank", self.max_lora_rank, MAX_LORA_RANK_LIMIT)
        if self.max_cpu_loras is not None:
            _positive("max_cpu_loras", self.max_cpu_loras)
            if self.max_cpu_loras < self.max_loras:
                # Every adapter in a device slot is also held on the host (a slot is refilled
                # from there after a preemption), so the host cache is at least the slots.
                raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras="
                                 f"{self.max_loras}")
        names = [check_lora_name(n, "lora_modules name") for n, _ in self.lora_modules]
        for (name, path) in self.lora_modules:
            if not isinstance(path, str) or not path:
                raise ValueError(f"lora_modules {name}: the path must be a non-empty string")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"lora_modules names {dup} appear more than once")

    @property
    def num_cpu_loras(self) -> int:
        """Adapters held loaded on the host (`max_cpu_loras`, default `max_loras`)."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @property
    def num_slots(self) -> int:
        """Slots of the device stacks: the adapters' plus slot 0 (no adapter)."""
        return self.max_loras + 1

    @staticmethod
    def from_options(options: Mapping[str, Any]) -> "LoRAConfig | None":
        """The section from vLLM's option names in `options` (absent ones take their
        defaults); None without `enable_lora`, refusing any other LoRA option then by name.
        `lora_modules`: "NAME=PATH" strings, (name, path) pairs or a {name: path} mapping."""
        enable = options.get("enable_lora", False)
        if not isinstance(enable, bool):
            raise ValueError(f"enable_lora={enable!r:.60} must be true or false")
        given = [k for k in OPTION_NAMES[1:] if options.get(k) not in (None, (), [], {})]
        if not enable:
            if given:
                raise ValueError(f"{given[0]} is a LoRA option: it needs enable_lora=True "
                                 "(--enable-lora)")
            return None
        kwargs = {k: options[k] for k in (*OPTION_NAMES[1:4], "lora_dtype")
                  if options.get(k) is not None}
        return LoRAConfig(lora_modules=parse_lora_modules(options.get("lora_modules") or ()),
                          **kwargs)


def parse_lora_modules(value: object) -> tuple[tuple[str, str], ...]:
    """`lora_modules` in any of its forms -> ((name, path), ...); ValueError naming the bad
    entry. vLLM's JSON form ('{"name": ..., "path": ...}') is taken too."""
    if isinstance(value, Mapping):
        items: Iterable[object] = [(k, v) for k, v in value.items()]
    elif isinstance(value, (str, bytes)):
        items = [value]
    else:
        try:
            items = list(value)  # type: ignore[call-overload]
        except TypeError:
            raise ValueError(f"lora_modules={value!r:.60} must be NAME=PATH entries") from None
    out = []
    for item in items:
        if isinstance(item, str):
            out.append(_parse_entry(item))
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            out.append((str(item[0]), str(item[1])))
        else:
            raise ValueError(f"lora_modules entry {item!r:.60} must be NAME=PATH")
    return tuple(out)


def _parse_entry(text: str) -> tuple[str, str]:
    stripped = text.strip()
    if stripped.startswith("{"):  # vLLM: '{"name": "a", "path": "/p/a", "base_model_name": ..}'
        import json

        try:
            d = json.loads(stripped)
        except ValueError as e:
            raise ValueError(f"lora_modules entry {text!r:.60} is not valid JSON ({e})") from None
        if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not isinstance(
                d.get("path"), str):
            raise ValueError(f"lora_modules entry {text!r:.60} needs string 'name' and 'path'")
        extra = sorted(set(d) - {"name", "path"})
        if extra:  # vLLM's base_model_name among them: the parent is always the served model
            raise ValueError(f"lora_modules entry {d['name']!r:.60}: key {extra[0]!r:.40} is "
                             "not supported (an adapter's base is the served model)")
        return d["name"], d["path"]
    name, sep, path = stripped.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"lora_modules entry {text!r:.60} must be NAME=PATH")
    return name, path
