"""A failed save gives its space back before it reports, on a real small
tmpfs (``mount -t tmpfs``, root only; skipped elsewhere with the reason): a
save that fills the disk (sync, eager and lazy async) leaves the disk as it
found it and the next save fits; where removing fails too (the file system
went read-only), the error names the files left and the command that
removes them, and that command does once the disk is writable again."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import bytecp
from bytecp.cli import main as cli

from .tmpfs import mounted_tmpfs, remount

pytestmark = pytest.mark.spawn


def _used(root: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 40 MiB tmpfs of its own, unmounted after the test."""
    with mounted_tmpfs(tmp_path, 40) as root:
        yield root


@pytest.mark.parametrize("mode", ["sync", "eager", "lazy"])
def test_a_save_that_fills_the_disk_gives_the_space_back(small_disk: Path, mode: str) -> None:
    state = {"w": torch.randn(6 << 20)}  # 24 MiB: one fits in 40, two do not
    bytecp.save(str(small_disk / "run" / "step-1"), state)
    before = _used(small_disk)
    url = str(small_disk / "run" / "step-2")
    with pytest.raises(Exception, match="no space left on device"):
        if mode == "sync":
            bytecp.save(url, state)
        else:
            bytecp.async_save(url, state, lazy=mode == "lazy").wait(60)
    assert _used(small_disk) == before  # every byte of the failed save is gone when the error arrives
    assert not [f for _, _, fs in os.walk(url) for f in fs]
    bytecp.save(str(small_disk / "run" / "step-3"), {"w": torch.randn(1 << 20)})  # and the next save fits


def test_files_a_read_only_disk_keeps_are_named_and_gc_removes_them(small_disk: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    url = str(small_disk / "run" / "step-1")
    monkeypatch.setenv("BYTECP_LEASE_SECONDS", "0.5")  # gc waits out a save's lease term: a short one here
    monkeypatch.setenv("BYTECP_FAULT_DELAY", "commit:0:1.0")  # the data is written; the disk turns read-only
    turn_ro = threading.Timer(0.4, lambda: remount(small_disk, "ro"))
    turn_ro.start()
    try:
        with pytest.raises(Exception) as ei:
            bytecp.save(url, {"w": torch.randn(1 << 18)})
    finally:
        turn_ro.join()
    notes = "\n".join(getattr(ei.value, "__notes__", []))
    assert "file(s) of this failed save remain" in notes and f"bytecp gc {url}" in notes, notes
    left = [f for _, _, fs in os.walk(url) for f in fs if f.endswith(".bin")]
    assert left and all(name in notes for name in left)  # the data file is named
    remount(small_disk, "rw")
    monkeypatch.delenv("BYTECP_FAULT_DELAY")
    time.sleep(1.2)  # past the failed save's lease term (its lease could not be ended on a read-only disk)
    assert cli(["gc", url]) == 0
    assert "removed 3 file(s)" in capsys.readouterr().out  # the data file, its index part and the lease
    assert not [f for _, _, fs in os.walk(url) for f in fs]
