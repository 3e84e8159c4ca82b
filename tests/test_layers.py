"""The layer rules of the source tree, checked.

Layers, top to bottom (imports point down; a layer may skip the ones between):

    cli             jaxserve/cli: the `jaxserve` command, its flags, batch job, bench
    server, llm     jaxserve.server (server/): transport only; jaxserve/llm.py, the offline
                    facade; jaxserve/client.py, a shim re-exporting jaxserve.server.client
    serving         jaxserve/serving: async engine, replica pools, router, metrics, admission,
                    build (config -> running engines)
    engine, device  jaxserve/engine: host side, plain Python + numpy, no jax or flax;
                    jaxserve/device: jax (model runner, sampler, compile guard, multihost).
                    device imports engine (the batch it runs, the StepResult it returns);
                    engine never imports device
    models          jaxserve.models (models/): functional models, loaders, tokenizer
    kernels_pallas  jaxserve.kernels_pallas (kernels_pallas/): imports nothing else of jaxserve

`jaxserve.config` (frozen configuration; `jaxserve.spec_config`, `jaxserve.slo_config`,
`jaxserve.lora_config` and `jaxserve.runtime_config` are part of it) sits beside models:
every layer above may read it, it imports nothing of engine / device / serving / server / llm /
cli.

engine -> models: the engine reads the model's shape (`models.config`) and detokenizes with
`models.tokenizer`; those are host-side modules. The engine may import only the jax-free
modules of models listed in ENGINE_MODELS; `test_engine_imports_without_jax`
proves, with jax made unimportable, that they (and everything they pull in) stay jax-free.

The import analysis is static (ast over every .py file, relative imports resolved, imports
inside functions and `if TYPE_CHECKING:` blocks included): a lazy import still ties the layers.

No source file is longer than MAX_LINES lines: past that a module holds more than one thing.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_LINES = 400

# Source folder -> the import name it is installed under (pyproject's package-dir).
PACKAGE_DIRS = {
    "jaxserve": "jaxserve",
    "models": "jaxserve.models",
    "server": "jaxserve.server",
    "kernels_pallas": "jaxserve.kernels_pallas",
}
SOURCE_DIRS = [*PACKAGE_DIRS, "scripts"]

# Module-name prefix -> layer. Longest prefix wins; `jaxserve` alone is the package root, whose
# lazy attributes (LLM, build_engine) reach the facade.
LAYER_PREFIXES = {
    "jaxserve.kernels_pallas": "kernels_pallas",
    "jaxserve.models": "models",
    "jaxserve.config": "config",
    "jaxserve.spec_config": "config",
    "jaxserve.slo_config": "config",
    "jaxserve.lora_config": "config",
    "jaxserve.runtime_config": "config",
    "jaxserve.engine": "engine",
    "jaxserve.device": "device",
    "jaxserve.serving": "serving",
    "jaxserve.server": "server",
    "jaxserve.client": "server",
    "jaxserve.llm": "llm",
    "jaxserve.cli": "cli",
    "jaxserve": "root",
}

EVERYTHING = {"kernels_pallas", "models", "config", "engine", "device", "serving", "server",
              "llm", "cli", "root"}
# Source layer -> layers it must not import.
FORBIDDEN = {
    "kernels_pallas": EVERYTHING - {"kernels_pallas"},
    "models": {"engine", "device", "serving", "server", "llm", "cli", "root"},
    "config": {"engine", "device", "serving", "server", "llm", "cli", "root"},
    "engine": {"device", "serving", "server", "llm", "cli", "root"},
    "device": {"serving", "server", "llm", "cli", "root"},
    "serving": {"server", "llm", "cli", "root"},
    "server": {"cli"},
    "llm": {"server", "cli"},
}
ENGINE_MODELS = {"jaxserve.models.config", "jaxserve.models.tokenizer",
                 "jaxserve.models.kv_groups"}


def _source_files(dirs: list[str]) -> list[pathlib.Path]:
    files = []
    for d in dirs:
        files += [p for p in sorted((ROOT / d).rglob("*.py")) if "__pycache__" not in p.parts]
    return files


def module_name(path: pathlib.Path) -> str:
    """jaxserve/X/y.py -> jaxserve.X.y, models/y.py -> jaxserve.models.y, ... (package: no
    trailing __init__)."""
    rel = path.relative_to(ROOT)
    parts = [PACKAGE_DIRS[rel.parts[0]].split("."), list(rel.parts[1:-1]), [rel.stem]]
    name = [p for group in parts for p in group]
    if name[-1] == "__init__":
        name.pop()
    return ".".join(name)


ALL_MODULES = {module_name(p) for p in _source_files(list(PACKAGE_DIRS))}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`) blocks."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                inside |= {id(n) for n in ast.walk(stmt)}
    return inside


def imported_modules(path: pathlib.Path, *, runtime_only: bool = False) -> list[tuple[int, str]]:
    """(line, module) for every import in the file, wherever it sits (with `runtime_only`,
    leaving out those under `if TYPE_CHECKING:`); `from pkg import x` names pkg.x when that is
    a module of the tree, else pkg."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_nodes(tree) if runtime_only else set()
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((node.lineno, sub if sub in ALL_MODULES else target))
    return found


