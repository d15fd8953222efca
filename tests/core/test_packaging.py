"""The packages pyproject.toml lists are exactly the tree's (fast; no build).

`make wheel-check` (tools/wheel-check.sh, run by `make test`) builds the sdist
and wheel and runs the installed copy; this test names a missing or stale
entry in the inner loop, before any build.
"""

from __future__ import annotations

import os
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def _config() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def _tree_packages(package_dir: dict[str, str]) -> set[str]:
    """Every folder with an ``__init__.py`` under a mapped top folder, by its package name."""
    found: set[str] = set()
    tops = {pkg: folder for pkg, folder in package_dir.items() if "/" not in folder}
    for pkg, folder in tops.items():
        for here, subdirs, files in os.walk(ROOT / folder):
            subdirs[:] = [d for d in subdirs if d != "__pycache__"]
            if "__init__.py" in files:
                rel = os.path.relpath(here, ROOT / folder)
                found.add(pkg if rel == "." else f"{pkg}.{rel.replace(os.sep, '.')}")
    return found


def test_listed_packages_are_the_tree() -> None:
    cfg = _config()
    listed, tree = set(cfg["packages"]), _tree_packages(cfg["package-dir"])
    assert not tree - listed, f"add to pyproject.toml [tool.setuptools] packages: {sorted(tree - listed)}"
    assert not listed - tree, f"pyproject.toml lists packages with no folder: {sorted(listed - tree)}"


def test_package_dir_maps_to_folders() -> None:
    for pkg, folder in _config()["package-dir"].items():
        assert (ROOT / folder / "__init__.py").is_file(), f"package-dir {pkg!r} -> {folder!r} has no __init__.py"
