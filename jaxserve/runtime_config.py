"""Process-wide settings: JAX's runtime options (`RuntimeConfig`, applied once by
`apply_runtime`) and the multi-process layout (`DistributedConfig`).

Split from `jaxserve.config` (which re-exports both) as their own concept: they describe the
process an engine runs in, not the engine. Environment variables are read here
(`RuntimeConfig.from_env`) and in the CLI only.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Mapping


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """Process-wide JAX settings applied once by `apply_runtime`."""

    # JAX persistent compilation cache: a second start skips XLA compiles. None disables it.
    compilation_cache_dir: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "RuntimeConfig":
        env = os.environ if env is None else env
        value = env.get("JAXSERVE_COMPILATION_CACHE_DIR")
        if value is None:
            value = str(pathlib.Path.home() / ".cache" / "jaxserve" / "xla")
        return cls(compilation_cache_dir=value or None)


def apply_runtime(cfg: RuntimeConfig) -> None:
    """Configure JAX from `cfg`; call once at program start, before the first compile."""
    import jax

    if cfg.compilation_cache_dir:
        pathlib.Path(cfg.compilation_cache_dir).mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", cfg.compilation_cache_dir)
        # Cache even quick compiles: on a CPU host every step function is worth keeping.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Several processes (hosts) running one engine: `jax.distributed` settings.

    Process 0 runs the scheduler and the fronts; every process runs the same compiled step
    over the devices of all of them (jaxserve.device.multihost). `coordinator` None: one process.
    """

    coordinator: str | None = None  # host:port of process 0's coordination service
    num_processes: int = 1
    process_id: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.num_processes, int) or self.num_processes < 1:
            raise ValueError(f"num_processes={self.num_processes!r} must be >= 1")
        if not isinstance(self.process_id, int) or not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id={self.process_id!r} must be in [0, num_processes="
                             f"{self.num_processes})")
        if self.num_processes > 1:
            host, _, port = (self.coordinator or "").rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"coordinator={self.coordinator!r} must be host:port (the "
                                 "address process 0 listens on) when num_processes > 1")

    @property
    def enabled(self) -> bool:
        return self.num_processes > 1

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0
