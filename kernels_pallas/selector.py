"""The one entry point the engine calls: pick an implementation, run it.

``select_impl`` maps a config value ('auto' or an implementation name) and the platform to
'reference' | 'cpu' | 'pallas_tpu' | 'pallas_gpu'. 'auto' gives the TPU kernel on TPU, the
Mosaic GPU kernel on NVIDIA Hopper GPUs (compute capability 9.x: it needs WGMMA), the
C++ kernel on CPU (built on first use; cpu_build) and the jnp reference everywhere else (older
or non-NVIDIA GPUs, or a CPU host where the C++ kernel cannot be built: 'cpu' then maps to
'reference' too, after one warning). ``ragged_paged_attention``
validates at trace time and dispatches; every implementation reads the same page layout
(common.py) and returns [T, Hq, D] in q's dtype. ``write_kv_and_attend`` is the engine's
per-layer entry: ``write_kv`` then the attention, fused into one call where the
implementation has that (cpu).
"""

from __future__ import annotations

from typing import Any

import jax

from .common import AttentionMetadata, write_kv
from .cpu_build import cpu_kernel_target
from .reference import ragged_paged_attention_reference

IMPLEMENTATIONS = ("reference", "cpu", "pallas_tpu", "pallas_gpu")


def gpu_kernel_supported(compute_capability: str) -> bool:
    """The Mosaic GPU kernel is built on WGMMA, which only Hopper (sm_90, compute capability
    9.x) has: Blackwell (10.x data-centre, 12.x consumer) replaced it with tcgen05 / other
    MMA paths, and older GPUs have neither WGMMA nor TMA. Those get the jnp reference."""
    try:
        return int(float(compute_capability)) == 9
    except ValueError:
        return False


def _gpu_kernel_supported() -> bool:
    """Whether this machine's first GPU runs the Mosaic GPU kernel (ROCm devices: no)."""
    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError:
        return False
    if "rocm" in str(getattr(dev.client, "platform_version", "")).lower():
        return False
    return gpu_kernel_supported(str(getattr(dev, "compute_capability", "0")))


def select_impl(name: str = "auto", platform: str | None = None) -> str:
    """'auto' -> kernel for the platform ('tpu', 'gpu'/'cuda', 'cpu', else reference); names
    pass, except 'cpu' where its kernel cannot be built ('reference')."""
    if name == "cpu":
        return "cpu" if cpu_kernel_target() is not None else "reference"
    if name in IMPLEMENTATIONS:
        return name
    if name != "auto":
        raise ValueError(f"unknown attention impl {name!r}; expected 'auto' or one of "
                         f"{IMPLEMENTATIONS}")
    if platform is None:
        platform = jax.default_backend()
        if platform == "gpu" and not _gpu_kernel_supported():
            return "reference"
    if platform == "tpu":
        return "pallas_tpu"
    if platform in ("gpu", "cuda"):
        return "pallas_gpu"
    if platform == "cpu" and cpu_kernel_target() is not None:
        return "cpu"
    return "reference"


def ragged_paged_attention(q: jax.Array, kv_pages: jax.Array, md: AttentionMetadata, *,
                           sm_scale: float, sliding_window: int | None = None,
                           soft_cap: float | None = None, impl: str = "auto",
                           interpret: Any = False, **tuning: int) -> jax.Array:
    """Causal ragged paged attention: out [T, Hq, D] for q [T, Hq, D].

    Reads kv_pages [num_pages, 2 * Hkv, page_size, D] (after ``write_kv`` stored this step's
    K/V). ``interpret`` runs a Pallas kernel on CPU (True, or the backend's InterpretParams);
    ``tuning`` forwards block-size knobs to the chosen implementation.
    """
    chosen = select_impl(impl)
    kwargs = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, **tuning)
    if chosen == "reference":
        return ragged_paged_attention_reference(q, kv_pages, md, **kwargs)
    if chosen == "cpu":
        from .cpu import ragged_paged_attention_cpu
        return ragged_paged_attention_cpu(q, kv_pages, md, **kwargs)
    # Kernel modules load on first use: a host only imports the Pallas backend it runs.
    if chosen == "pallas_tpu":
        from .tpu import ragged_paged_attention_tpu
        return ragged_paged_attention_tpu(q, kv_pages, md, interpret=interpret, **kwargs)
    from .gpu import ragged_paged_attention_gpu
    return ragged_paged_attention_gpu(q, kv_pages, md, interpret=interpret, **kwargs)


def write_kv_and_attend(q: jax.Array, k_new: jax.Array, v_new: jax.Array, kv_pages: jax.Array,
                        md: AttentionMetadata, *, sm_scale: float,
                        sliding_window: int | None = None, soft_cap: float | None = None,
                        impl: str = "auto") -> tuple[jax.Array, jax.Array]:
    """(out [T, Hq, D], kv_pages with this step's K/V stored): ``write_kv`` then
    ``ragged_paged_attention``; the CPU kernel does both in one custom call, writing the new
    rows into the (donated) pages in place."""
    if select_impl(impl) == "cpu":
        from .cpu import write_kv_and_attend_cpu
        return write_kv_and_attend_cpu(q, k_new, v_new, kv_pages, md, sm_scale=sm_scale,
                                       sliding_window=sliding_window, soft_cap=soft_cap)
    kv_pages = write_kv(kv_pages, k_new, v_new, md.slot_mapping)
    return ragged_paged_attention(q, kv_pages, md, sm_scale=sm_scale,
                                  sliding_window=sliding_window, soft_cap=soft_cap,
                                  impl=impl), kv_pages
