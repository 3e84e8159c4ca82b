"""What the engine hands back: RequestOutput with one CompletionOutput per sample (vLLM shape).

Plain Python. `text`/`token_ids` are cumulative; `delta_text`/`delta_token_ids` hold what is
new since the previous output of the same request (what a stream sends).

A request a failed step finished has finish_reason ERROR and `error` (why) on the failed
samples and on the RequestOutput; its other outputs (and every other request's) are intact.
"""

from __future__ import annotations

import dataclasses

from jaxserve.engine.request import FinishReason, RequestMetrics

# One generated token's logprobs: {token_id: logprob} holding the sampled token and the top-N.
TokenLogprobs = dict[int, float]


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
