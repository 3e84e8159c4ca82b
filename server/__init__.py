"""jaxserve.server: the gRPC front end.

Data flow of one call:
  client -> grpc.aio server (`app.GrpcServer`: API-key interceptor `auth`, health, reflection,
  bounded messages, TLS) -> `servicer.GenerationServicer` -> `convert` (proto -> SamplingParams
  and prompt, every check; tokenization on worker threads) -> `jaxserve.async_engine.AsyncEngine`
  (one thread drives the Engine; outputs come back through an asyncio queue per request) ->
  `convert.ResponseBuilder` -> streamed GenerateResponses. Metrics: `jaxserve.metrics`.

Modules: `stubs` (generated protobuf/gRPC code, built from `proto/jaxserve.proto` on first
import), `config` (ServerConfig), `app` (lifecycle, signals), `background` (a server in a
thread, for tests and benchmarks), `cli` (`jaxserve serve` / `jaxserve client`). Importing this
package alone loads neither grpc nor jax.
"""
