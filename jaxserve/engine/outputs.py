"""What the engine hands back: RequestOutput with one CompletionOutput per sample (vLLM shape).

A request a failed step finished has finish_reason ERROR and `error` (why) on the failed
samples and on the RequestOutput; its other outputs (and every other request's) are intact.

Plain Python. What an output carries depends on its request's `RequestOutputKind`, chosen by
the caller when it adds the request (vLLM's RequestOutputKind; not a sampling field):
  CUMULATIVE  every step's output carries `text`/`token_ids`/`logprobs` so far (a fresh copy
              each time: O(tokens) per output) plus the `delta_*` fields, what is new since
              the request's previous output. The sync Engine's default.
  DELTA       only the `delta_*` fields; `text` is "", `token_ids` [] and `logprobs` [] (or
              None without logprobs), so an output costs O(new tokens). Streams use it.
  FINAL_ONLY  no output until the request finishes, then one with everything: the
              cumulative fields filled, and the `delta_*` fields equal to them (everything is
              new since there was no previous output). Non-streaming callers use it.
In every kind `num_tokens` (tokens generated so far) and `cumulative_logprob` are the running
totals, so usage and finish reasons can be reported from a DELTA stream's final output.

`merge_unread` folds a newer output of the same request into an older one nobody has read yet
(deltas concatenated, everything else taken from the newer): what a stream's reader gets when
it falls behind.
"""

from __future__ import annotations

import dataclasses
import enum

from jaxserve.engine.sequence import FinishReason, RequestMetrics

# One generated token's logprobs: {token_id: logprob} holding the sampled token and the top-N.
TokenLogprobs = dict[int, float]


class RequestOutputKind(enum.Enum):
    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[TokenLogprobs] | None
    finish_reason: FinishReason | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    metrics: RequestMetrics | None = None
    error: str | None = None  # with finish_reason ERROR: why this sample failed
    num_tokens: int = 0  # tokens generated so far, whatever the output kind
    # `LLM.chat` with tools (`serving.chat.Message`): the text around the tool calls (None
    # when calls were made and nothing else written) and the calls in OpenAI's shape
    # ({"id", "type": "function", "function": {"name", "arguments"}}); `text` stays the raw
    # text. Both None when the output was not read for calls.
    content: str | None = None
    tool_calls: list[dict] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics  # of sample 0 (arrival, queue, first token, preemptions, cache)
    num_cached_tokens: int = 0
    error: str | None = None  # a sample failed (finish_reason ERROR): why
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (no
    # context), else {prompt token: logprob, top-N ids: logprobs}. Set once the prefill is
    # done: on every later output (CUMULATIVE, FINAL_ONLY), on the first only (DELTA).
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def num_delta_tokens(self) -> int:
        """Tokens new in this output, over every sample."""
        return sum(len(c.delta_token_ids) for c in self.outputs)


def merge_unread(older: RequestOutput, newer: RequestOutput) -> None:
    """Fold `newer` into `older` in place (both of one request, `older` unread and owned by
    the caller; `newer` is left as it is): the deltas concatenated, everything else (the
    cumulative fields, counts, finish reasons) taken from `newer`."""
    by_index = {c.index: c for c in older.outputs}
    for c in newer.outputs:
        old = by_index.get(c.index)
        if old is None:  # not expected (every output lists every sample), but lose nothing
            older.outputs.append(dataclasses.replace(
                c, delta_token_ids=list(c.delta_token_ids),
                delta_logprobs=list(c.delta_logprobs)))
            continue
        old.delta_text += c.delta_text
        old.delta_token_ids.extend(c.delta_token_ids)
        old.delta_logprobs.extend(c.delta_logprobs)
        old.text, old.token_ids, old.logprobs = c.text, c.token_ids, c.logprobs
        old.cumulative_logprob, old.num_tokens = c.cumulative_logprob, c.num_tokens
        old.finish_reason, old.metrics, old.error = c.finish_reason, c.metrics, c.error
    older.outputs.sort(key=lambda c: c.index)
    older.finished, older.metrics = newer.finished, newer.metrics
    older.num_cached_tokens, older.error = newer.num_cached_tokens, newer.error
    if newer.prompt_logprobs is not None:
        older.prompt_logprobs = newer.prompt_logprobs
