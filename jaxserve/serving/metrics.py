"""Prometheus metrics of a serving engine, under vLLM-compatible names with a `jaxserve:` prefix.

Data flow: `AsyncEngine`'s loop thread calls `EngineMetrics.on_step(stats, outputs, stepped)`
after every iteration with the engine's `stats()` snapshot -> gauges are set from it (running /
waiting / KV usage / compiles after warmup), counters advance by the deltas of its cumulative counts
(preemptions, prefix-cache lookups), per-request figures come from the RequestOutputs
(prompt tokens when a request first reports, generated tokens and inter-token gaps as they
stream, TTFT / queue / e2e / time per output token and the finish reason when a sample
finishes) -> a per-server `CollectorRegistry` (never the process-global one, so several
servers or tests can coexist) -> `MetricsHttpServer` exposes it at `/metrics`, asking each
scrape's `Authorization` header of `authorize` when one is given (401 otherwise).

Prefix-cache queries and hits are counted in tokens (full pages x page size), as vLLM does.

Speculative decoding (`EngineConfig.speculative_config`): as vLLM does, its families exist only
when the engine speculates (`num_speculative_tokens` k given). From the stats' cumulative
spec_decode counts: drafts (verification rows that carried proposals), draft tokens, accepted
tokens, vLLM's accepted-per-position counter (position j: drafts whose first j + 1 proposals
were all accepted), and the acceptance length per draft (accepted + the target's own token,
1..k+1) as a histogram with one bucket per length (vLLM has no such histogram; this one is
`jaxserve:spec_decode_acceptance_length`).

`jaxserve:scheduler_setting{setting=...}`: the scheduler's live limits (max_num_seqs,
max_num_batched_tokens, decode_token_budget), read from the engine at each scrape
(`watch_settings`), since the admin endpoint may change them between steps.

The SLO scheduler's series (`jaxserve:slo_*`: predicted vs measured step time, the budget per
step, attainment per priority level) are `slo_metrics.py`'s; multi-LoRA's (vLLM's
`lora_requests_info` gauge, per-adapter requests and generated tokens) `lora_metrics.py`'s.
"""

from __future__ import annotations

import socket
import threading
from typing import Any, Callable, Iterable, Sequence
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from jaxserve.engine.limits import EngineStats
from jaxserve.engine.outputs import CompletionOutput, RequestOutput
from jaxserve.engine.sequence import FinishReason
from jaxserve.serving.lora_metrics import LazyLoraFamilies, LoraView
from jaxserve.serving.slo_metrics import SloFamilies, SloView

PREFIX = "jaxserve:"
# Bucket edges follow vLLM's, so dashboards built for it read these unchanged.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_LABELS = ("model_name",)
LIVE_LIMITS = ("max_num_seqs", "max_num_batched_tokens", "decode_token_budget")
_COUNTED = -1  # a sample whose finish has been counted


def _token_buckets(max_tokens: int) -> tuple[int, ...]:
    edges = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    return tuple(e for e in edges if e < max_tokens) + (max_tokens,)


class MetricFamilies:
    """Every metric family, registered once in one registry. Labelled by model_name, and
    under data parallelism also by `engine` (the replica index), as vLLM labels its engines."""

    def __init__(self, registry: CollectorRegistry, max_num_batched_tokens: int,
                 per_engine: bool = False, num_speculative_tokens: int | None = None):
        self.registry = r = registry
        self.labels = labels = _LABELS + (("engine",) if per_engine else ())

        def gauge(n: str, doc: str) -> Gauge:
            return Gauge(PREFIX + n, doc, labels, registry=r)

        def counter(n: str, doc: str) -> Counter:
            return Counter(PREFIX + n, doc, labels, registry=r)

        def hist(n: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(PREFIX + n, doc, labels, buckets=buckets, registry=r)

        self.running = gauge("num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV pages held (1 = full).")
        self.compiles = gauge("compiles_after_warmup",
                              "XLA compiles after warmup (should stay 0).")
        self.preemptions = counter("num_preemptions", "Cumulative preemptions.")
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.success = Counter(PREFIX + "request_success", "Finished samples by reason.",
                               (*labels, "finished_reason"), registry=r)
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Gap between consecutive tokens.",
                        ITL_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds",
                         "Per sample: (last token - first token) / (tokens - 1).", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.",
                          LATENCY_BUCKETS)
        self.iteration_tokens = hist("iteration_tokens_total", "Tokens computed per step.",
                                     _token_buckets(max_num_batched_tokens))
        # The live scheduler limits (the admin endpoint may change them), read at scrape time.
        self.scheduler_setting = Gauge(PREFIX + "scheduler_setting",
                               "Live scheduler limit (decode_token_budget 0: none).",
                               (*labels, "setting"), registry=r)
        self.spec: SpecFamilies | None = None if num_speculative_tokens is None else \
            SpecFamilies(r, labels, num_speculative_tokens)
        self.slo = SloFamilies(r, PREFIX, labels, _token_buckets(max_num_batched_tokens))
        self.lora = LazyLoraFamilies(r, PREFIX, labels)  # registered by the first LoRA engine


