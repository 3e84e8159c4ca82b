"""mkdocs hooks of the jaxserve site (registered under `hooks:` in mkdocs.yml), run on every
`mkdocs build` / `mkdocs serve`:

- configuration.md: the marker `<!-- generated: configuration -->` is replaced by the tables
  `gen_config.configuration_markdown` makes from the code (EngineConfig, the CLI flags,
  ServerConfig, the sampling registry, environment variables), so the page cannot go stale;
- every page: a repository path it names (`scripts/x.py`, `tests/server/...`,
  `benchmarks/results/...`) that does not exist, or a `jaxserve.<module>.<name>` that does
  not resolve (statically: the module file exists and mentions the name), is a warning,
  which `mkdocs build --strict` turns into a failure;
- the plots of `benchmarks/results/` are added to the site, and links to them written as
  repository-relative paths (`../../benchmarks/results/A_sweep.png`, which also work when a
  page is read on a code host) point at that copy.
"""

from __future__ import annotations

import importlib.util
import logging
import pathlib
import posixpath
import re
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
MARKER = "<!-- generated: configuration -->"
log = logging.getLogger("mkdocs.plugins.jaxserve_docs")


def _gen_config() -> Any:
    """docs/gen_config.py, loaded by path (mkdocs loads this file by path too)."""
    spec = importlib.util.spec_from_file_location("jaxserve_docs_gen_config",
                                                  pathlib.Path(__file__).with_name(
                                                      "gen_config.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- references
PATH_RE = re.compile(r"(?<![\w./-])((?:jaxserve|models|server|kernels_pallas|scripts|tests|"
                     r"benchmarks|docs|\.ci)/[^\s`'\"()\[\],;:]*)")
LINK_TARGET = re.compile(r"\]\([^)\s]*\)")  # a page link: mkdocs validates those itself
DOTTED_RE = re.compile(r"(?<![\w./-])(jaxserve(?:\.[A-Za-z_]\w*)+)")
PACKAGES = (("jaxserve.models", "models"), ("jaxserve.server", "server"),
            ("jaxserve.kernels_pallas", "kernels_pallas"), ("jaxserve", "jaxserve"))


def _module_file(dotted: str) -> pathlib.Path | None:
    for name, folder in PACKAGES:
        if dotted == name or dotted.startswith(name + "."):
            rest = dotted[len(name):].lstrip(".").replace(".", "/")
            base = ROOT / folder / rest if rest else ROOT / folder
            for cand in (base.with_suffix(".py"), base / "__init__.py"):
                if cand.is_file():
                    return cand
            return None
    return None


def _defines(path: pathlib.Path, name: str) -> bool:
    text = path.read_text()
    return bool(re.search(rf"^\s*(?:async\s+def|def|class)\s+{name}\b|^\s*{name}\s*[:=]|"
                          rf"\bimport\b[^\n]*\b{name}\b|^\s+{name},?\s*$|"
                          rf"name == \"{name}\"|\"{name}\"", text, re.M))


def check_references(markdown: str, where: str) -> None:
    text = LINK_TARGET.sub("]()", markdown)
    for m in PATH_RE.finditer(text):
        path = m.group(1).rstrip(".")
        if any(c in path for c in "{}*<>$|"):  # a pattern, not a path
            continue
        if not (ROOT / path).exists():
            log.warning("%s names %s, which does not exist", where, path)
    for m in DOTTED_RE.finditer(text):
        parts = m.group(1).split(".")
        if parts[1] in ("v1", "json"):  # the proto package; the checkpoint marker file
            continue
        for i in range(len(parts), 0, -1):
            f = _module_file(".".join(parts[:i]))
            if f is not None:
                break
        if f is None:
            log.warning("%s names %s: no such module", where, m.group(1))
        elif i < len(parts) and not _defines(f, parts[i]):
            log.warning("%s names %s: %s defines no %s", where, m.group(1),
                        f.relative_to(ROOT), parts[i])


# ----------------------------------------------------------------------------- mkdocs hooks
RESULTS = "benchmarks/results"
_RESULT_LINK = re.compile(r"\]\((?:\.\./)+(" + RESULTS + r"/[^)\s]+)\)")


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for path in sorted((ROOT / RESULTS).rglob("*.png")):
        files.append(File.generated(config, str(path.relative_to(ROOT)),
                                    abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    where = page.file.src_uri
    check_references(markdown, where)
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, _gen_config().configuration_markdown())

    def to_copy(m: re.Match) -> str:
        if not (ROOT / m.group(1)).is_file():
            log.warning("%s links %s, which does not exist", where, m.group(1))
        rel = posixpath.relpath(m.group(1), posixpath.dirname(where) or ".")
        return f"]({rel})"

    return _RESULT_LINK.sub(to_copy, markdown)
