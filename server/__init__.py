"""jaxserve.server: the network fronts (transport only: wire formats, no request logic).

Data flow of one gRPC call:
  client -> grpc.aio server (`app.GrpcServer`: API-key interceptor `auth`, health, reflection,
  bounded messages, TLS) -> `servicer.GenerationServicer` -> `proto_map.parse_request` (proto ->
  SamplingParams and prompt; a chat's tools through `jaxserve.serving.chat`) ->
  `jaxserve.serving.admission` (tokenization on worker threads, every prompt check) ->
  `jaxserve.serving.async_engine.AsyncEngine` (one thread drives the Engine; outputs come
  back through an asyncio queue per request) ->
  `proto_map.ResponseBuilder` -> streamed GenerateResponses. The OpenAI-compatible HTTP front
  (`openai_http`) takes the same path through admission. Metrics: `jaxserve.serving.metrics`.

Modules: `stubs` (generated protobuf/gRPC code, built from `proto/jaxserve.proto` on first
import), `config` (ServerConfig), `app` (lifecycle, signals), `background` (a server in a
thread, for tests and benchmarks), `inflight` (calls in flight, draining), `client` (the Python
client). The `jaxserve serve` / `jaxserve client` commands live in `jaxserve.cli.serve`.
Importing this package alone loads neither grpc nor jax.
"""
