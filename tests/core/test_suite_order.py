"""The suite's own schedule: every file tests/conftest.py starts first exists
(a renamed file would silently fall back to its place in the tree)."""

from __future__ import annotations

from pathlib import Path

import conftest

ROOT = Path(__file__).resolve().parents[2]


def test_every_longest_first_file_exists_once() -> None:
    missing = [p for p in conftest.LONGEST_FIRST if not (ROOT / p).is_file()]
    assert not missing, f"tests/conftest.py LONGEST_FIRST names files that do not exist: {missing}"
    assert len(set(conftest.LONGEST_FIRST)) == len(conftest.LONGEST_FIRST)
