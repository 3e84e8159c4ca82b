"""jaxserve.serving: engines made ready for callers.

`build` turns a frozen EngineConfig into running engines (one per data-parallel replica);
`admission` turns a prompt into token ids and runs every request check, once, for every
front; `async_engine.AsyncEngine` drives one Engine from its own thread for asyncio callers
(each request's outputs through a bounded `request_stream.RequestSink`);
`async_replica_pool` routes over several of those (`router`), `replica_pool` over several
synchronous Engines (offline API, batch jobs); `metrics` exports Prometheus figures.
"""
