"""Logprobs and echo in the OpenAI fronts' shapes, from the engine's entries.

An engine entry (`TokenLogprobs`) is {scored token: logprob, top-N ids: logprobs}: the scored
token first (a sampled token, or a prompt token for `prompt_logprobs`), the top-N after it,
the scored one only once when it is among them. A prompt's first token has no entry (None):
nothing precedes it.

  `legacy_logprobs`   pairs of (token id, entry or None) -> OpenAI's completions logprobs
                      object {tokens, token_logprobs, top_logprobs, text_offset}: with echo
                      the prompt's pairs come first (its first token's token_logprob and
                      top_logprobs null), then the generated ones, text_offset continuous.
  `vllm_prompt_logprobs`  a RequestOutput's prompt_logprobs -> vLLM's `prompt_logprobs`
                      field: [None, {"<id>": {"logprob", "rank", "decoded_token"}}, ...].
  `echo_of_chat`      the text /v1/chat/completions' echo prepends.

Ranks: vLLM ranks a prompt token over the whole vocabulary; the engine's entry only holds the
top-N, so a prompt token's rank is its place among them when it is one of them (the entry
then has N keys), and null when it is not (its rank is only known to be above N). The top-N
tokens are ranked 1..N, likeliest first.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from jaxserve.engine.outputs import TokenLogprobs

Pair = tuple[int, TokenLogprobs | None]  # a token and its entry (None: a prompt's first)


def _best(entry: TokenLogprobs, n: int) -> list[tuple[int, float]]:
    """The `n` likeliest of an entry, likeliest first."""
    return sorted(entry.items(), key=lambda kv: -kv[1])[:n]


def prompt_pairs(prompt_ids: Sequence[int],
                 entries: Sequence[TokenLogprobs | None] | None) -> list[Pair]:
    """A prompt's tokens with their entries (all None when the engine sent none)."""
    if entries is None:
        return [(t, None) for t in prompt_ids]
    return list(zip(prompt_ids, entries))


def generated_pairs(entries: Sequence[TokenLogprobs]) -> list[Pair]:
    return [(next(iter(e)), e) for e in entries]


def legacy_logprobs(pairs: Sequence[Pair], decode: Callable[[int], str], offset: int,
                    n: int) -> tuple[dict[str, Any], int]:
    """OpenAI's legacy completions logprobs object for `pairs` whose text starts at `offset`
    characters, each token's top_logprobs holding it and the `n` likeliest (an echoed
    prompt's entries may hold more: the engine computed max(logprobs, prompt_logprobs));
    and the offset after the last token."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in pairs:
        text = decode(tid)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(entry[tid])
        top = {decode(tid): entry[tid]}
        for t, v in _best(entry, n):
            top.setdefault(decode(t), v)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}, offset


def vllm_prompt_logprobs(prompt_ids: Sequence[int],
                         entries: Sequence[TokenLogprobs | None] | None, shown: int,
                         computed: int, decode: Callable[[int], str]
                         ) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {str(id): {logprob,
    rank, decoded_token}} for the prompt token and the `shown` likeliest. `computed`: the N
    the engine was asked for (>= shown), which tells whether the prompt token is among the
    entry's top-N (the entry then holds N keys) and so has a known rank."""
    if entries is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for tid, entry in zip(prompt_ids, entries):
        if entry is None:
            out.append(None)
            continue
        ranked = _best(entry, computed)
        ranks = {t: i + 1 for i, (t, _) in enumerate(ranked)}
        among_top = len(entry) == computed  # else the prompt token came on top of the N
        item = {str(tid): {"logprob": entry[tid], "rank": ranks[tid] if among_top else None,
                           "decoded_token": decode(tid)}}
        for t, v in ranked[:shown]:
            item[str(t)] = {"logprob": v, "rank": ranks[t], "decoded_token": decode(t)}
        out.append(item)
    return out


def echo_of_chat(messages: Sequence[Mapping[str, Any]], role: str = "assistant") -> str:
    """What chat's `echo` prepends (vLLM's rule): the last message's content when that
    message has the response's role, else nothing; a list of text parts joined by
    newlines (admission has checked the parts by now)."""
    if not messages or messages[-1].get("role") != role:
        return ""
    content = messages[-1].get("content")
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return content if isinstance(content, str) else ""
