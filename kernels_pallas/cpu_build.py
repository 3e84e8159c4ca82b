"""Build, load and register the C++ CPU kernels (csrc/*.cc: the paged attention and the dense
projections over packed weights) on first use, as one library.

Flow: the sources (csrc/*.cc, *.h), jaxlib's version, the compiler command, the flags and this
CPU's feature flags hash to a key -> ``<cache>/jaxserve_cpu_kernels-<key>.so`` (cache:
$JAXSERVE_KERNEL_CACHE_DIR, default ~/.cache/jaxserve/kernels). A missing library is compiled
into a temporary file in the cache dir and renamed onto its name (atomic: processes building at
once each rename identical bytes). ctypes loads it and ``jax.ffi.register_ffi_target`` registers
its handlers (attention; write_kv + attention; both again for quantized pages; dense, float
and quantized) for the CPU platform, once per process (lru_cache). Where anything fails -- no
compiler, a compile error, a load error -- ``cpu_kernel_target`` logs one warning saying why
and returns None, and callers use the jnp reference (``dense_kernel_target`` likewise).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shlex
import shutil
import subprocess
import tempfile

import jax
import jaxlib

log = logging.getLogger(__name__)

TARGET = "jaxserve_ragged_paged_attention_cpu"
WRITE_TARGET = "jaxserve_write_kv_and_attend_cpu"  # the same plus write_kv, pages in place
# The same two for int8 / float8_e4m3fn pages, with their f32 row scales beside them.
QUANT_TARGET = "jaxserve_ragged_paged_attention_quant_cpu"
WRITE_QUANT_TARGET = "jaxserve_write_kv_and_attend_quant_cpu"
DENSE_TARGET = "jaxserve_dense_cpu"  # x @ panel-packed weights (csrc/dense_cpu.cc)
# x @ quantized panel-packed weights, by scheme (csrc/dense_quant_cpu.cc)
DENSE_QUANT_TARGETS = {"int8": "jaxserve_dense_int8_cpu", "fp8": "jaxserve_dense_fp8_cpu",
                       "int4": "jaxserve_dense_int4_cpu"}
CSRC = pathlib.Path(__file__).parent / "csrc"
SOURCES = tuple(CSRC / name for name in ("paged_attention_cpu.cc", "dense_cpu.cc",
                                         "dense_quant_cpu.cc"))
CACHE_ENV = "JAXSERVE_KERNEL_CACHE_DIR"
# Built on the machine that runs it, so -march=native is safe (the key holds the CPU flags).
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-w")
_COMPILERS = ("g++", "c++", "clang++")


class BuildError(RuntimeError):
    """The kernel library could not be built or loaded; the message says why."""


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get(CACHE_ENV) or
                        pathlib.Path.home() / ".cache" / "jaxserve" / "kernels")


def find_compiler() -> list[str]:
    """$CXX (a command line) if set, else the first of g++ / c++ / clang++ on PATH."""
    cxx = os.environ.get("CXX")
    cmd = shlex.split(cxx) if cxx else None
    if cmd:
        if shutil.which(cmd[0]) is None:
            raise BuildError(f"no C++ compiler: CXX={cxx!r} is not on PATH")
        return cmd
    for name in _COMPILERS:
        if shutil.which(name):
            return [name]
    raise BuildError(f"no C++ compiler found (tried $CXX, {', '.join(_COMPILERS)})")


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), so a cache shared between machines never hands one a
    library built for instructions it lacks."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def library_path(compiler: list[str]) -> pathlib.Path:
    key = hashlib.sha256()
    sources = b"".join(p.name.encode() + p.read_bytes() for p in sorted(CSRC.iterdir())
                       if p.suffix in (".cc", ".h"))
    for part in (sources, jaxlib.__version__.encode(), " ".join(compiler).encode(),
                 " ".join(FLAGS).encode(), _cpu_flags().encode(), platform.machine().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / f"jaxserve_cpu_kernels-{key.hexdigest()[:20]}.so"


def build_library() -> pathlib.Path:
    """Path of the compiled library, compiling it if the cache lacks it."""
    missing = [str(p) for p in SOURCES if not p.exists()]
    if missing:
        raise BuildError(f"kernel sources {missing} are missing from the installation")
    compiler = find_compiler()
    path = library_path(compiler)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.stem + "-", suffix=".tmp", dir=path.parent)
    os.close(fd)
    cmd = [*compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", "-o", tmp, *map(str, SOURCES)]
    log.info("building the CPU kernels: %s", " ".join(cmd))
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            raise BuildError(f"{compiler[0]} failed (exit {res.returncode}): "
                             f"{res.stderr.strip()[-800:]}")
        os.replace(tmp, path)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{compiler[0]} could not run: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@functools.lru_cache(maxsize=None)
def _register(path: str) -> None:
    """Load the library and register its handler (once per process and library)."""
    try:
        lib = ctypes.cdll.LoadLibrary(path)
        handlers = {TARGET: jax.ffi.pycapsule(lib.JaxservePagedAttentionCpu),
                    WRITE_TARGET: jax.ffi.pycapsule(lib.JaxservePagedAttentionWriteCpu),
                    QUANT_TARGET: jax.ffi.pycapsule(lib.JaxservePagedAttentionQuantCpu),
                    WRITE_QUANT_TARGET: jax.ffi.pycapsule(
                        lib.JaxservePagedAttentionWriteQuantCpu),
                    DENSE_TARGET: jax.ffi.pycapsule(lib.JaxserveDenseCpu),
                    DENSE_QUANT_TARGETS["int8"]: jax.ffi.pycapsule(lib.JaxserveDenseInt8Cpu),
                    DENSE_QUANT_TARGETS["fp8"]: jax.ffi.pycapsule(lib.JaxserveDenseFp8Cpu),
                    DENSE_QUANT_TARGETS["int4"]: jax.ffi.pycapsule(lib.JaxserveDenseInt4Cpu)}
    except (OSError, AttributeError) as e:
        raise BuildError(f"could not load {path}: {e}") from e
    for name, handler in handlers.items():
        jax.ffi.register_ffi_target(name, handler, platform="cpu")


@functools.lru_cache(maxsize=None)
def cpu_kernel_target() -> str | None:
    """The registered FFI target name (WRITE_TARGET is registered with it), or None (after one
    warning) where the build fails."""
    try:
        _register(str(build_library()))
    except BuildError as e:
        log.warning("CPU paged attention kernel unavailable, using the jnp reference "
                    "attention instead: %s", e)
        return None
    return TARGET


def dense_kernel_target() -> str | None:
    """The dense projection's FFI target name, or None (after cpu_kernel_target's one warning)
    where the library could not be built."""
    return DENSE_TARGET if cpu_kernel_target() is not None else None
