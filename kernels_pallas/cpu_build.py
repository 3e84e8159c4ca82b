"""Build, load and register the C++ CPU kernels (csrc/*.cc: the paged attention, the dense
projections over packed weights, the sampler's top-k / top-p cut-offs) on first use: one
library for the attention (with the CPU feature probe and the cut-offs), and the dense kernels
once per instruction set (ISA) this CPU can run.

ISA dispatch: on x86-64 the dense sources are compiled twice, with AVX-512 (F/BW/DQ/VL, 12 x 32
register tile) and with AVX2 + FMA (6 x 16), each into its own library (its own copy of every
inline function, so the linker can never hand the AVX2 path an AVX-512 instance). At load,
``JaxserveCpuSupports`` (cpu_features.cc, ``__builtin_cpu_supports``) says which this CPU runs;
each runnable one is registered as ``<target>_<isa>`` and the best as the plain target name.
``dense_isas()`` lists the runnable ones best first; the wrappers take an ``isa`` argument
that forces one (tests and figures run both paths on an AVX-512 host). The attention library
is built once with -march=native (its tall tiles pick AVX-512 or AVX2 at compile time,
csrc/tile_simd.h); ``attention_target(target, isa)`` builds and registers the attention alone
with an ISA's flags on request, as ``<target>_<isa>``, so the same tests run both there too. Elsewhere (not x86-64)
one "native" variant is built with -march=native.

Flow: the sources (csrc/*.cc, *.h), jaxlib's version, the compiler command, the flags and this
CPU's feature flags hash to a key -> ``<cache>/jaxserve_cpu_kernels-<key>.so`` (cache:
$JAXSERVE_KERNEL_CACHE_DIR, default ~/.cache/jaxserve/kernels). A missing library is compiled
into a temporary file in the cache dir and renamed onto its name (atomic: processes building at
once each rename identical bytes). ctypes loads it and ``jax.ffi.register_ffi_target`` registers
its handlers (attention; write_kv + attention; both again for quantized pages; the cut-offs;
dense, float and quantized; the MoE grouped expert MLP; the multi-LoRA delta) for the CPU
platform, once per process (lru_cache). Where anything fails -- no
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
# x @ int8 / int4 weights as integer dots, activations quantized per row (csrc/dense_qdot_cpu.cc)
DENSE_QDOT_TARGETS = {"int8": "jaxserve_dense_qdot_int8_cpu",
                      "int4": "jaxserve_dense_qdot_int4_cpu"}
QUANTIZE_ROWS_TARGET = "jaxserve_quantize_rows_cpu"  # its activation quantization alone
# The MoE block's grouped expert MLP over packed expert panels, by weight dtype
# (csrc/moe_grouped_cpu.cc), built into the dense libraries (one per ISA).
MOE_GROUPED_TARGETS = {"float32": "jaxserve_moe_grouped_f32_cpu",
                       "bfloat16": "jaxserve_moe_grouped_bf16_cpu"}
# The multi-LoRA delta over whole adapter stacks, by stack dtype (csrc/lora_cpu.cc), built into
# the dense libraries (one per ISA).
LORA_TARGETS = {"float32": "jaxserve_lora_delta_f32_cpu",
                "bfloat16": "jaxserve_lora_delta_bf16_cpu"}
CSRC = pathlib.Path(__file__).parent / "csrc"
# The sampler's top-k / top-p cut-offs (csrc/nucleus_cpu.cc), built into the attention library.
NUCLEUS_TARGET = "jaxserve_nucleus_cutoffs_cpu"
SOURCES = tuple(CSRC / name for name in ("paged_attention_cpu.cc", "cpu_features.cc",
                                         "nucleus_cpu.cc"))
# The attention alone, built per ISA on request (attention_target): tests and figures run the
# AVX2 tiles on an AVX-512 host; the engine runs the -march=native build.
ATTENTION_SOURCES = (CSRC / "paged_attention_cpu.cc",)
DENSE_SOURCES = tuple(CSRC / name for name in ("dense_cpu.cc", "dense_quant_cpu.cc",
                                               "dense_qdot_cpu.cc", "moe_grouped_cpu.cc",
                                               "lora_cpu.cc"))
CACHE_ENV = "JAXSERVE_KERNEL_CACHE_DIR"
# Built on the machine that runs it, so -march=native is safe (the key holds the CPU flags).
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-w")
# The dense kernels' variants, best first: name -> flags added to FLAGS. -march=native tunes
# for this CPU; the -m flags then fix the instruction set whatever this CPU has (AVX2's turns
# every AVX-512 extension off, since -mno-avx512f disables those built on it). -Bsymbolic:
# the library's calls bind to its own functions.
# avx512_vnni differs from avx512 only in the integer dots of csrc/dense_qdot_cpu.cc
# (vpdpbusd) and in the LoRA kernel's bfloat16 dots (csrc/lora_bf16_dot.h: compiled for
# AVX512_BF16 by function attribute, run only where cpuid has it); avx512 turns VNNI off, so
# an AVX-512 host without it (Skylake-X) runs that build and a VNNI host can run both paths.
_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx2", "-mfma", "-mf16c")
_X86_ISAS = (("avx512_vnni", (*_AVX512, "-mavx512vnni")),
             ("avx512", (*_AVX512, "-mno-avx512vnni")),
             ("avx2", ("-mno-avx512f", "-mavx2", "-mfma", "-mf16c")))
_NATIVE_ISAS = (("native", ()),)
DENSE_LINK = ("-Wl,-Bsymbolic",)
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


def cpu_has_avx512_bf16() -> bool:
    """Whether this CPU has AVX512_BF16's dot products (Linux's flags), which the avx512_vnni
    build's LoRA kernel uses for bfloat16 stacks where the CPU has them (csrc/lora_bf16_dot.h
    checks with cpuid itself): the tests' tolerance follows."""
    return "avx512_bf16" in _cpu_flags().split()