class SpecFamilies:
    """The speculative-decoding families (registered only when the engine speculates)."""

    def __init__(self, r: CollectorRegistry, labels: tuple[str, ...], k: int):
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_speculative_tokens={k!r} must be a positive integer")
        self.k = k

        def counter(n: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + n, doc, labels + extra, registry=r)

        self.drafts = counter("spec_decode_num_drafts",
                              "Verification rows that carried proposed tokens.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Proposed tokens.")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                       "Proposed tokens the target accepted.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Drafts whose proposals up to this position (0-based) "
                                        "were all accepted.", ("position",))
        self.acceptance_length = Histogram(
            PREFIX + "spec_decode_acceptance_length",
            "Tokens one draft emitted: its accepted proposals + the target's own (1..k+1).",
            labels, buckets=tuple(range(1, k + 2)), registry=r)


class EngineMetrics:
    """The metrics of one engine; feed it with `on_step` from that engine's loop thread."""

    def __init__(self, model_name: str, max_num_batched_tokens: int,
                 registry: CollectorRegistry | None = None,
                 families: MetricFamilies | None = None, engine: int | None = None,
                 num_speculative_tokens: int | None = None):
        """`families`/`engine`: one replica's view of families shared by all replicas.
        `num_speculative_tokens`: the engine's k when it speculates (adds the spec_decode
        families; with `families`, theirs decides)."""
        fam = families or MetricFamilies(registry or CollectorRegistry(), max_num_batched_tokens,
                                         num_speculative_tokens=num_speculative_tokens)
        self.registry = fam.registry
        values = (model_name,) if engine is None else (model_name, str(engine))
        if len(values) != len(fam.labels):
            raise ValueError(f"engine={engine!r} does not fit the families' labels {fam.labels}")
        self._values = values
        self.running = fam.running.labels(*values)
        self.waiting = fam.waiting.labels(*values)
        self.kv_usage = fam.kv_usage.labels(*values)
        self.compiles = fam.compiles.labels(*values)
        self.preemptions = fam.preemptions.labels(*values)
        self.prefix_queries = fam.prefix_queries.labels(*values)
        self.prefix_hits = fam.prefix_hits.labels(*values)
        self.prompt_tokens = fam.prompt_tokens.labels(*values)
        self.generation_tokens = fam.generation_tokens.labels(*values)
        self._success = fam.success
        self._scheduler = fam.scheduler_setting
        self.ttft = fam.ttft.labels(*values)
        self.itl = fam.itl.labels(*values)
        self.tpot = fam.tpot.labels(*values)
        self.e2e = fam.e2e.labels(*values)
        self.queue = fam.queue.labels(*values)
        self.iteration_tokens = fam.iteration_tokens.labels(*values)
        self.spec = None if fam.spec is None else SpecView(fam.spec, values)
        self.slo = SloView(fam.slo, values)
        self.lora = LoraView(fam.lora, values)
        # Loop-thread state: last seen engine totals and per-sample ITL cursors.
        self._last_preemptions = 0
        self._last_queries = 0
        self._last_hits = 0
        self._last_step = 0
        self._itl_seen: dict[tuple[str, int], int] = {}

    @classmethod
    def for_replicas(cls, model_name: str, max_num_batched_tokens: int, num_replicas: int,
                     registry: CollectorRegistry | None = None,
                     num_speculative_tokens: int | None = None) -> list["EngineMetrics"]:
        """One view per data-parallel replica over one registry (label engine="0", ...)."""
        fam = MetricFamilies(registry or CollectorRegistry(), max_num_batched_tokens,
                             per_engine=True, num_speculative_tokens=num_speculative_tokens)
        return [cls(model_name, max_num_batched_tokens, families=fam, engine=i)
                for i in range(num_replicas)]

    def watch_settings(self, read: Callable[[], dict[str, Any]]) -> None:
        """Expose the scheduler's numeric live settings (`read`: `Engine.scheduler_settings`,
        called at each scrape, from the scraping thread: a snapshot read)."""
        for name in LIVE_LIMITS:
            self._scheduler.labels(*self._values, name).set_function(
                lambda name=name: read()[name] or 0)

    def success(self, reason: FinishReason) -> Counter:
        return self._success.labels(*self._values, reason.value)

    # ----------------------------------------------------------------------- feed
    def on_step(self, st: EngineStats, outputs: Sequence[RequestOutput], stepped: bool) -> None:
        self.running.set(st.num_running)
        self.waiting.set(st.num_waiting)
        self.kv_usage.set(st.kv_usage)
        self.compiles.set(st.compiles_after_warmup)
        self.preemptions.inc(st.num_preemptions - self._last_preemptions)
        self._last_preemptions = st.num_preemptions
        self.prefix_queries.inc(st.prefix_cache_queries - self._last_queries)
        self.prefix_hits.inc(st.prefix_cache_hits - self._last_hits)
        self._last_queries, self._last_hits = st.prefix_cache_queries, st.prefix_cache_hits
        new_step = stepped and st.num_steps > self._last_step
        if new_step:
            self.iteration_tokens.observe(st.last_step_tokens)
            self._last_step = st.num_steps
        self.slo.on_step(st.slo, new_step)
        self.lora.on_step(st.lora)
        if self.spec is not None:
            self.spec.on_step(st)
        for out in outputs:
            for c in out.outputs:
                self._on_completion(out, c)
            if out.finished:
                for c in out.outputs:
                    self._itl_seen.pop((out.request_id, c.index), None)

    def _on_completion(self, out: RequestOutput, c: CompletionOutput) -> None:
        key = (out.request_id, c.index)
        seen = self._itl_seen.get(key)
        if seen == _COUNTED:
            return  # a finished sample reappears in its group's later outputs
        if seen is None:
            seen = 0
            if c.index == 0:
                self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(c.delta_token_ids))
        m = c.metrics
        if m is not None:
            for gap in m.inter_token_latencies[seen:]:
                self.itl.observe(gap)
            seen = len(m.inter_token_latencies)
        if c.finish_reason is None:
            self._itl_seen[key] = seen
            return
        self._itl_seen[key] = _COUNTED
        self.success(c.finish_reason).inc()
        if m is None:
            return
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.queue_time is not None:
            self.queue.observe(m.queue_time)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        if m.first_token_time is not None and m.last_token_time is not None and \
                c.num_tokens > 1:
            self.tpot.observe((m.last_token_time - m.first_token_time) / (c.num_tokens - 1))


