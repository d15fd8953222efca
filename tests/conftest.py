"""Shared test settings: hypothesis profile, the ``spawn`` marker's guard
(tests/spawning.py: ``make check`` runs the tests that start no process), warm
interpreters (tests/warm.py). docs/contributing.md says how to write a fast test.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import spawning
from hypothesis import settings

settings.register_profile("ci", max_examples=200, deadline=None)
settings.register_profile("dev", max_examples=60, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# every save in the tests compares replicated boxes across ranks (off by
# default for users: it costs a checksum pass); spawned ranks inherit it
os.environ.setdefault("BYTECP_VERIFY_REPLICAS", "1")


def pytest_configure(config: pytest.Config) -> None:
    spawning.install()
    # a plugin, not this conftest's hooks: a conftest's pytest_fixture_setup
    # is not called for session-scoped fixtures (their node is the session,
    # above this folder)
    config.pluginmanager.register(spawning, "bytecp-spawning")


# ---------------------------------------------------------------------- warm interpreters
_warm: dict[tuple[str, ...], Any] = {}


@pytest.fixture(scope="session")
def warm() -> Iterator[Any]:
    """``warm(*preload)``: a warm interpreter (tests/warm.py) that imported
    torch, bytecp and ``preload``, one per set of modules for the session;
    ``.popen``/``.run`` as subprocess's, at a fork's cost."""
    from warm import DEFAULT_PRELOAD, Warm

    def get(*preload: str) -> Warm:
        key = tuple(dict.fromkeys((*DEFAULT_PRELOAD, *preload)))
        w = _warm.get(key)
        if w is None or not w.alive:
            w = _warm[key] = Warm(key)
        return w

    yield get
    for w in _warm.values():
        w.close()
    _warm.clear()
