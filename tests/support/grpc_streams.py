"""Checks of the gRPC front's streamed GenerateResponse messages."""

from __future__ import annotations


def check_stream_shape(msgs: list, n: int) -> None:
    """Per sample: chunks, then exactly one Finished, nothing after it."""
    done: set[int] = set()
    for m in msgs:
        index = m.chunk.index if m.HasField("chunk") else m.finished.index
        assert index not in done, "message after its sample's Finished"
        if m.HasField("finished"):
            done.add(index)
    assert done == set(range(n))
