"""The live scheduler settings as the gRPC `SchedulerSettings` message, both ways.

JSON (the HTTP admin endpoint, `Engine.scheduler_settings()`) says "none" with null; the
proto's scalar fields cannot, so decode_token_budget 0 and an SLO "" mean none there, and an
SLO travels as the text --ttft-slo takes ("S", "LEVEL=S,...", "S,LEVEL=S,..."). An update
sets only the fields it changes (`optional`: `HasField`). Nothing is validated here: the
engine checks every value (`engine/live_settings.py`). Shared by the server's Admin servicer
and the Python client.
"""

from __future__ import annotations

from typing import Any, Mapping

from jaxserve.server import stubs
from jaxserve.slo_config import LIVE_SCHEDULER_FIELDS

pb2 = stubs.load().pb2
_SLOS = ("ttft_slo", "itl_slo")


def settings_to_proto(settings: Mapping[str, Any]) -> Any:
    """{field: JSON value} (every field, or the ones to change) -> SchedulerSettings."""
    msg = pb2.SchedulerSettings()
    for name, value in settings.items():
        if name in _SLOS:
            value = _slo_text(value)
        elif name == "decode_token_budget" and value is None:
            value = 0
        setattr(msg, name, value)
    return msg


def _slo_text(value: Any) -> str:
    """An SLO's JSON form (None, seconds, {"default"?: s, "LEVEL": s}) as the flag's text;
    a text as it is (the server reads and checks it)."""
    if value is None:
        return ""
    if isinstance(value, Mapping):
        return ",".join(f"{v}" if k == "default" else f"{k}={v}" for k, v in value.items())
    return str(value)


def changes_from_proto(msg: Any) -> dict[str, Any]:
    """The fields set, with the proto's none (0, "") as None."""
    out: dict[str, Any] = {}
    for name in LIVE_SCHEDULER_FIELDS:
        if msg.HasField(name):
            value = getattr(msg, name)
            none = name == "decode_token_budget" and value == 0 or name in _SLOS and not value
            out[name] = None if none else value
    return out
