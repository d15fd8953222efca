"""A run's folders read on threads on a remote store (:func:`bytecp.catalog.scan`): the same
answer as one by one -- every committed checkpoint in step order, a folder
whose bytecp metadata.json does not read named once, everything else
passed over -- and the first storage error in the listing's order raised,
never read as "no checkpoint"."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import bytecp
from bytecp import catalog
from bytecp.errors import StorageError
from bytecp.storage_api import open_storage
from bytecp.tools.resume import decide

pytestmark = pytest.mark.timeout(120)


def _run(tmp_path: Path) -> str:
    run = tmp_path / "run"
    model = torch.nn.Linear(4, 4)
    mgr = bytecp.CheckpointManager(str(run), every_n_steps=1, keep_last=None)
    for step in range(1, 12):
        mgr.save(step, {"model": model})
    (run / "step-5" / "metadata.json").write_text('{"format": "bytecp", "format_version"')  # cut short
    (run / "notes").mkdir()
    (run / "README.txt").write_text("not a checkpoint")
    return str(run)


@pytest.fixture
def remote(monkeypatch: pytest.MonkeyPatch) -> None:
    """Local disk taken for a remote store: scanned on threads (local disk is scanned one by one)."""
    monkeypatch.setattr(type(open_storage("/tmp")), "remote", True)


def test_a_run_scanned_on_threads_lists_what_one_by_one_does(tmp_path: Path, remote: None,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    run = _run(tmp_path)
    root = open_storage(run)
    assert root.remote
    names = root.list_children("")
    assert len(names) > 4  # (the threads' path)
    threads: set[str] = set()
    real = catalog._scan_one

    def scan_one(*a: Any) -> Any:
        threads.add(threading.current_thread().name)
        return real(*a)

    with caplog.at_level(logging.WARNING, logger="bytecp.manager"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(catalog, "_scan_one", scan_one)
            got, bad = catalog.scan(root, run)
        again, bad2 = catalog.scan(root, run)
    assert threads and all(n.startswith("bytecp-scan") for n in threads)  # read on the scan's threads
    one_by_one = [catalog._scan_one(root, run, n) for n in names]
    assert [c.step for c in got] == [s for s in range(1, 12) if s != 5] == [c.step for c in again]
    assert got == sorted((g for g in one_by_one if isinstance(g, catalog.CheckpointInfo)),
                         key=lambda c: (c.step or 0, c.created))
    assert [u.name for u in bad] == [u.name for u in bad2] == ["step-5"]
    assert caplog.text.count("step-5 has an unreadable metadata.json") == 1  # once per process
    decision = decide(run)  # the resume decision over the same listing: step 11, then the older ones
    assert [c.step for c in decision.candidates()][:2] == [11, 10]


def test_the_first_storage_error_in_the_listings_order_is_raised(tmp_path: Path, remote: None,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    run = _run(tmp_path)
    root = open_storage(run)
    names = root.list_children("")
    failing = [n for n in names if n in ("step-3", "step-9")]
    real = catalog.read_header

    def read_header(ck: Any, **kw: Any) -> Any:
        name = ck.url.rstrip("/").rsplit("/", 1)[-1]
        if name in failing:
            raise StorageError(f"{ck.url}: the store refused the read")
        return real(ck, **kw)

    monkeypatch.setattr(catalog, "read_header", read_header)
    with pytest.raises(StorageError, match=f"{failing[0]}: the store refused"):
        catalog.scan(root, run)
    with pytest.raises(StorageError):  # a follower's poll, a resume: raised, not "no checkpoint"
        decide(run)
