"""The heavy-first module order (support/order.py) names modules that exist, and reorders
whole modules while keeping each module's own test order."""

from __future__ import annotations

import pathlib
from types import SimpleNamespace

from support.order import HEAVY_MODULES, heaviest_first

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_ranked_module_exists_once() -> None:
    missing = [m for m in HEAVY_MODULES if not (ROOT / m).is_file()]
    assert not missing, f"support/order.py ranks modules that are gone: {missing}"
    assert len(set(HEAVY_MODULES)) == len(HEAVY_MODULES)


def test_heavy_modules_come_first_and_tests_keep_their_order() -> None:
    ids = ["tests/a.py::t1", "tests/b.py::t1", "tests/a.py::t2", "tests/c.py::t1",
           "tests/b.py::t2", "tests/d.py::t1"]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    got = [i.nodeid for i in heaviest_first(items, heavy=("tests/c.py", "tests/b.py"))]
    assert got == ["tests/c.py::t1", "tests/b.py::t1", "tests/b.py::t2",
                   "tests/a.py::t1", "tests/a.py::t2", "tests/d.py::t1"]