def layer_of(module: str) -> str | None:
    for prefix in sorted(LAYER_PREFIXES, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return LAYER_PREFIXES[prefix]
    return None


def layer_violations() -> list[str]:
    out = []
    for path in _source_files(list(PACKAGE_DIRS)):
        src_mod = module_name(path)
        src = layer_of(src_mod)
        for line, target in imported_modules(path):
            dst = layer_of(target)
            if dst is None or dst == src:
                continue
            where = f"{path.relative_to(ROOT)}:{line}: {src_mod} ({src}) imports {target} ({dst})"
            if dst in FORBIDDEN.get(src, set()):
                out.append(where)
            elif src == "engine" and dst == "models" and target not in ENGINE_MODELS:
                out.append(f"{where}; the engine may import only {sorted(ENGINE_MODELS)}")
    return out


def test_module_names_resolve() -> None:
    # The analysis below is only as good as its path -> module mapping.
    assert "jaxserve.server.openai_http" in ALL_MODULES
    assert "jaxserve.models.llama" in ALL_MODULES
    assert "jaxserve.kernels_pallas" in ALL_MODULES
    assert layer_of("jaxserve.engine.engine") == "engine"
    assert layer_of("jaxserve.client") == "server"
    assert layer_of("jaxserve") == "root"
    assert layer_of("numpy") is None
    # `from .common import ...` in kernels_pallas/__init__.py resolves to the sibling module.
    kernels = ROOT / "kernels_pallas" / "__init__.py"
    assert "jaxserve.kernels_pallas.common" in {m for _, m in imported_modules(kernels)}


def test_imports_point_down() -> None:
    violations = layer_violations()
    assert not violations, "layer rules broken:\n" + "\n".join(violations)


def test_engine_has_no_jax_import() -> None:
    # Static: also catches an `import jax` inside a function, which importing the module
    # (the test below) would not run. Type annotations under TYPE_CHECKING are fine.
    found = []
    for path in _source_files(["jaxserve/engine"]):
        for line, target in imported_modules(path, runtime_only=True):
            if target.split(".")[0] in ("jax", "jaxlib", "flax"):
                found.append(f"{path.relative_to(ROOT)}:{line}: imports {target}")
    assert not found, "the engine layer imports jax:\n" + "\n".join(found)


def test_engine_imports_without_jax() -> None:
    engine_modules = sorted(m for m in ALL_MODULES if layer_of(m) == "engine")
    assert "jaxserve.engine.scheduler" in engine_modules
    script = textwrap.dedent(f"""
        import importlib, sys

        class NoJax:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("jax", "jaxlib", "flax"):
                    raise ImportError(f"the engine layer imported {{name}}")
                return None

        sys.meta_path.insert(0, NoJax())
        for name in {engine_modules!r}:
            importlib.import_module(name)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "flax"))
        assert not loaded, loaded
        print("ok")
    """)
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_source_files_are_short() -> None:
    too_long = []
    for path in _source_files(SOURCE_DIRS):
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not too_long, f"source files over {MAX_LINES} lines:\n" + "\n".join(too_long)


def test_user_import_paths_still_work() -> None:
    """What users import stays where it was: the package root and `jaxserve.client`."""
    import jaxserve
    import jaxserve.client
    from jaxserve.engine.engine import Engine
    from jaxserve.engine.sampling_params import SamplingParams
    from jaxserve.llm import LLM
    from jaxserve.server import client

    assert (jaxserve.LLM, jaxserve.Engine, jaxserve.SamplingParams) == (LLM, Engine,
                                                                         SamplingParams)
    for name in ("Client", "AsyncClient", "pb2", "fold"):
        assert getattr(jaxserve.client, name) is getattr(client, name)
    out = subprocess.run([sys.executable, "-m", "jaxserve.cli", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for command in ("generate", "convert", "serve", "client", "batch", "bench", "tune"):
        assert command in out
