"""InvalidRequest: the one error type of every request check (a ValueError).

`field` names the request field the error is about, in the offline API's vocabulary
(`prompt`, `prompt_token_ids`, `max_tokens`, `request_id`, `messages`, a SamplingParams
field); the message starts with that name and states the allowed values. A front renames the
leading name to its own wire name (`message_as`) and keeps the rest, so the same bad input
reads the same through `LLM`, gRPC and HTTP.
"""

from __future__ import annotations


class InvalidRequest(ValueError):
    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
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
