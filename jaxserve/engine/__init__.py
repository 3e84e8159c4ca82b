"""jaxserve.engine: the host side of the engine, plain Python and numpy (no jax).

Data flow of one step (`engine.Engine.step`, whose stages are `step_core.StepCore`'s, wrapped
by `pipeline.Pipeline` when steps overlap): `scheduler.Scheduler.schedule` (which requests
run, how many tokens each, pages from `block_allocator`, shared through `prefix_cache` and
`forks`) -> `batch.build_batch` (ragged numpy arrays padded to a compiled bucket, one part
per feature: `batch_parts`, `batch_mask`) -> a `runner.Runner` (the device one lives in
`jaxserve.device`; `fake_runner.ArithmeticRunner` here for tests) -> `Scheduler.update`
(tokens appended, stop rules, pages freed) -> `detokenizer` -> `outputs.RequestOutput`;
`recovery` decides what a failing step costs (the
culprit requests, or the engine). `sampling_params` is the one registry of per-request
sampling fields; `sizing` derives pages and buckets from the config; `limits` holds the
engine's read-only limits, the request checks against them (each written once) and the
`stats()` snapshot type. Multi-LoRA: `lora_request.LoRARequest` names a request's adapter,
`lora_registry` holds the registered adapters and the host cache of loaded ones,
`lora_slots` the device slots the scheduler fills (loads ride on the step:
`Runner.load_lora`), `lora_stats` the per-adapter figures.
"""
