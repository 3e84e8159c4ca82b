"""Benchmark workloads: what the load generator sends, decided before the first request.

Data flow: a `WorkloadSpec` (from CLI flags or code) + a seed -> `build_requests` -> a list of
`BenchRequest` (prompt as token ids or text, max_tokens, a `kind` tag the report groups by).
Everything is drawn up front from one numpy Generator, so two runs with the same seed send the
very same requests to whichever target, jaxserve or a peer.

Synthetic prompts are random token ids (exact input lengths on any server that accepts token-id
prompts: jaxserve's gRPC `token_ids`, OpenAI `/v1/completions` with a list of ints); ids are
drawn from [TOKEN_LOW, vocab_size) to stay clear of the special tokens low-numbered in common
vocabularies. Requests are sent with ignore_eos so output lengths are exactly as drawn.

Length distributions (`parse_length_dist`): `fixed:N`, `uniform:LO-HI`, `lognormal:MEDIAN,SIGMA`
(clipped to [1, 8 * MEDIAN]). Workloads: `synthetic`, `longtail` (a mix: mostly short chats
plus a fraction of very long prompts), `shared-prefix` (one long common system prompt + a short
distinct suffix: what prefix caching is for), `jsonl` (a file of prompts).

The chat endpoint (`targets.OpenAIChatTarget`) sends the same requests as message lists: a
request's `system_len` leading ids (the shared-prefix workload's common prefix) become the
system message, the rest the user turn.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

import numpy as np

TOKEN_LOW = 1000  # synthetic ids start here: clear of BOS/EOS/chat-control ids
WORKLOADS = ("synthetic", "longtail", "shared-prefix", "jsonl")


@dataclasses.dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts."""

    kind: str  # fixed | uniform | lognormal
    a: float  # fixed: N; uniform: low; lognormal: median
    b: float = 0.0  # uniform: high; lognormal: sigma

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "lognormal"):
            raise ValueError(f"length distribution kind={self.kind!r} must be fixed, uniform "
                             "or lognormal")
        if self.a < 1:
            raise ValueError(f"{self.kind} length {self.a} must be >= 1")
        if self.kind == "uniform" and self.b < self.a:
            raise ValueError(f"uniform:{self.a:g}-{self.b:g}: high must be >= low")
        if self.kind == "lognormal" and self.b < 0:
            raise ValueError(f"lognormal sigma={self.b} must be >= 0")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """i64[n] lengths >= 1."""
        if self.kind == "fixed":
            out = np.full(n, self.a)
        elif self.kind == "uniform":
            out = rng.integers(int(self.a), int(self.b) + 1, size=n)
        else:
            out = np.clip(rng.lognormal(np.log(self.a), self.b, size=n), 1, 8 * self.a)
        return np.maximum(np.rint(out).astype(np.int64), 1)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.a:g}"
        sep = "-" if self.kind == "uniform" else ","
        return f"{self.kind}:{self.a:g}{sep}{self.b:g}"


def parse_length_dist(text: str) -> LengthDist:
    """`fixed:256` | `uniform:16-1024` | `lognormal:200,0.8` | a bare integer (fixed)."""
    t = text.strip().lower()
    if re.fullmatch(r"\d+", t):
        return LengthDist("fixed", float(t))
    m = re.fullmatch(r"(fixed):(\d+)|(uniform):(\d+)-(\d+)|(lognormal):([\d.]+),([\d.]+)", t)
    if not m:
        raise ValueError(f"length distribution {text!r}: expected fixed:N, uniform:LO-HI or "
                         "lognormal:MEDIAN,SIGMA")
    if m.group(1):
        return LengthDist("fixed", float(m.group(2)))
    if m.group(3):
        return LengthDist("uniform", float(m.group(4)), float(m.group(5)))
    return LengthDist("lognormal", float(m.group(7)), float(m.group(8)))


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    prompt: str | tuple[int, ...]  # token ids (synthetic) or text (jsonl)
    max_tokens: int
    kind: str = "default"  # the report's group: chat | long | ...
    system_len: int = 0  # leading prompt ids that are the common system prompt (shared-prefix)

    @property
    def prompt_len(self) -> int | None:
        """Prompt tokens when known before sending (token-id prompts)."""
        return None if isinstance(self.prompt, str) else len(self.prompt)


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    kind: str = "synthetic"  # one of WORKLOADS
    input_len: LengthDist = LengthDist("uniform", 32, 512)
    output_len: LengthDist = LengthDist("fixed", 128)
    # longtail: this fraction of requests gets `long_input_len` prompts, kind "long"
    long_fraction: float = 0.05
    long_input_len: LengthDist = LengthDist("uniform", 3000, 6000)
    prefix_len: int = 1024  # shared-prefix: tokens of the common system prompt
    dataset: str | None = None  # jsonl: path of {"prompt": ..., "max_tokens"?: ...} lines
    vocab_size: int = 32000  # synthetic ids are drawn below this
    max_prompt_len: int | None = None  # clip drawn prompt lengths (the server's limit)

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ValueError(f"workload={self.kind!r} must be one of {WORKLOADS}")
        if not 0 <= self.long_fraction <= 1:
            raise ValueError(f"long_fraction={self.long_fraction} must be in [0, 1]")
        if self.vocab_size < 8:
            raise ValueError(f"vocab_size={self.vocab_size} must be >= 8")
        if self.kind == "jsonl" and not self.dataset:
            raise ValueError("workload=jsonl needs a dataset file (--dataset)")
        if self.prefix_len < 0:
            raise ValueError(f"prefix_len={self.prefix_len} must be >= 0")

    def describe(self) -> str:
        if self.kind == "jsonl":
            return f"jsonl:{self.dataset}"
        base = f"{self.kind} in={self.input_len} out={self.output_len}"
        if self.kind == "longtail":
            base += f" + {self.long_fraction:.0%} long in={self.long_input_len}"
        if self.kind == "shared-prefix":
            base += f" prefix={self.prefix_len}"
        return base


