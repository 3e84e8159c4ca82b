"""What a request must satisfy to run on an engine, and what the engine reports about itself.

Plain Python (no jax). `EngineLimits` is the engine's read-only description (max_model_len,
vocabulary, KV pages, ...); its `check_*` methods are the request checks that depend on those
limits, each written once here: the Engine runs them for its direct callers, and
`jaxserve.serving.admission` runs the very same methods for the fronts and the offline API
(which hand the Engine an already `Admitted` request, so nothing is checked twice).
`EngineStats` is a snapshot of the engine's counters, for metrics and the fronts.

Sizes are bounded before any work that grows with them: a text prompt's UTF-8 size against
`max_prompt_bytes` (max_model_len times the tokenizer's longest token, so a longer text cannot
fit) before it is tokenized, a token-id prompt's length against max_model_len before its ids
are scanned. docs/serving/limits.md lists every bound and what a client gets past it.

Every refusal is an `InvalidRequest` (a ValueError) whose message starts with the name of the
field it is about, in the offline API's vocabulary (`prompt`, `prompt_token_ids`,
`max_tokens`, `request_id`, `messages`, a SamplingParams field); a front renames that leading
name to its wire name (`InvalidRequest.message_as`) and keeps the rest of the text, so the same
bad input reads the same everywhere.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import TYPE_CHECKING, Callable, Container, Sequence

from jaxserve.engine.errors import InvalidRequest
from jaxserve.engine.sampling_params import (MAX_LOGPROBS, MAX_N, SamplingParams, check_text,
                                            show)
from jaxserve.engine.lora_stats import LoraStats
from jaxserve.engine.slo_stats import SloStats
from jaxserve.engine.token_filter import TokenFilter, compile_filter

if TYPE_CHECKING:  # the grammar library loads with the engine that owns a compiler
    from jaxserve.engine.grammar import CompiledGrammar, GrammarCompiler

MAX_REQUEST_ID_LEN = 256  # characters
# The offline API is a trusted caller: any priority the scheduler's ordering can hold.
INT64_RANGE = (-2**63, 2**63 - 1)
# A client of the fronts may only lower its own priority (lower values run first) unless the
# operator allows more (`ServerConfig.client_priority_range`, `--client-priority-min/max`).
DEFAULT_CLIENT_PRIORITY_RANGE = (0, 2**31 - 1)
# Bytes per token assumed when the tokenizer's worst case is unknown (one that may drop or
# merge input, e.g. a whitespace-splitting word-level tokenizer): generous, so only texts far
# beyond max_model_len are refused unread.
FALLBACK_TOKEN_BYTES = 256


def check_request_id(request_id: object) -> None:
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequest(f"request_id={show(request_id)} must be a non-empty string",
                             "request_id")
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise InvalidRequest(f"request_id is {len(request_id)} characters long; at most "
                             f"{MAX_REQUEST_ID_LEN}", "request_id")
    check_text("request_id", request_id)


def check_not_in_flight(request_id: str, in_flight: Container[str]) -> None:
    """The one duplicate-id check: request ids are unique among requests in flight."""
    if request_id in in_flight:
        raise InvalidRequest(f"request_id={request_id!r} is already in flight; request ids "
                             "must be unique among in-flight requests", "request_id")


def check_priority(priority: object, allowed: tuple[int, int] = INT64_RANGE) -> None:
    """An integer in `allowed` (lower runs first): the offline API's int64, or the range the
    operator lets clients of the fronts use."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidRequest(f"priority={show(priority)} must be an integer", "priority")
    lo, hi = allowed
    if not lo <= priority <= hi:
        raise InvalidRequest(f"priority={show(priority)} must be in [{lo}, {hi}]", "priority")


def check_prompt_text(text: object, max_bytes: int | None = None) -> None:
    """A non-empty, valid Unicode text of at most `max_bytes` UTF-8 bytes (checked before
    anything reads the whole text: its length in characters first, each at least one byte)."""
    if not isinstance(text, str) or not text:
        raise InvalidRequest("prompt must not be empty", "prompt")
    check_size("prompt", len(text), max_bytes)
    check_size("prompt", check_text("prompt", text), max_bytes)