def dense_variants() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(isa name, its extra flags) for the dense kernels on this machine, best first."""
    return _X86_ISAS if platform.machine().lower() in ("x86_64", "amd64") else _NATIVE_ISAS


def attention_variants() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The dense_variants() whose attention builds differ: its tiles are AVX-512 or AVX2
    (csrc/tile_simd.h), and avx512_vnni adds only the dense and LoRA kernels' dots."""
    return tuple(v for v in dense_variants() if v[0] != "avx512_vnni")


def library_path(compiler: list[str], name: str = "jaxserve_cpu_kernels",
                 flags: tuple[str, ...] = FLAGS) -> pathlib.Path:
    key = hashlib.sha256()
    sources = b"".join(p.name.encode() + p.read_bytes() for p in sorted(CSRC.iterdir())
                       if p.suffix in (".cc", ".h"))
    for part in (sources, jaxlib.__version__.encode(), " ".join(compiler).encode(),
                 " ".join(flags).encode(), _cpu_flags().encode(), platform.machine().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / f"{name}-{key.hexdigest()[:20]}.so"


def _compile(sources: tuple[pathlib.Path, ...], name: str, flags: tuple[str, ...]
             ) -> pathlib.Path:
    """Path of the library `name` built from `sources` with `flags`, compiling it if the cache
    lacks it."""
    missing = [str(p) for p in sources if not p.exists()]
    if missing:
        raise BuildError(f"kernel sources {missing} are missing from the installation")
    compiler = find_compiler()
    path = library_path(compiler, name, flags)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.stem + "-", suffix=".tmp", dir=path.parent)
    os.close(fd)
    cmd = [*compiler, *flags, f"-I{jax.ffi.include_dir()}", "-o", tmp, *map(str, sources)]
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


def build_library() -> pathlib.Path:
    """Path of the attention (and CPU probe) library, compiling it if the cache lacks it."""
    return _compile(SOURCES, "jaxserve_cpu_kernels", FLAGS)


