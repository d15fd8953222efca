"""A real small filesystem for the tests that fill a disk or remount it
read-only (``mount -t tmpfs``: works here as root, as in CI).

``remount`` is imported by the chaos job's ranks as well (``tests/reliability``
is on their path), so this module imports pytest only where it skips."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

__all__ = ["mounted_tmpfs", "remount"]


@contextlib.contextmanager
def mounted_tmpfs(parent: Path, size_mib: int) -> Iterator[Path]:
    """A ``size_mib`` MiB tmpfs mounted below ``parent``, unmounted on exit;
    the test is skipped (saying why) where no tmpfs can be mounted."""
    import pytest

    root = parent / f"disk-{uuid.uuid4().hex[:6]}"
    root.mkdir()
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(root)],
                         capture_output=True, text=True)
    if got.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {got.stderr.strip()}")
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], capture_output=True)


def remount(root: Path | str, mode: str, timeout_s: float = 30.0) -> None:
    """Remounts the tmpfs at ``root`` ``"ro"`` or ``"rw"``, as an operator
    would: Linux refuses a read-only remount while a file on it is open for
    writing (``mount`` exits 32, "mount point is busy"), which a training job
    saving asynchronously holds now and then, so the remount is tried again
    every 10 ms until it takes or ``timeout_s`` passes; any other failure
    (or the last) raises ``mount``'s own message at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = subprocess.run(["mount", "-o", f"remount,{mode}", str(root)], capture_output=True, text=True)
        if got.returncode == 0:
            return
        if got.returncode != 32 or time.monotonic() > deadline:
            raise RuntimeError(f"mount -o remount,{mode} {root} failed (exit {got.returncode}): "
                               f"{got.stderr.strip()}")
        time.sleep(0.01)
