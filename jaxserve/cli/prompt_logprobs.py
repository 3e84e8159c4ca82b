"""Prompt logprobs as text for the terminal (`jaxserve generate` / `jaxserve client` with
--prompt-logprobs N): one line per prompt token after the completion.

    prompt logprobs (token, logprob, top-N):
         5 'w5'
         6 'w6'      -3.2190  top: 12 'w12' -1.0312, 6 'w6' -3.2190

The first token has no logprob (nothing precedes it). Without a tokenizer (the gRPC client)
tokens are shown by id only.
"""

from __future__ import annotations

from typing import Callable, Sequence

from jaxserve.engine.outputs import TokenLogprobs


def _token(tid: int, decode: Callable[[int], str] | None) -> str:
    return f"{tid}" if decode is None else f"{tid} {decode(tid)!r}"


def format_prompt_logprobs(prompt_ids: Sequence[int],
                           entries: Sequence[TokenLogprobs | None] | None, n: int,
                           decode: Callable[[int], str] | None = None) -> str:
    """The table above for a RequestOutput's prompt_logprobs (`n`: the top-N shown)."""
    lines = ["prompt logprobs (token, logprob, top-N):"]
    if entries is None:
        return lines[0] + " none came back"
    width = max((len(_token(t, decode)) for t in prompt_ids), default=0)
    for tid, entry in zip(prompt_ids, entries):
        head = f"  {_token(tid, decode):<{width}}"
        if entry is None:
            lines.append(head.rstrip())
            continue
        best = sorted(entry.items(), key=lambda kv: -kv[1])[:n]
        top = ", ".join(f"{_token(t, decode)} {v:.4f}" for t, v in best)
        lines.append(f"{head}  {entry[tid]:9.4f}" + (f"  top: {top}" if top else ""))
    return "\n".join(lines)
