"""Running the two Pallas attention kernels from a test: interpreted on CPU with race
detection (each backend's interpreter), or compiled, with small tuning blocks so that even
short sequences cross several KV blocks and ring slots."""

from __future__ import annotations

import jax

# Small blocks so even these short sequences cross several KV blocks and ring slots.
TUNING = {"pallas_tpu": dict(pages_per_block=2, tile_tokens=4),
          "pallas_gpu": dict(num_stages=2)}


def interpret_params(impl: str):  # noqa: ANN201 - the backend's InterpretParams
    """`interpret=` for `impl` ("pallas_tpu" / "pallas_gpu"): its interpreter, races
    detected."""
    if impl == "pallas_tpu":
        from jax.experimental.pallas import tpu as pltpu
        return pltpu.InterpretParams(detect_races=True)
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams(detect_races=True)


def races_found(impl: str) -> bool:
    """The interpreters' race flags (private API: treated as 'no races' if it moved)."""
    try:
        if impl == "pallas_tpu":
            from jax._src.pallas.mosaic.interpret import interpret_pallas_call as m
            return bool(m.races is not None and m.races.races_found)
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as m
        return bool(m.get_races().races_found)
    except (ImportError, AttributeError, AssertionError):
        return False


def run_kernel(impl: str, *args, tuned: bool = True, **kwargs) -> jax.Array:
    """`impl`'s ragged paged attention on `args` / `kwargs`, with TUNING's blocks unless
    `tuned` is False (the kernel's own defaults)."""
    if impl == "pallas_tpu":
        from jaxserve.kernels_pallas.tpu import ragged_paged_attention_tpu as fn
    else:
        from jaxserve.kernels_pallas.gpu import ragged_paged_attention_gpu as fn
    return fn(*args, **kwargs, **(TUNING[impl] if tuned else {}))