def build_dense_library(isa: str) -> pathlib.Path:
    """Path of the dense kernels' library for `isa` (a dense_variants() name)."""
    extra = dict(dense_variants())[isa]
    return _compile(DENSE_SOURCES, f"jaxserve_dense_{isa}", (*FLAGS, *extra, *DENSE_LINK))


_DENSE_SYMBOLS = {DENSE_TARGET: "JaxserveDenseCpu",
                  DENSE_QUANT_TARGETS["int8"]: "JaxserveDenseInt8Cpu",
                  DENSE_QUANT_TARGETS["fp8"]: "JaxserveDenseFp8Cpu",
                  DENSE_QUANT_TARGETS["int4"]: "JaxserveDenseInt4Cpu",
                  DENSE_QDOT_TARGETS["int8"]: "JaxserveDenseQdotInt8Cpu",
                  DENSE_QDOT_TARGETS["int4"]: "JaxserveDenseQdotInt4Cpu",
                  QUANTIZE_ROWS_TARGET: "JaxserveQuantizeRowsCpu",
                  MOE_GROUPED_TARGETS["float32"]: "JaxserveMoeGroupedF32Cpu",
                  MOE_GROUPED_TARGETS["bfloat16"]: "JaxserveMoeGroupedBf16Cpu",
                  LORA_TARGETS["float32"]: "JaxserveLoraDeltaF32Cpu",
                  LORA_TARGETS["bfloat16"]: "JaxserveLoraDeltaBf16Cpu"}


_ATTENTION_SYMBOLS = {TARGET: "JaxservePagedAttentionCpu",
                      WRITE_TARGET: "JaxservePagedAttentionWriteCpu",
                      QUANT_TARGET: "JaxservePagedAttentionQuantCpu",
                      WRITE_QUANT_TARGET: "JaxservePagedAttentionWriteQuantCpu"}


def isa_target(target: str, isa: str) -> str:
    """The FFI target name of dense target `target` forced to `isa`."""
    return f"{target}_{isa}"


@functools.lru_cache(maxsize=None)
def _register(path: str) -> tuple[str, ...]:
    """Load the library and register its handlers (once per process and library), then build,
    load and register the dense variants this CPU runs; returns their names, best first."""
    try:
        lib = ctypes.cdll.LoadLibrary(path)
        handlers = {TARGET: jax.ffi.pycapsule(lib.JaxservePagedAttentionCpu),
                    WRITE_TARGET: jax.ffi.pycapsule(lib.JaxservePagedAttentionWriteCpu),
                    QUANT_TARGET: jax.ffi.pycapsule(lib.JaxservePagedAttentionQuantCpu),
                    WRITE_QUANT_TARGET: jax.ffi.pycapsule(
                        lib.JaxservePagedAttentionWriteQuantCpu),
                    NUCLEUS_TARGET: jax.ffi.pycapsule(lib.JaxserveNucleusCutoffsCpu)}
        supports = lib.JaxserveCpuSupports
        supports.restype, supports.argtypes = ctypes.c_int, [ctypes.c_char_p]
    except (OSError, AttributeError) as e:
        raise BuildError(f"could not load {path}: {e}") from e
    isas = tuple(isa for isa, _ in dense_variants() if supports(isa.encode()))
    for isa in isas:
        dense = str(build_dense_library(isa))
        try:
            dlib = ctypes.cdll.LoadLibrary(dense)
            for target, symbol in _DENSE_SYMBOLS.items():
                capsule = jax.ffi.pycapsule(getattr(dlib, symbol))
                handlers[isa_target(target, isa)] = capsule
                if isa == isas[0]:
                    handlers[target] = capsule
        except (OSError, AttributeError) as e:
            raise BuildError(f"could not load {dense}: {e}") from e
    if not isas:  # e.g. an x86-64 CPU without AVX2: the attention kernel still runs
        log.warning("this CPU runs none of the C++ dense kernels' instruction sets %s: the "
                    "dense projections use the jnp reference",
                    [isa for isa, _ in dense_variants()])
    for name, handler in handlers.items():
        jax.ffi.register_ffi_target(name, handler, platform="cpu")
    return isas


