"""The chunked-prefill scenario: streaming chats while a few very long prompts arrive.

Why: a step's time grows with the tokens in it. If a 4,000-token prompt is prefilled in one
step, every running chat waits that whole step for its next token (an ITL spike), and users
see the stall. Chunked prefill caps a step's tokens at `max_num_batched_tokens`: the long
prompt is spread over several steps that each also carry the chats' decodes, so chat ITL stays
near one small step, at the cost of a longer TTFT for the long prompt.

Data flow, once per budget (small: chunked; large >= the long prompt: whole prompt in one
step): an in-process jaxserve server with that budget (`launch.local_server`, same model and
everything else) -> a closed loop of `chat_concurrency` short streaming chats runs the whole
time -> after `lead_s`, `num_long` long prompts arrive every `long_interval_s` -> when the last
long prompt finished and `tail_s` more passed, the chats stop -> per-kind summaries. The result
document has one point per budget; `table` shows chat ITL and long-prompt TTFT side by side.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from jaxserve.cli.bench.launch import local_server
from jaxserve.cli.bench.load import LoadResult, LoadSpec, run_closed, run_scheduled
from jaxserve.cli.bench.report import RequestRecord, Slo
from jaxserve.cli.bench.sweep import machine_facts, point_doc
from jaxserve.cli.bench.targets import GrpcTarget
from jaxserve.cli.bench.workload import chunked_prefill_requests
from jaxserve.config import EngineConfig
from jaxserve.models.loading import LoadedModel
from jaxserve.serving.served import model_name


@dataclasses.dataclass(frozen=True)
class ChunkedPrefillSpec:
    long_len: int = 4096  # prompt tokens of each long request
    num_long: int = 3
    long_out: int = 16
    lead_s: float = 5.0  # chats run alone this long before the first long prompt
    long_interval_s: float = 8.0
    tail_s: float = 3.0  # chats keep running this long after the last long prompt ended
    chat_concurrency: int = 4
    chat_out: int = 64
    small_budget: int = 256
    large_budget: int | None = None  # None: the next power of two >= long_len
    max_duration_s: float = 900.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.long_len < 2 or self.num_long < 1 or self.chat_concurrency < 1:
            raise ValueError("long_len >= 2, num_long >= 1 and chat_concurrency >= 1 needed")
        if self.large_budget is not None and self.large_budget < self.long_len:
            raise ValueError(f"large_budget={self.large_budget} must be >= long_len="
                             f"{self.long_len} (the whole prompt in one step)")
        if self.small_budget >= self.long_len:
            raise ValueError(f"small_budget={self.small_budget} must be < long_len="
                             f"{self.long_len} to chunk the long prompts")

    @property
    def budgets(self) -> tuple[int, int]:
        large = self.large_budget or 1 << (self.long_len - 1).bit_length()
        return self.small_budget, large


async def _run_one(address: str, spec: ChunkedPrefillSpec, vocab: int,
                   progress: bool) -> LoadResult:
    target = GrpcTarget(address)
    await target.open()
    try:
        chats, longs = chunked_prefill_requests(10_000, spec.num_long, spec.long_len, vocab,
                                                spec.seed, chat_out=spec.chat_out,
                                                long_out=spec.long_out)
        # Warm the connection and the decode path; not measured.
        await run_closed(target, chats[:2], 2, [], None)
        records: list[RequestRecord] = []
        stop = asyncio.Event()
        t0 = time.perf_counter()
        offsets = [spec.lead_s + i * spec.long_interval_s for i in range(spec.num_long)]

        async def longs_then_stop() -> None:
            await run_scheduled(target, longs, offsets, records)
            await asyncio.sleep(spec.tail_s)
            stop.set()

        job = asyncio.gather(
            run_closed(target, chats[2:], spec.chat_concurrency, records, None, stop),
            longs_then_stop())
        try:
            await asyncio.wait_for(job, spec.max_duration_s)
        except asyncio.TimeoutError:
            pass
        return LoadResult(LoadSpec(concurrency=spec.chat_concurrency), records,
                          time.perf_counter() - t0)
    finally:
        await target.close()


async def run_chunked_prefill(base: EngineConfig, model: LoadedModel,
                              spec: ChunkedPrefillSpec, progress: bool = True) -> dict:
    """Run the scenario at both budgets; returns the result document."""
    points = []
    # Room for the long prompts and for the chats (at most 256 prompt tokens).
    max_len = max(spec.long_len + spec.long_out, 256 + spec.chat_out) + 16
    for budget, label in zip(spec.budgets, ("chunked", "whole prompt")):
        # One budget for every step (no separate decode budget): the budget is the point.
        cfg = dataclasses.replace(base, max_num_batched_tokens=budget, decode_token_budget=None,
                                  max_model_len=max(base.max_model_len or 0, max_len))
        if progress:
            print(f"[chunked-prefill] budget={budget} ({label}): warming up ...", flush=True)
        async with local_server(cfg, model, progress) as address:
            result = await _run_one(address, spec, model.config.vocab_size, progress)
        points.append(point_doc(result, Slo(), f"budget={budget} ({label})"))
        if progress:
            print(table([points[-1]]).splitlines()[1], flush=True)
    return {"name": "chunked-prefill", "target": "in-process jaxserve", "model":
            model_name(base, model),
            "workload": f"{spec.chat_concurrency} streaming chats (32-256 in, {spec.chat_out} "
                        f"out) + {spec.num_long} prompts of {spec.long_len} tokens",
            "spec": dataclasses.asdict(spec), "points": points, "machine": machine_facts()}


def _kind(point: dict, kind: str) -> dict:
    return point["by_kind"].get(kind) or {"ttft_ms": {}, "itl_ms": {}, "completed": 0}


def table(points: list[dict]) -> str:
    head = ("budget", "chats done", "chat ITL p50", "chat ITL p99", "chat ITL max",
            "chat TTFT p99", "long TTFT p50", "long TTFT max", "out tok/s")
    rows = []
    for p in points:
        chat, long_ = _kind(p, "chat"), _kind(p, "long")

        def f(d: dict, k: str) -> str:
            v = d.get(k)
            return "-" if v is None else f"{v:.0f}"

        rows.append((p["label"], str(chat["completed"]), f(chat["itl_ms"], "p50"),
                     f(chat["itl_ms"], "p99"), f(chat["itl_ms"], "max"),
                     f(chat["ttft_ms"], "p99"), f(long_["ttft_ms"], "p50"),
                     f(long_["ttft_ms"], "max"),
                     f"{p['summary']['output_throughput']:.1f}"))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines) + "\n(latencies in ms)"
