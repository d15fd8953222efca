"""Fixtures for the monitoring tests: a collector on loopback, a clean recorder list."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from bytecp.monitoring.server import CollectorServer

from bytecp import recorder


@pytest.fixture(autouse=True)
def _no_global_recorders(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts and ends with no registered recorder and no $BYTECP_MONITOR."""
    monkeypatch.delenv("BYTECP_MONITOR", raising=False)
    monkeypatch.delenv("BYTECP_MONITOR_TOKEN", raising=False)
    before = recorder.recorders()
    yield
    for r in recorder.recorders():
        if r not in before:
            recorder.remove_recorder(r)


@pytest.fixture
def collector() -> Iterator[CollectorServer]:
    """A collector on 127.0.0.1 (ephemeral ports), its own registry, short grace period."""
    server = CollectorServer("127.0.0.1:0", "127.0.0.1:0", complete_after=5.0).start()
    try:
        yield server
    finally:
        server.stop(grace=None)
