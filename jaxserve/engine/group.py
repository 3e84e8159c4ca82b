"""One user request inside the engine: its n sample sequences, and its outputs.

Plain Python (no jax). The engine creates a `Group` per request id and, each step the request
has news, asks it for its `RequestOutput` (`output`), shaped by its `RequestOutputKind`: what
has been reported per sample (`sent_tokens`, `sent_logprobs`) is tracked here, so a DELTA
output carries only what is new and a CUMULATIVE one a fresh copy of everything. The
sequences' KV state stays the scheduler's; a Group only reads the sequences.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.outputs import (CompletionOutput, RequestOutput, RequestOutputKind,
                                     TokenLogprobs)
from jaxserve.engine.sequence import Sequence
from jaxserve.engine.sampling_params import SamplingParams


@dataclasses.dataclass(eq=False)
class Group:
    """One user request: its n sample sequences and what has been reported for each."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer]
    sent_tokens: list[int]  # tokens already reported per sample
    sent_logprobs: list[int]
    cumulative_logprob: list[float]
    kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    done_reported: bool = False
    prompt_logprobs_sent: bool = False  # a DELTA request's prompt logprobs went out

    @classmethod
    def create(cls, request_id: str, prompt: str | None, prompt_token_ids: list[int],
               params: SamplingParams, seqs: list[Sequence], backend: Any,
               kind: RequestOutputKind) -> "Group":
        """A new request's group: a detokenizer per sample (`backend`: the tokenizer's)."""
        n = len(seqs)
        return cls(request_id, prompt, prompt_token_ids, params, seqs,
                   [IncrementalDetokenizer(backend, params) for _ in seqs], [0] * n, [0] * n,
                   [0.0] * n, kind)

    def holds(self, req: Sequence) -> bool:
        """Whether `req` is this group's sample (not a stale or foreign sequence)."""
        return req.sample_index < len(self.seqs) and self.seqs[req.sample_index] is req

    def error_output(self, message: str) -> RequestOutput:
        """A final output for a request whose output could not be built (the caller has
        finished its unfinished samples with ERROR; finished ones keep their reason; no
        sample is blamed): the text is lost, the token ids are reported as its output kind
        asks."""
        self.done_reported = True
        delta = self.kind is RequestOutputKind.DELTA  # a stream has had its tokens already
        completions = [CompletionOutput(
            index=i, text="", token_ids=[] if delta else list(seq.output_token_ids),
            cumulative_logprob=None, logprobs=None, finish_reason=seq.finish_reason,
            delta_token_ids=seq.output_token_ids[self.sent_tokens[i]:], metrics=seq.metrics,
            num_tokens=len(seq.output_token_ids), error=seq.error)
            for i, seq in enumerate(self.seqs)]
        first = self.seqs[0].metrics
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=self.prompt_token_ids, outputs=completions,
                             finished=True, metrics=first, error=message,
                             num_cached_tokens=first.num_cached_tokens)

    def output(self) -> RequestOutput | None:
        """The group's output for this step as its kind asks (None: a FINAL_ONLY request that
        has not finished); what it reports is marked as sent."""
        finished = all(s.is_finished for s in self.seqs)
        if self.kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None  # its detokenizers keep the text; the final output takes it all
        completions = [self._completion(i) for i in range(len(self.seqs))]
        self.done_reported = finished
        first = self.seqs[0].metrics
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=self.prompt_token_ids, outputs=completions,
                             finished=finished, metrics=first,
                             error=next((s.error for s in self.seqs if s.error), None),
                             num_cached_tokens=first.num_cached_tokens,
                             prompt_logprobs=self._prompt_logprobs(finished))

    def _prompt_logprobs(self, finished: bool) -> list[TokenLogprobs | None] | None:
        """The group's prompt logprobs when this output should carry them: once sample 0's
        prefill is done (or the request is over); a DELTA request gets them once."""
        first = self.seqs[0]
        if self.params.prompt_logprobs is None or self.prompt_logprobs_sent or not (
                finished or first.num_output_tokens or first.num_computed_tokens >=
                first.num_prompt_tokens):
            return None
        self.prompt_logprobs_sent = self.kind is RequestOutputKind.DELTA
        return list(first.prompt_logprobs or [None] * len(self.prompt_token_ids))

    def _completion(self, i: int) -> CompletionOutput:
        seq, detok = self.seqs[i], self.detoks[i]
        new_ids = seq.output_token_ids[self.sent_tokens[i]:]
        self.sent_tokens[i] = len(seq.output_token_ids)
        # A finished sequence flushes what was held back for a possible stop string.
        delta_text = detok.finish() if seq.is_finished else detok.pop_delta()
        with_lp = self.params.logprobs is not None
        new_lp = seq.output_logprobs[self.sent_logprobs[i]:]
        self.cumulative_logprob[i] += sum(lp for lp, _ in new_lp)
        delta_lp: list[TokenLogprobs] = [dict(items) for _, items in new_lp]
        if self.kind is RequestOutputKind.DELTA:
            # Nothing of a DELTA request is reported twice: the engine keeps no logprob
            # history for it (its token ids stay: preemption recomputes from them).
            seq.output_logprobs.clear()
            self.sent_logprobs[i] = 0
            text, ids, lps = "", [], ([] if with_lp else None)
        else:
            self.sent_logprobs[i] = len(seq.output_logprobs)
            text, ids = detok.text, list(seq.output_token_ids)
            lps = [dict(items) for _, items in seq.output_logprobs] if with_lp else None
        return CompletionOutput(
            index=i, text=text, token_ids=ids,
            cumulative_logprob=self.cumulative_logprob[i] if with_lp else None, logprobs=lps,
            finish_reason=seq.finish_reason, delta_text=delta_text, delta_token_ids=new_ids,
            delta_logprobs=delta_lp, metrics=seq.metrics, num_tokens=len(seq.output_token_ids),
            error=seq.error)
