"""The one entry point the engine calls: pick an implementation, run it.

``select_impl`` maps a config value ('auto' or an implementation name) and the platform to
'reference' | 'cpu' | 'pallas_tpu' | 'pallas_gpu' | 'reference_invariant' (the reference with
every token, decodes too, in the prefill pass's tiles: batch-invariant mode's). 'auto' gives the TPU kernel on TPU, the
Mosaic GPU kernel on NVIDIA Hopper GPUs (compute capability 9.x: it needs WGMMA), the
C++ kernel on CPU (built on first use; cpu_build) and the jnp reference everywhere else (older
or non-NVIDIA GPUs, or a CPU host where the C++ kernel cannot be built: 'cpu' then maps to
'reference' too, after one warning). Given the model's ``KernelGeometry`` (page head dim,
page size, KV dtype, GQA), 'auto' also asks the kernel's contract (``kernel_refusal`` in
tpu_plan / gpu_plan) and takes the reference where the kernel cannot run it, with one
warning per distinct reason; a kernel named explicitly is then a ValueError giving the
reason. The engine passes its geometry (serving/build.py), and ``ragged_paged_attention``
reads it off its inputs. ``ragged_paged_attention``
validates at trace time and dispatches; every implementation reads the same page layout
(common.py) and returns [T, Hq, D] in q's dtype. ``write_kv_and_attend`` is the engine's
per-layer entry: ``write_kv`` then the attention, fused into one call where the
implementation has that (cpu).

ptxas guard: jax's own Mosaic GPU flash attention (pallas/ops/gpu/attention_mgpu.py) refuses
causal masking when the CUDA runtime is in [12.8.0, 12.9.1) because ptxas miscompiles it. Our
GPU kernel masks causally on every step's boundary blocks, so 'auto' on such a toolchain
takes the **safe path: the jnp reference attention** (XLA-compiled, no Mosaic GPU masks) and
logs one warning saying so; naming 'pallas_gpu' explicitly still runs the kernel (after the
same warning), so a device check can show whether the miscompilation reaches it.
``ptxas_miscompiles_causal_mask(version)`` is the pure decision on one version string;
``cuda_toolchain_versions()`` reads what this host has (none without a CUDA install).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import os
import re
import shutil
import subprocess
from typing import Any

import jax

from . import gpu_plan, tpu_plan
from .common import AttentionMetadata, KernelGeometry, kernel_geometry, padded_head_dim, write_kv
from .cpu_build import cpu_kernel_target
from .reference import ragged_paged_attention_reference

IMPLEMENTATIONS = ("reference", "cpu", "pallas_tpu", "pallas_gpu", "reference_invariant")
# Each Pallas kernel's contract: why it cannot run a geometry, or None (the plan modules import
# no Pallas, so asking costs no backend import).
_REFUSALS = {"pallas_tpu": tpu_plan.kernel_refusal, "pallas_gpu": gpu_plan.kernel_refusal}
log = logging.getLogger(__name__)

# Bad range of jax's guard, as CUDA releases [12.8.0, 12.9.1); ptxas reports build numbers
# instead of release patches ("V12.9.41" ships with 12.9.0, "V12.9.86" with 12.9.1).
_BAD_RELEASES = ((12, 8, 0), (12, 9, 1))
_BAD_PTXAS_BUILDS = ((12, 8, 0), (12, 9, 86))


def ptxas_miscompiles_causal_mask(version: str) -> bool:
    """Whether a CUDA toolchain version falls in the ptxas causal-mask miscompilation range.

    Accepts what the probes below report: ``ptxas --version`` output or a ptxas / nvJitLink
    build ('V12.8.93': bad through V12.9.41, fixed from V12.9.86), a CUDA release ('12.8',
    '12.9.0': bad; '12.9.1': fixed) or cudaRuntimeGetVersion's integer ('12080', '12090': bad;
    '12091' and up fixed), the same bounds as jax's own check. Raises ValueError otherwise."""
    text = str(version).strip()
    if m := re.search(r"V(\d+)\.(\d+)\.(\d+)", text):
        lo, hi = _BAD_PTXAS_BUILDS
        return lo <= tuple(map(int, m.groups())) < hi
    lo, hi = _BAD_RELEASES
    if re.fullmatch(r"\d{5}", text):
        n = int(text)
        return lo <= (n // 1000, n % 1000 // 10, n % 10) < hi
    if m := re.search(r"(?:release )?(\d+)\.(\d+)(?:\.(\d+))?", text):
        return lo <= (int(m[1]), int(m[2]), int(m[3] or 0)) < hi
    raise ValueError(f"unrecognised CUDA / ptxas version {version!r}")


def _ptxas_binaries() -> list[str]:
    """Where jax looks for ptxas (CUDA_ROOT, the nvidia-cuda-nvcc wheel) and PATH."""
    roots = [os.environ.get("CUDA_ROOT"), "/usr/local/cuda"]
    for mod in ("nvidia.cu13", "nvidia.cuda_nvcc"):
        try:
            roots += list(getattr(importlib.import_module(mod), "__path__", []))
        except ImportError:
            pass
    found = [os.path.join(r, "bin", "ptxas") for r in roots if r]
    return [p for p in (*found, shutil.which("ptxas")) if p and os.access(p, os.X_OK)]


@functools.lru_cache(maxsize=1)
def cuda_toolchain_versions() -> dict[str, str]:
    """Every CUDA component version visible here that could assemble the kernel's PTX (jax's
    Mosaic GPU picks libnvptxcompiler, nvJitLink or a ptxas binary, so all are checked).
    Empty on hosts without CUDA."""
    found: dict[str, str] = {}
    for path in _ptxas_binaries()[:1]:
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True,
                                 timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        if m := re.search(r"V\d+\.\d+\.\d+", out):
            found[f"ptxas ({path})"] = m[0]
    for dist in ("nvidia-nvjitlink-cu12", "nvidia-nvjitlink", "nvidia-cuda-nvcc-cu12"):
        try:
            found[dist] = "V" + importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        from jax._src.lib import cuda_versions   # what jax's own guard reads
        if cuda_versions is not None:
            found["cuda runtime"] = str(cuda_versions.cuda_runtime_get_version())
    except Exception:  # noqa: BLE001 -- private module, or no GPU runtime to ask
        pass
    return found


def ptxas_guard_tripped(versions: dict[str, str]) -> list[str]:
    """The components (name=version) in the bad range; unparseable versions are skipped."""
    bad = []
    for name, version in versions.items():
        try:
            if ptxas_miscompiles_causal_mask(version):
                bad.append(f"{name}={version}")
        except ValueError:
            log.warning("cannot parse %s version %r for the ptxas guard", name, version)
    return bad


@functools.lru_cache(maxsize=1)
def _ptxas_unsafe() -> bool:
    bad = ptxas_guard_tripped(cuda_toolchain_versions())
    if bad:
        log.warning("CUDA toolchain %s is in the ptxas causal-mask miscompilation range "
                    "[12.8.0, 12.9.1) that jax's Mosaic GPU attention refuses; attention "
                    "impl 'auto' uses the jnp reference (safe path), not the Mosaic GPU "
                    "kernel", ", ".join(bad))
    return bool(bad)


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


@functools.lru_cache(maxsize=1)
def _warn_explicit_gpu_kernel() -> None:
    if _ptxas_unsafe():
        log.warning("attention impl 'pallas_gpu' named explicitly: running the Mosaic GPU "
                    "kernel despite the ptxas causal-mask guard")


@functools.lru_cache(maxsize=64)
def _warn_fallback(impl: str, reason: str) -> None:
    """One warning per distinct (kernel, reason), however many layers or steps ask."""
    log.warning("attention impl 'auto': the %s kernel cannot run this geometry (%s); using "
                "the jnp reference attention instead", impl, reason)


def select_impl(name: str = "auto", platform: str | None = None,
                geometry: KernelGeometry | None = None) -> str:
    """'auto' -> kernel for the platform ('tpu', 'gpu'/'cuda', 'cpu', else reference); names
    pass, except 'cpu' where its kernel cannot be built ('reference'). With ``platform=None``
    (this host's backend) a GPU must be Hopper and pass the ptxas guard for 'auto' to pick
    the kernel; a named platform (cross-lowering, jax.export) skips the host's probes.

    With a ``geometry``, the chosen Pallas kernel's contract is asked whether it can run it
    (``tpu_plan`` / ``gpu_plan.kernel_refusal``): where it cannot, 'auto' falls back to the
    jnp reference (one warning per distinct reason) and a kernel named explicitly is a
    ValueError giving the reason."""
    if name == "cpu":
        return "cpu" if cpu_kernel_target() is not None else "reference"
    if name in _REFUSALS and geometry is not None:
        reason = _REFUSALS[name](geometry)
        if reason is not None:
            raise ValueError(f"attention impl {name!r} cannot run this model's attention: "
                             f"{reason}")
    if name == "pallas_gpu" and platform is None:
        _warn_explicit_gpu_kernel()
    if name in IMPLEMENTATIONS:
        return name
    if name != "auto":
        raise ValueError(f"unknown attention impl {name!r}; expected 'auto' or one of "
                         f"{IMPLEMENTATIONS}")
    chosen = _auto_impl(platform)
    if chosen in _REFUSALS and geometry is not None:
        reason = _REFUSALS[chosen](geometry)
        if reason is not None:
            _warn_fallback(chosen, reason)
            return "reference"
    return chosen


def _auto_impl(platform: str | None) -> str:
    """What 'auto' picks on `platform` (None: this host) before asking the kernel's contract."""
    if platform is None:
        platform = jax.default_backend()
        if platform == "gpu" and (not _gpu_kernel_supported() or _ptxas_unsafe()):
            return "reference"
    if platform == "tpu":
        return "pallas_tpu"
    if platform in ("gpu", "cuda"):
        return "pallas_gpu"
    if platform == "cpu" and cpu_kernel_target() is not None:
        return "cpu"
    return "reference"


def page_head_dim(impl: str, head_dim: int) -> int | None:
    """Head dim to allocate `impl`'s KV pages with for a model's `head_dim` (None: as it is).
    Pallas kernels want lane-aligned head dims (GPU: multiples of 64, rows of whole 128-byte
    swizzle tiles, what its tuning was planned for -- the kernel also takes multiples of 16
    (32 for 8-bit pages) at narrower swizzles, which save KV memory at head dims 80 / 96 but
    no device has measured yet; TPU: whole 128-lane vregs, else its wrapper pads every page
    per call); the jnp reference and the C++ CPU kernel take any."""
    if impl not in _REFUSALS:
        return None
    return padded_head_dim(head_dim, 128 if impl == "pallas_tpu" else 64)


def ragged_paged_attention(q: jax.Array, kv_pages: jax.Array, md: AttentionMetadata, *,
                           sm_scale: float, sliding_window: int | None = None,
                           soft_cap: float | None = None, impl: str = "auto",
                           interpret: Any = False, sinks: jax.Array | None = None,
                           **tuning: int) -> jax.Array:
    """Causal ragged paged attention: out [T, Hq, D] for q [T, Hq, D]; ``sinks`` f32[Hq]:
    per-query-head attention-sink logits (gpt-oss), None for none; every implementation
    takes them (common.py).

    Reads kv_pages [num_pages, 2 * Hkv, page_size, D] (after ``write_kv`` stored this step's
    K/V). ``interpret`` runs a Pallas kernel on CPU (True, or the backend's InterpretParams);
    ``tuning`` forwards block-size knobs to the chosen implementation. 'auto' asks the
    platform's kernel about these pages (``select_impl`` with their geometry) and takes the
    reference where it cannot run them; a kernel named explicitly raises its own error.
    """
    chosen = select_impl(impl, geometry=kernel_geometry(q, kv_pages) if impl == "auto" else None)
    kwargs = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                  sinks=sinks, **tuning)
    if chosen in ("reference", "reference_invariant"):
        return ragged_paged_attention_reference(
            q, kv_pages, md, uniform_tiles=chosen == "reference_invariant", **kwargs)
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
                        impl: str = "auto", sinks: jax.Array | None = None
                        ) -> tuple[jax.Array, jax.Array]:
    """(out [T, Hq, D], kv_pages with this step's K/V stored): ``write_kv`` then
    ``ragged_paged_attention``; the CPU kernel does both in one custom call, writing the new
    rows into the (donated) pages in place."""
    if select_impl(impl) == "cpu":
        from .cpu import write_kv_and_attend_cpu
        return write_kv_and_attend_cpu(q, k_new, v_new, kv_pages, md, sm_scale=sm_scale,
                                       sliding_window=sliding_window, soft_cap=soft_cap,
                                       sinks=sinks)
    kv_pages = write_kv(kv_pages, k_new, v_new, md.slot_mapping)
    return ragged_paged_attention(q, kv_pages, md, sm_scale=sm_scale,
                                  sliding_window=sliding_window, soft_cap=soft_cap,
                                  impl=impl, sinks=sinks), kv_pages
