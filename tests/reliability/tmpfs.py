"""A real small filesystem for the tests that fill a disk or remount it
read-only (``mount -t tmpfs``: works here as root, as in CI)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["mounted_tmpfs"]


@contextlib.contextmanager
def mounted_tmpfs(parent: Path, size_mib: int) -> Iterator[Path]:
    """A ``size_mib`` MiB tmpfs mounted below ``parent``, unmounted on exit;
    the test is skipped (saying why) where no tmpfs can be mounted."""
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