@functools.lru_cache(maxsize=None)
def load_kernels() -> tuple[str, ...] | None:
    """Builds (if the cache lacks them), loads and registers every kernel, once per process:
    the dense ISAs registered (best first), or None (after one warning) where the build
    fails. ``load_kernels.cache_clear()`` makes the next call try again (tests)."""
    try:
        return _register(str(build_library()))
    except BuildError as e:
        log.warning("CPU paged attention and dense kernels unavailable, using the jnp "
                    "references instead: %s", e)
        return None


def cpu_kernel_target() -> str | None:
    """The registered FFI target name (WRITE_TARGET is registered with it), or None (after one
    warning) where the build fails."""
    return TARGET if load_kernels() is not None else None


def nucleus_kernel_target() -> str | None:
    """The sampler's cut-off kernel's FFI target name, or None (after cpu_kernel_target's one
    warning) where the library could not be built."""
    return NUCLEUS_TARGET if load_kernels() is not None else None


def dense_isas() -> tuple[str, ...]:
    """The instruction sets of the dense kernels this CPU runs, best first (the first is what
    the plain target names run); () where the library could not be built or the CPU runs
    none of them."""
    return load_kernels() or ()


def dense_kernel_target(isa: str | None = None) -> str | None:
    """The dense projection's FFI target name (forced to `isa` if given), or None (after
    cpu_kernel_target's one warning) where the library could not be built."""
    return dense_target(DENSE_TARGET, isa)


@functools.lru_cache(maxsize=None)
def _register_attention_isa(isa: str) -> None:
    """Build (if the cache lacks it), load and register the attention handlers compiled for
    `isa` as ``<target>_<isa>``, once per process."""
    extra = dict(dense_variants())[isa]
    path = _compile(ATTENTION_SOURCES, f"jaxserve_attention_{isa}", (*FLAGS, *extra, *DENSE_LINK))
    try:
        lib = ctypes.cdll.LoadLibrary(str(path))
        handlers = {isa_target(target, isa): jax.ffi.pycapsule(getattr(lib, symbol))
                    for target, symbol in _ATTENTION_SYMBOLS.items()}
    except (OSError, AttributeError) as e:
        raise BuildError(f"could not load {path}: {e}") from e
    for name, handler in handlers.items():
        jax.ffi.register_ffi_target(name, handler, platform="cpu")


def attention_target(target: str, isa: str | None) -> str | None:
    """Attention target `target` (TARGET, WRITE_TARGET, QUANT_TARGET or WRITE_QUANT_TARGET),
    forced to the library built for `isa` (a dense_isas() name) if given; None where the
    library could not be built. An isa this CPU cannot run is a ValueError, a forced build
    that fails a BuildError (a test asking for a path must not silently get the reference)."""
    if load_kernels() is None:
        return None
    if isa is None:
        return target
    known = [name for name, _ in dense_variants()]
    if isa not in known:
        raise ValueError(f"isa={isa!r} must be one of {known} (or None: the best this CPU runs)")
    if isa not in dense_isas():
        raise ValueError(f"isa={isa!r}: this CPU runs only {list(dense_isas())}")
    _register_attention_isa(isa)
    return isa_target(target, isa)


def dense_target(target: str, isa: str | None) -> str | None:
    """Dense target `target` (DENSE_TARGET or a DENSE_QUANT_TARGETS value) forced to `isa`;
    None where the library could not be built. An isa this CPU cannot run is a ValueError."""
    isas = dense_isas()
    if isa is None:
        return target if isas else None
    known = [name for name, _ in dense_variants()]
    if isa not in known:
        raise ValueError(f"isa={isa!r} must be one of {known} (or None: the best this CPU runs)")
    if not isas:
        return None
    if isa not in isas:
        raise ValueError(f"isa={isa!r}: this CPU runs only {list(isas)}")
    return isa_target(target, isa)
