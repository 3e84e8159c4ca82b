"""InvalidRequest: the one error type of every request check (a ValueError).

`field` names the request field the error is about, in the offline API's vocabulary
(`prompt`, `prompt_token_ids`, `max_tokens`, `request_id`, `messages`, a SamplingParams
field); the message starts with that name and states the allowed values. A front renames the
leading name to its own wire name (`message_as`) and keeps the rest, so the same bad input
reads the same through `LLM`, gRPC and HTTP.

Messages are bounded (`bounded`: at most MAX_MESSAGE_CHARS): an error that quotes the input
(a parser's message on a 60,000-character regex) would otherwise make a 240 KB HTTP body or a
gRPC status too large for its metadata limit (RESOURCE_EXHAUSTED instead of the error).
"""

from __future__ import annotations

# gRPC carries the message in a trailer (8 KiB of metadata in all by default); 500
# characters keep a field name, the rule and an excerpt of the offending value.
MAX_MESSAGE_CHARS = 500


def bounded(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`message` cut to `limit` characters, the cut marked with how much was left out."""
    if len(message) <= limit:
        return message
    tail = f"... ({len(message) - limit} more characters)"
    return message[:max(0, limit - len(tail))] + tail


class InvalidRequest(ValueError):
    def __init__(self, message: str, field: str | None = None):
        super().__init__(bounded(message))
        self.field = field

    def message_as(self, wire_field: str | None) -> str:
        """The message with its leading field name replaced by `wire_field`."""
        text = str(self)
        if self.field is None or wire_field is None or not text.startswith(self.field):
            return text
        return wire_field + text[len(self.field):]

    @classmethod
    def of(cls, error: ValueError) -> "InvalidRequest":
        """`error` as an InvalidRequest (a plain ValueError names no field)."""
        return error if isinstance(error, InvalidRequest) else cls(str(error))


class EngineDead(RuntimeError):
    """The engine cannot step any more (a device / runtime failure, or state that could not
    be restored after a failed step); the message says why. Every request in flight is lost:
    the process should report it and exit so that a supervisor restarts it."""


class Overloaded(RuntimeError):
    """A request refused for load, not for what it asks (HTTP 429 / gRPC RESOURCE_EXHAUSTED):
    retrying later may succeed."""


class SloUnattainable(Overloaded):
    """With `slo_admission="reject"`: the request's predicted time to first token at the
    current load already passes its priority level's TTFT target (`slo_policy.SloPolicy.
    predict_ttft`). `predicted_s` is that prediction (inf: running streams leave no room for
    prefill under the ITL target)."""

    def __init__(self, predicted_s: float, target_s: float, priority: int):
        wait = "no prefill capacity under the ITL target" if predicted_s == float("inf") \
            else f"{predicted_s:.3f} s predicted"
        super().__init__(f"time to first token cannot meet the TTFT target of {target_s:g} s "
                         f"for priority {priority} at the current load ({wait}); retry later")
        self.predicted_s = predicted_s
        self.target_s = target_s
        self.priority = priority
