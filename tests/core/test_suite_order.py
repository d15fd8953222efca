"""The suite's own schedule: every file tests/conftest.py starts first exists
(a renamed file would silently fall back to its place in the tree)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _root_conftest() -> Any:
    """tests/conftest.py itself, loaded from its path (``import conftest`` finds whichever
    conftest module pytest imported under that name last: tests/storage's, say)."""
    spec = importlib.util.spec_from_file_location("_root_conftest", ROOT / "tests" / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_longest_first_file_exists_once() -> None:
    conftest = _root_conftest()
    missing = [p for p in conftest.LONGEST_FIRST if not (ROOT / p).is_file()]
    assert not missing, f"tests/conftest.py LONGEST_FIRST names files that do not exist: {missing}"
    assert len(set(conftest.LONGEST_FIRST)) == len(conftest.LONGEST_FIRST)
