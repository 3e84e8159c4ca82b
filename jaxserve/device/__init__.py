"""jaxserve.device: everything that touches jax arrays.

`model_runner.ModelRunner` owns the params and KV pages and runs one compiled step per bucket
(`sampler` inside it); `compile_guard` counts compiles after warmup; `multihost` mirrors
process 0's steps on the other processes of a `jax.distributed` job.
"""
