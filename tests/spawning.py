"""Which tests start processes: the ``spawn`` marker, checked rather than trusted.

``make check`` runs the tests that start no process (``-m "not spawn"``,
in-process and quick); ``make test`` runs every test. A test is marked
``spawn`` by

- ``@pytest.mark.spawn`` on it, or ``pytestmark = pytest.mark.spawn`` in its
  module (a test whose body starts processes);
- using a fixture decorated with :func:`spawns` (under ``@pytest.fixture``),
  directly or through another fixture: a pool of ranks, a server, a job
  whose results several tests check;
- using a shared fixture of :data:`SPAWNING_FIXTURES` (``pools``, ``warm``,
  the Ceph RADOS Gateway), or being marked ``ceph``.

The guard watches every way this process can start another
(``subprocess``, ``multiprocessing``, ``os.fork``, ``os.posix_spawn``,
``os.system``, a warm interpreter) while each test sets up and runs, and
fails an unmarked test that started one, or that uses a fixture which did,
naming what was started: no test sits silently in the wrong set.
tests/conftest.py registers this module as a plugin; docs/contributing.md says how to write a
fast test.
"""

from __future__ import annotations

import _posixsubprocess
import os
import subprocess
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

__all__ = ["SPAWN", "SPAWNING_FIXTURES", "spawns", "install", "pytest_collection_modifyitems",
           "pytest_fixture_setup", "pytest_runtest_makereport", "pytest_runtest_protocol"]

F = TypeVar("F", bound=Callable[..., Any])


def spawns(fn: F) -> F:
    """Declare a fixture that starts processes (put it under ``@pytest.fixture``):
    every test using it, directly or through other fixtures, is marked ``spawn``."""
    fn._bytecp_spawns = True  # type: ignore[attr-defined]
    return fn


SPAWN = "spawn"

#: shared fixtures that start processes: a test using one is marked ``spawn``
#: (a fixture of one module that starts processes: mark the module instead)
SPAWNING_FIXTURES = frozenset({
    "pools",  # tests/dist/conftest.py: gloo ranks, one pool per world size
    "warm",  # tests/conftest.py: warm interpreters
    "ceph_rgw", "ceph_bucket",  # tests/storage/conftest.py (moto runs in a thread of this process)
})

#: commands libraries run on their own while loading (``ctypes.util.find_library``)
_IGNORED = ("ldconfig",)


# ---------------------------------------------------------------------- the guard
class _Guard:
    """What the current test (setup and call) and each fixture's setup started."""

    def __init__(self) -> None:
        self.active = False
        self.started: list[str] = []
        self.fixture_started: dict[Any, str] = {}  # FixtureDef -> what its setup started

    def note(self, what: str) -> None:
        if self.active:
            self.started.append(what)


_guard = _Guard()


def _describe(args: Any) -> str:
    if isinstance(args, (str, bytes)):
        return os.fsdecode(args)[:200]
    try:
        return " ".join(os.fsdecode(a) for a in args)[:200]
    except TypeError:
        return repr(args)[:200]


def install() -> None:
    """Wrap every way of starting a process (once per process)."""
    if getattr(_posixsubprocess.fork_exec, "_bytecp_guard", False):
        return
    orig_fork_exec = _posixsubprocess.fork_exec

    def fork_exec(args: Any, *rest: Any, **kw: Any) -> Any:
        cmd = _describe(args)
        if os.path.basename(cmd.split(" ", 1)[0]) not in _IGNORED:
            _guard.note(cmd)
        return orig_fork_exec(args, *rest, **kw)

    fork_exec._bytecp_guard = True  # type: ignore[attr-defined]
    _posixsubprocess.fork_exec = fork_exec  # multiprocessing
    subprocess._fork_exec = fork_exec  # type: ignore[attr-defined]  # subprocess binds it at import

    def wrap(name: str, orig: Any) -> Any:
        def call(*args: Any, **kw: Any) -> Any:
            _guard.note(f"os.{name}({_describe(args[:2]) if args else ''})")
            return orig(*args, **kw)
        # pickled by reference as the original is, posix.<name> (a test's
        # payload may name os.system in its __reduce__; the wrapper stands
        # in posix too, so pickle finds the very object it is given)
        call.__module__, call.__name__, call.__qualname__ = orig.__module__, name, name
        return call

    import posix

    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        if hasattr(os, name):
            wrapped = wrap(name, getattr(os, name))
            setattr(os, name, wrapped)
            if getattr(posix, name, None) is not None:
                setattr(posix, name, wrapped)

    # a process forked by a server that runs already (multiprocessing's fork
    # server, a warm interpreter) is started without a fork here
    import multiprocessing.process

    orig_start = multiprocessing.process.BaseProcess.start

    def start(self: Any) -> None:
        _guard.note(f"multiprocessing.Process({getattr(self, '_target', None)!r})")
        orig_start(self)

    multiprocessing.process.BaseProcess.start = start  # type: ignore[method-assign]
    import warm

    orig_popen = warm.Warm.popen

    def popen(self: Any, args: Any, **kw: Any) -> Any:
        _guard.note(f"warm {_describe(args)}")
        return orig_popen(self, args, **kw)

    warm.Warm.popen = popen  # type: ignore[method-assign]


def _declared(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    if SPAWNING_FIXTURES.intersection(info.names_closure):
        return True
    return any(getattr(d.func, "_bytecp_spawns", False)
               for name in info.names_closure for d in info.name2fixturedefs.get(name, ()))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        # the Ceph RADOS Gateway is a set of processes (moto is a thread of this one)
        if item.get_closest_marker("ceph") is not None or _declared(item):
            item.add_marker(SPAWN)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: Any, request: pytest.FixtureRequest) -> Iterator[Any]:
    before = len(_guard.started)
    try:
        return (yield)
    finally:
        if len(_guard.started) > before and fixturedef not in _guard.fixture_started:
            _guard.fixture_started[fixturedef] = _guard.started[before]


def _used_spawning_fixture(item: pytest.Item) -> str | None:
    info = getattr(item, "_fixtureinfo", None)
    used = [d for defs in (info.name2fixturedefs.values() if info is not None else ()) for d in defs]
    # and those it asked for with request.getfixturevalue (pytest keeps them on the request)
    used += list(getattr(getattr(item, "_request", None), "_fixture_defs", {}).values())
    for d in used:
        if d in _guard.fixture_started:
            return f"fixture {d.argname!r} started {_guard.fixture_started[d]}"
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    report = yield
    started, _guard.started = _guard.started, []
    # a teardown also ends fixtures of the module and the session the test
    # may not use: what starts there (a server's stop script) is nobody's
    if call.when == "teardown" or not report.passed or item.get_closest_marker(SPAWN) is not None:
        return report
    why = "; ".join(dict.fromkeys(started)) if started else _used_spawning_fixture(item)
    if why:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} starts processes ({why[:500]}) but is not marked `{SPAWN}`: add "
            f"@pytest.mark.{SPAWN} to it (or `pytestmark = pytest.mark.{SPAWN}` to its module), or "
            "decorate the fixture that starts them with tests/spawning.py's @spawns, so that "
            "`make check` leaves it to `make test` (docs/contributing.md)")
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[Any]:
    _guard.active, _guard.started = True, []
    try:
        return (yield)
    finally:
        _guard.active = False
