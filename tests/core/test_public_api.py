"""The public import paths stay stable (and `import bytecp` does not import torch)."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import bytecp


def test_public_names_resolve() -> None:
    for name in bytecp.__all__:
        assert getattr(bytecp, name) is not None, name
    for module in ("bytecp.storage", "bytecp.storage.testing", "bytecp.adapters", "bytecp.adapters.testing",
                   "bytecp.plugins", "bytecp.monitoring",
                   "bytecp.manager", "bytecp.cli", "bytecp.demo", "bytecp.options"):
        __import__(module)
    adapters = importlib.import_module("bytecp.adapters")
    for name in adapters.__all__:  # the adapter-writing surface (docs/extending.md)
        assert getattr(adapters, name) is not None, name


@pytest.mark.spawn
def test_import_does_not_pull_torch() -> None:
    code = "import sys, bytecp, bytecp.monitoring; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.spawn
def test_a_save_and_a_load_do_not_import_pandas(tmp_path) -> None:
    """pyarrow imports pandas the first time ``pa.array`` or ``to_numpy`` runs
    in a process (0.35 s, paid by a job's first commit and every rank's first
    load): the commit builds its Arrow columns from NumPy buffers
    (bytecp/format/parts_build.py), the index readers read them as views of
    their buffers (bytecp/format/arrow_numpy.py)."""
    ck = str(tmp_path / "ck")
    code = (f"import sys, torch, bytecp; bytecp.save({ck!r}, {{'w': torch.ones(64, 4), 'step': 3, "
            "'opt': {'state': {0: {'exp_avg': torch.zeros(8)}}}}); print('pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "False"
    code = ("import sys, torch, bytecp; sd = {'w': torch.zeros(64, 4), 'step': 0, 'opt': {'state': {0: {'exp_avg': "
            "torch.ones(8)}}}}; "
            f"bytecp.load({ck!r}, sd); assert sd['step'] == 3 and bool(sd['w'].eq(1).all()); "
            f"assert bytecp.load_state_dict({ck!r})['step'] == 3; print('pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_async_save_stays_callable_after_save(tmp_path) -> None:
    import torch

    bytecp.save(str(tmp_path / "a"), {"x": torch.zeros(1)})
    bytecp.async_save(str(tmp_path / "b"), {"x": torch.zeros(1)}).wait()


ROOT = Path(__file__).resolve().parents[2]
#: the folders installed as bytecp's packages (pyproject's package-dir)
PACKAGES = ("bytecp", "adapters", "storage", "monitoring")
#: dotted names in the docs that are not Python import paths
NOT_PYTHON = {
    "bytecp.format_version",  # a Parquet schema metadata key (FORMAT.md)
    "bytecp.save_id",  # a Parquet schema metadata key of version 4 (FORMAT.md)
    "bytecp.monitor.v1",  # the protobuf package (monitoring.md)
    "bytecp.monitors",  # an entry-point group (extending.md)
    "bytecp.resharders",  # an entry-point group (extending.md)
}


def _modules() -> list[Path]:
    return sorted(p for d in PACKAGES for p in (ROOT / d).rglob("*.py") if "generated" not in p.parts)


def _top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try)):
            stack.extend(node.body + node.orelse + [s for h in getattr(node, "handlers", []) for s in h.body])
    return names


def test_every_module_declares_what_it_exports() -> None:
    """``__all__`` in every module, naming only what the module defines or
    imports (a package that resolves names lazily defines ``__getattr__``)."""
    for path in _modules():
        tree = ast.parse(path.read_text())
        exported = [n for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign)) and any(
            isinstance(t, ast.Name) and t.id == "__all__"
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))]
        rel = path.relative_to(ROOT)
        assert exported, f"{rel} has no __all__"
        defined = _top_level_names(tree)
        if "__getattr__" in defined:
            continue
        value = exported[0].value
        assert value is not None
        missing = [n for n in ast.literal_eval(value) if n not in defined]
        assert not missing, f"{rel}: __all__ names {missing}, which it does not define"


def _documented_paths() -> list[str]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = {m for d in docs for m in re.findall(r"\bbytecp(?:\.[A-Za-z_]\w*)+", d.read_text())}
    return sorted(found - NOT_PYTHON)


def _resolve(path: str) -> object:
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(path)


def test_import_paths_the_docs_use_resolve() -> None:
    """Every ``bytecp.x.y`` the README and docs/ name is importable (the docs
    are read here, so a renamed module or function fails this test)."""
    paths = _documented_paths()
    assert {"bytecp.save", "bytecp.manager.CheckpointManager", "bytecp.storage.testing"} <= set(paths)
    bad = []
    for path in paths:
        try:
            _resolve(path)
        except (ImportError, AttributeError) as e:
            bad.append(f"{path}: {type(e).__name__}: {e}")
    assert not bad, "\n".join(bad)


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] != "bytecp":
        parts.insert(0, "bytecp")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def test_what_modules_import_from_each_other_is_exported() -> None:
    """A public name one bytecp module imports from another is in that
    module's ``__all__`` (the internal subpackages included): ``__all__`` says
    what a module offers the rest of the package."""
    files = {_module_name(p): p for p in _modules()}
    exports: dict[str, tuple[set[str], bool]] = {}
    for mod, path in files.items():
        tree = ast.parse(path.read_text())
        names: set[str] = set()
        for n in tree.body:
            if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None and any(
                    isinstance(t, ast.Name) and t.id == "__all__"
                    for t in (n.targets if isinstance(n, ast.Assign) else [n.target])):
                names = set(ast.literal_eval(n.value))
        exports[mod] = (names, "__getattr__" in _top_level_names(tree))
    bad = []
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")
                target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target not in exports or exports[target][1]:
                continue
            for alias in node.names:
                name = alias.name
                if name.startswith("_") or f"{target}.{name}" in files or name in exports[target][0]:
                    continue
                bad.append(f"{path.relative_to(ROOT)} imports {name} from {target}, not in its __all__")
    assert not bad, "\n".join(bad)