def _ids(rng: np.random.Generator, n: int, vocab: int) -> tuple[int, ...]:
    # Tiny test vocabularies: skip their lowest quarter instead.
    low = TOKEN_LOW if vocab > 4 * TOKEN_LOW else max(3, vocab // 4)
    return tuple(int(t) for t in rng.integers(low, vocab, size=n))


def _clip(n: int, spec: WorkloadSpec, out: int) -> int:
    if spec.max_prompt_len is None:
        return n
    return max(1, min(n, spec.max_prompt_len - out))


def build_requests(spec: WorkloadSpec, num: int, seed: int = 0) -> list[BenchRequest]:
    """`num` requests of the workload, the same for the same (spec, num, seed)."""
    if num < 1:
        raise ValueError(f"number of requests {num} must be >= 1")
    rng = np.random.default_rng(seed)
    if spec.kind == "jsonl":
        return load_jsonl(spec.dataset or "", num, spec.output_len, rng)
    outs = spec.output_len.sample(rng, num)
    ins = spec.input_len.sample(rng, num)
    kinds = ["chat"] * num
    if spec.kind == "longtail":
        is_long = rng.random(num) < spec.long_fraction
        long_ins = spec.long_input_len.sample(rng, num)
        ins = np.where(is_long, long_ins, ins)
        kinds = ["long" if x else "chat" for x in is_long]
    prefix = _ids(rng, spec.prefix_len, spec.vocab_size) if spec.kind == "shared-prefix" else ()
    reqs = []
    for n_in, n_out, kind in zip(ins.tolist(), outs.tolist(), kinds):
        n_in = _clip(len(prefix) + n_in, spec, n_out) - len(prefix)
        prompt = prefix + _ids(rng, max(n_in, 1), spec.vocab_size)
        reqs.append(BenchRequest(prompt, int(n_out), kind, len(prefix)))
    return reqs


def load_jsonl(path: str, num: int, output_len: LengthDist,
               rng: np.random.Generator) -> list[BenchRequest]:
    """Requests from a JSONL file of {"prompt": text | [ids], "max_tokens"?: int} lines
    (cycled when the file has fewer than `num`); lines without max_tokens draw from
    `output_len`."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise ValueError(f"dataset {path!r} is not a file")
    rows = []
    for i, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = row["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{i}: expected a JSON object with 'prompt' ({e})") from None
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
                isinstance(t, int) for t in prompt))):
            raise ValueError(f"{path}:{i}: prompt must be text or a list of token ids")
        rows.append((prompt if isinstance(prompt, str) else tuple(prompt), row.get("max_tokens")))
    if not rows:
        raise ValueError(f"dataset {path!r} has no prompts")
    drawn = output_len.sample(rng, num).tolist()
    return [BenchRequest(rows[i % len(rows)][0], int(rows[i % len(rows)][1] or drawn[i]),
                         "default") for i in range(num)]


def chunked_prefill_requests(num_chats: int, num_long: int, long_len: int, vocab_size: int,
                             seed: int = 0, chat_in: LengthDist = LengthDist("uniform", 32, 256),
                             chat_out: int = 96, long_out: int = 16
                             ) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """(chats, long prompts) of the chunked-prefill scenario."""
    rng = np.random.default_rng(seed)
    chats = [BenchRequest(_ids(rng, int(n), vocab_size), chat_out, "chat")
             for n in chat_in.sample(rng, num_chats)]
    longs = [BenchRequest(_ids(rng, long_len, vocab_size), long_out, "long")
             for _ in range(num_long)]
    return chats, longs
