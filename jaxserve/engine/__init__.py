"""jaxserve.engine: the host side of the engine, plain Python and numpy (no jax).

Data flow of one step (`engine.Engine.step`, whose stages are `step_core.StepCore`'s, wrapped
by `pipeline.Pipeline` when steps overlap): `scheduler.Scheduler.schedule` (which requests
run, how many tokens each, pages from `block_allocator`, shared through `prefix_cache` and
`forks`) -> `batch.build_batch` (flat ragged numpy arrays padded to a compiled bucket) -> a
`runner.Runner` (the device one lives in `jaxserve.device`; `fake_runner.ArithmeticRunner`
here for tests) -> `Scheduler.update` (tokens appended, stop rules, pages freed) ->
`detokenizer` -> `outputs.RequestOutput`; `recovery` decides what a failing step costs (the
culprit requests, or the engine). `sampling_params` is the one registry of per-request
sampling fields; `sizing` derives pages and buckets from the config; `limits` holds the
engine's read-only limits, the request checks against them (each written once) and the
`stats()` snapshot type.
"""