class SpecView:
    """One engine's series of the spec_decode families, advanced by the deltas of the
    engine's cumulative counts (`EngineStats.spec_*`)."""

    def __init__(self, fam: SpecFamilies, values: tuple[str, ...]):
        self.drafts = fam.drafts.labels(*values)
        self.draft_tokens = fam.draft_tokens.labels(*values)
        self.accepted_tokens = fam.accepted_tokens.labels(*values)
        self.accepted_per_pos = [fam.accepted_per_pos.labels(*values, str(j))
                                 for j in range(fam.k)]
        self.acceptance_length = fam.acceptance_length.labels(*values)
        self._last = (0, 0, 0)
        self._last_counts: tuple[int, ...] = ()

    def on_step(self, st: EngineStats) -> None:
        now = (st.spec_num_drafts, st.spec_num_draft_tokens, st.spec_num_accepted_tokens)
        for series, new, old in zip((self.drafts, self.draft_tokens, self.accepted_tokens),
                                    now, self._last):
            series.inc(new - old)
        self._last = now
        counts = st.spec_acceptance_counts
        if counts == self._last_counts:
            return
        old = self._last_counts + (0,) * (len(counts) - len(self._last_counts))
        # counts[i]: drafts that emitted i + 1 tokens. Each such draft is one observation of
        # length i + 1 (at most one per running sequence per step, so the loop is short), and
        # accepted its first i proposals: one for each position below i.
        for i, (new_n, old_n) in enumerate(zip(counts, old)):
            delta = new_n - old_n
            for _ in range(delta):
                self.acceptance_length.observe(i + 1)
            for j in range(min(i, len(self.accepted_per_pos))):
                self.accepted_per_pos[j].inc(delta)
        self._last_counts = tuple(counts)


Authorize = Callable[[str | None], bool]  # an Authorization header value -> allowed?
_DENIED = b"missing or invalid API key: send the header 'Authorization: Bearer <key>'\n"


def _guarded(app: Callable[..., Iterable[bytes]], authorize: Authorize
             ) -> Callable[..., Iterable[bytes]]:
    """The WSGI `app` behind `authorize` (401 with a text body when it says no)."""
    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if authorize(environ.get("HTTP_AUTHORIZATION")):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                            ("WWW-Authenticate", "Bearer")])
        return [_DENIED]
    return guarded


class _Handler(WSGIRequestHandler):
    """Quiet (no access log); `timeout` bounds each socket read and write, so a stalled
    scraper releases its thread."""

    timeout = 20.0

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base signature
        pass


class MetricsHttpServer:
    """`/metrics` over HTTP for one registry, in a daemon thread; `close()` stops it.
    `authorize`: None serves anyone; else each request's Authorization header must pass it."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int,
                 authorize: Authorize | None = None):
        app = make_wsgi_app(registry)
        if authorize is not None:
            app = _guarded(app, authorize)
        family, _, _, _, sockaddr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        server_class = type("MetricsWSGIServer", (ThreadingWSGIServer,),
                            {"address_family": family})
        self._httpd = make_server(sockaddr[0], port, app, server_class, handler_class=_Handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        name="jaxserve-metrics", daemon=True)
        self._thread.start()
        self.port: int = self._httpd.server_address[1]
        self._closed = threading.Event()

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join(5.0)
