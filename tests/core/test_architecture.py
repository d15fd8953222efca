"""The core's shape: no import cycles (not even through imports inside
functions), no direct import of adapters, storage backends or monitoring
exporters (only the registries reach them), and no module -- of the core,
the adapters, the storage backends or monitoring -- that grows into a room
of its own."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "bytecp"
OUTSIDE = ("bytecp.adapters", "bytecp.storage", "bytecp.monitoring")


def _module(path: Path) -> str:
    rel = path.relative_to(CORE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every bytecp module ``path`` imports, at any depth of the file."""
    mod = _module(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if node.module is None or node.level and not node.module:
                out.update(f"{target}.{a.name}" for a in node.names)
            out.add(target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m == "bytecp" or m.startswith("bytecp.")}


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node but those under ``if TYPE_CHECKING:`` (never imported at run time)."""
    out: list[ast.AST] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        out.append(node)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in CORE.rglob("*.py")}
    return {m: {t for t in _imports(p) if t in files and t != m and t != "bytecp"} for m, p in files.items()}


def test_core_has_no_import_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in graph[m]:
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(t):] + [t]))
            if t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m)


def test_core_reaches_adapters_storage_and_monitoring_only_through_registries() -> None:
    for path in CORE.rglob("*.py"):
        bad = sorted(m for m in _imports(path) if any(m == o or m.startswith(o + ".") for o in OUTSIDE))
        assert not bad, f"{path.name} imports {bad}; use the registries (adapter_api, storage_api, recorder)"


#: a module past this many lines is flagged: a smell, not a rule (see the message)
LARGE_MODULE = 600


def test_no_module_is_a_room_of_its_own() -> None:
    """Modules of the core, adapters/, storage/ and monitoring/ (generated
    protobuf code excepted) past about 600 lines are named with the advice to
    split by responsibility. Size is a smell detector, never a reason to leave
    a feature, a check or a fault point out."""
    root = CORE.parent
    files = [p for d in ("bytecp", "adapters", "storage", "monitoring") for p in (root / d).rglob("*.py")]
    sizes = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in files if "generated" not in p.parts}
    large = sorted(((n, f) for f, n in sizes.items() if n > LARGE_MODULE), reverse=True)
    assert sizes and not large, (
        f"modules over {LARGE_MODULE} lines: {', '.join(f'{f} ({n})' for n, f in large)}; a module that "
        "large usually holds more than one responsibility: split it along them (docs/architecture.md, "
        "'Modules: the map'), do not trim features or checks to fit"
    )


def test_core_top_holds_at_most_16_modules_and_hand_off_code_lives_in_interop() -> None:
    """The core's top level stays small: hand-off code (other formats read
    and written, name specs, exporters) lives in ``bytecp.interop``, run-level
    helpers in ``bytecp.tools``; an adapter of more than one file is one package
    (the private modules beside them are what several adapters share)."""
    top = sorted(p.name for p in CORE.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 16, top
    handoff = ("export", "hf_export", "mapped_export", "mapping", "safetensors_dir", "hf_names")
    assert not [p for p in CORE.rglob("*.py") if p.stem in handoff and p.parent.name != "interop"]
    adapters = CORE.parent / "adapters"
    assert not [p.name for p in adapters.glob("_*.py") if p.name not in ("__init__.py", "_dtensor.py", "_names.py",
                                                                          "_optim.py", "_watch.py")]


def test_every_registered_source_and_writer_resolves() -> None:
    import importlib

    from bytecp import interop

    for name, module in interop.SOURCES.items():
        m = importlib.import_module(module)
        assert callable(m.detect) and callable(m.read), name
    for fmt in interop.WRITERS:
        assert callable(interop.writer(fmt)), fmt