def check_size(field: str, num_bytes: int, max_bytes: int | None, what: str = "") -> None:
    """A text (`what`: or all of a conversation's contents) against the prompt byte bound;
    `num_bytes` may be a lower bound (the length in characters)."""
    if max_bytes is not None and num_bytes > max_bytes:
        raise InvalidRequest(
            f"{field}{what} is at least {num_bytes} bytes long; at most {max_bytes} bytes can "
            "fit in max_model_len tokens (max_model_len times the tokenizer's longest token)",
            field)


def _check_prompt_len(n: int, limit: int) -> None:
    if n >= limit:
        raise InvalidRequest(f"prompt has {n} tokens; max_model_len={limit} allows at "
                             f"most {limit - 1} prompt tokens", "prompt")


def check_fits(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
               page_size: int, num_kv_pages: int,
               kv_windows: tuple[int | None, ...] = (None,), max_chunk: int = 0) -> int:
    """Prompt length and max_tokens against max_model_len, and the KV cache: can the
    sequence run to completion? Returns max_tokens resolved (None: up to max_model_len).

    `kv_windows`: the window of each KV group (None: global), whose pages a sequence holds
    side by side; a sliding group holds at most the pages of its window and of two prefill
    chunks of up to `max_chunk` tokens: the one in flight, whose pages slide out only once
    it is applied, and the one scheduled beside it. (Sized for one chunk, a sequence alone
    in the cache preempted itself for the second and recomputed to the same point forever.)"""
    n, limit = num_prompt_tokens, max_model_len
    _check_prompt_len(n, limit)
    if max_tokens is None:
        max_tokens = limit - n
    elif n + max_tokens > limit:
        raise InvalidRequest(
            f"max_tokens={max_tokens} is over the limit: prompt ({n} tokens) + max_tokens "
            f"must be <= max_model_len={limit}, so max_tokens must be in [0, {limit - n}]",
            "max_tokens")
    total = n + max_tokens
    full = -(-total // page_size)
    pages = sum(full if w is None else min(full, -(-(w - 1 + 2 * max_chunk) // page_size) + 1)
                for w in kv_windows)
    if pages > num_kv_pages:
        raise InvalidRequest(
            f"prompt + max_tokens = {total} tokens need {pages} KV pages but the cache "
            f"holds only {num_kv_pages}; lower max_tokens or give the KV cache more "
            "memory", "prompt")
    return max_tokens


@dataclasses.dataclass(frozen=True)
class EngineLimits:
    """The engine's read-only limits; the same on every data-parallel replica."""

    max_model_len: int
    vocab_size: int
    page_size: int
    num_kv_pages: int  # usable pages (the trash page is not counted)
    # The scheduler settings at start-up (descriptive: the live ones, which the admin endpoint
    # may change, are `Engine.scheduler_settings()`; no check reads these two).
    max_num_seqs: int
    max_num_batched_tokens: int
    eos_token_ids: tuple[int, ...]
    max_logprobs: int = MAX_LOGPROBS
    max_n: int = MAX_N
    # Each KV group's window (`SchedulerConfig.kv_windows`): a sequence holds pages in all.
    kv_windows: tuple[int | None, ...] = (None,)
    # UTF-8 bytes one token covers at most (`Tokenizer.max_token_bytes`); None: unknown, the
    # prompt byte bound falls back to FALLBACK_TOKEN_BYTES per token.
    max_token_bytes: int | None = None
    # The largest compiled token bucket: the longest prefill chunk any live setting allows
    # (max_num_batched_tokens may be raised up to it on a running server). The KV check of
    # sliding-window groups sizes two chunks by it, since a request admitted now may still
    # run after such a raise (None: max_num_batched_tokens).
    max_step_tokens: int | None = None
    # Compiles `structured_outputs` specs against the model's vocabulary (None: this engine's
    # tokenizer has no vocabulary llguidance can read, and such requests are refused).
    grammars: "GrammarCompiler | None" = dataclasses.field(default=None, compare=False,
                                                           repr=False)
    # The tokenizer's text -> ids without special tokens, for bad_words (None: no tokenizer,
    # and such requests are refused).
    encode_words: Callable[[str], list[int]] | None = dataclasses.field(
        default=None, compare=False, repr=False)

    @property
    def max_prompt_bytes(self) -> int:
        """A text longer than this cannot tokenize to fewer than max_model_len tokens (with
        a known `max_token_bytes`; else a generous guess), so it is refused before
        tokenization (a conversation: the sum of its contents)."""
        return self.max_model_len * (self.max_token_bytes or FALLBACK_TOKEN_BYTES)

    # ----------------------------------------------------------------------- checks
    def check_params(self, params: SamplingParams) -> None:
        """The sampling fields bounded by the model: top_k, stop ids, logit_bias ids and
        allowed_token_ids in the vocabulary."""
        vocab = self.vocab_size
        if params.top_k > vocab:
            raise InvalidRequest(f"top_k={params.top_k} must be -1 or 0 (disabled) or in "
                                 f"[1, {vocab}] (the vocabulary size)", "top_k")
        for i, t in enumerate(params.stop_token_ids):
            if t >= vocab:
                raise InvalidRequest(f"stop_token_ids[{i}]={t} is outside the vocabulary "
                                     f"[0, {vocab})", "stop_token_ids")
        for t, _ in params.logit_bias:
            if t >= vocab:
                raise InvalidRequest(f"logit_bias key {t} is outside the vocabulary "
                                     f"[0, {vocab})", "logit_bias")
        allowed = params.allowed_token_ids
        if allowed and max(allowed) >= vocab:
            i = next(i for i, t in enumerate(allowed) if t >= vocab)
            raise InvalidRequest(f"allowed_token_ids[{i}]={allowed[i]} is outside the "
                                 f"vocabulary [0, {vocab})", "allowed_token_ids")

    def check_prompt_ids(self, ids: Sequence[int], from_text: bool = False) -> list[int]:
        """Non-empty, shorter than max_model_len (checked before the ids are scanned) and
        inside the vocabulary; `from_text`: the ids of a text prompt."""
        ids = list(ids)
        if not ids:
            if from_text:
                raise InvalidRequest("prompt tokenizes to no tokens", "prompt")
            raise InvalidRequest("prompt_token_ids must not be empty", "prompt_token_ids")
        _check_prompt_len(len(ids), self.max_model_len)
        vocab = self.vocab_size
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequest(f"prompt_token_ids[{i}]={show(t)} is outside the vocabulary "
                                     f"[0, {vocab})", "prompt_token_ids")
        return ids

    def check_fits(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        return check_fits(num_prompt_tokens, max_tokens, self.max_model_len, self.page_size,
                          self.num_kv_pages, self.kv_windows,
                          self.max_step_tokens or self.max_num_batched_tokens)

    def truncate(self, ids: Sequence[int], params: SamplingParams) -> Sequence[int]:
        """The prompt ids `params.truncate_prompt_tokens` keeps (vLLM's left truncation): the
        last k, or with -1 the last max_model_len - max(max_tokens, 1) (as many as leave room
        for the output; max_tokens unset: one token). k over max_model_len is refused, as
        vLLM does; a kept prompt that is still too long meets the usual length checks."""
        k, limit = params.truncate_prompt_tokens, self.max_model_len
        if k is None:
            return ids
        if k > limit:
            raise InvalidRequest(f"truncate_prompt_tokens={k} must be -1 or at most "
                                 f"max_model_len={limit}", "truncate_prompt_tokens")
        if k == -1:
            room = max(params.max_tokens or 0, 1)
            if room >= limit:
                raise InvalidRequest(
                    f"truncate_prompt_tokens=-1 keeps max_model_len - max_tokens prompt "
                    f"tokens, but max_tokens={params.max_tokens} leaves none of "
                    f"max_model_len={limit}", "truncate_prompt_tokens")
            k = limit - room
        return ids[-k:] if len(ids) > k else ids

    def admit(self, prompt: str | Sequence[int], params: SamplingParams,
              encode: Callable[[str], list[int]] | None = None) -> "Admitted":
        """Every limit check of one request; text prompts need `encode`, which is called only
        for a text that can fit. With truncate_prompt_tokens the prompt is truncated first
        (`truncate`), and everything after sees the kept tokens; the prompt's text is then
        dropped (None) when tokens were cut, since it no longer is the prompt's."""
        self.check_params(params)
        text = None
        if isinstance(prompt, str):
            check_prompt_text(prompt, self.max_prompt_bytes)
            assert encode is not None, "a text prompt needs a tokenizer"
            whole = encode(prompt)
            kept = self.truncate(whole, params)
            text = prompt if len(kept) == len(whole) else None
            ids = self.check_prompt_ids(kept, from_text=True)
        else:
            ids = self.check_prompt_ids(self.truncate(prompt, params))
        max_tokens = self.check_fits(len(ids), params.max_tokens)
        return Admitted(text, tuple(ids), params, max_tokens, self.compile_grammar(params),
                        compile_filter(params, self.vocab_size, self.encode_words))

    def compile_grammar(self, params: SamplingParams) -> "CompiledGrammar | None":
        """The request's grammar (None: no structured_outputs); InvalidRequest naming the
        field when the spec does not compile against this model's vocabulary."""
        spec = params.structured_outputs
        if spec is None:
            return None
        if self.grammars is None:
            raise InvalidRequest("structured_outputs needs a tokenizer whose vocabulary the "
                                 "grammar library can read; this model's cannot be",
                                 "structured_outputs")
        return self.grammars.compile(spec)


@dataclasses.dataclass(frozen=True)
class Admitted:
    """A request that passed every limit check (`EngineLimits.admit`): the Engine queues it
    without checking again."""

    prompt: str | None
    token_ids: tuple[int, ...]
    params: SamplingParams
    max_tokens: int  # resolved
    grammar: "CompiledGrammar | None" = None  # params.structured_outputs, compiled
    token_filter: TokenFilter | None = None  # params.allowed_token_ids / bad_words, compiled


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of one engine's state and cumulative counters."""

    num_requests: int  # user requests in flight (n samples count once)
    num_running: int  # sequences in the running batch
    num_waiting: int  # sequences waiting to be scheduled
    kv_pages_used: int  # held by live sequences (cached-but-free pages count as free)
    kv_pages_total: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache (full pages)
    prefix_cache_hits: int  # prompt tokens found there
    num_preemptions: int
    num_steps: int
    last_step_tokens: int
    compiles_after_warmup: int
    # Speculative decoding (vLLM's spec_decode counters): verification rows that carried
    # proposals (drafts), the proposed tokens, and those accepted; `spec_acceptance_counts[i]`
    # drafts emitted i + 1 tokens (i accepted, plus the target's own; length k + 1).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_acceptance_counts: tuple[int, ...] = ()
    slo: SloStats = SloStats()  # the SLO policy's decisions and attainment (slo_policy.py)
    lora: LoraStats = LoraStats()  # adapters in use and per-adapter counts (lora_stats.py)

    @classmethod
    def total(cls, stats: Sequence["EngineStats"]) -> "EngineStats":
        """Several engines' stats added up (data-parallel replicas; tuples element-wise)."""
        def add(values: list) -> object:
            if values and isinstance(values[0], (SloStats, LoraStats)):
                return functools.reduce(operator.add, values)
            if values and isinstance(values[0], tuple):
                width = max(len(v) for v in values)
                return tuple(sum(v[i] for v in values if i < len(v)) for i in range(width))
            return sum(values)
        return cls(*(add([getattr(s, f.name) for s in stats]) for f in dataclasses.fields(cls)))

    @property
    def kv_usage(self) -> float:
        return self.kv_pages_used / self.kv_pages_total if self.kv_pages_total else 0.0

