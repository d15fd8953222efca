"""``BYTECP_DEBUG_BUFFERS=1``: a reused buffer released is poisoned, and any
use after its release fails loudly, naming the buffer: a holder checking it
after it was released (or taken again), a late writer found in the poison
when the buffer is taken again. The save's staging arena, the memory tier's
pool of arenas; the load's pinned slabs (CUDA) use the same guard."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import bytecp
from bytecp.saving import staging
from bytecp.storage_api import open_storage
from bytecp.tree import buffers
from bytecp.tree.buffers import POISON, Guard, UseAfterRelease


@pytest.fixture()
def debug(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BYTECP_DEBUG_BUFFERS", "1")


def test_a_released_buffer_is_poisoned_and_a_late_write_fails_the_next_take(debug: None) -> None:
    buf = bytearray(b"x" * 64)
    g = Guard("a test buffer", memoryview(buf))
    token = g.acquire()
    g.check(token)
    g.release()
    assert buf == bytes([POISON]) * 64
    with pytest.raises(UseAfterRelease, match="a test buffer used after it was released"):
        g.check(token)
    buf[17] = 0  # a late writer (a read that timed out, a copy still in flight)
    with pytest.raises(UseAfterRelease, match="a test buffer: byte 17 of 64 was written after the buffer was released"):
        g.acquire()


def test_a_stale_token_fails_once_the_buffer_is_taken_again(debug: None) -> None:
    g = Guard("a test buffer", memoryview(bytearray(8)))
    old = g.acquire()
    g.release()
    new = g.acquire()
    g.check(new)
    with pytest.raises(UseAfterRelease, match="released and taken for another use"):
        g.check(old)


def test_without_the_debug_mode_a_guard_neither_fills_nor_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BYTECP_DEBUG_BUFFERS", raising=False)
    buf = bytearray(b"x" * 8)
    g = Guard("a test buffer", memoryview(buf))
    token = g.acquire()
    g.release()
    g.check(token)
    assert buf == b"x" * 8 and not buffers.debug()


def test_the_staging_arena_is_poisoned_once_its_save_is_written(debug: None, tmp_path: Path) -> None:
    state = {"w": torch.randn(1 << 16), "v": torch.arange(1000)}
    bytecp.async_save(str(tmp_path / "a"), state).wait(60)
    arena = staging.POOL._arena
    assert arena is not None and bool((arena == POISON).all())  # every byte: nothing of the save is left
    got = bytecp.load_state_dict(str(tmp_path / "a"))
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["v"], state["v"])
    bytecp.async_save(str(tmp_path / "b"), state).wait(60)  # taken again: the poison was intact
    assert torch.equal(bytecp.load_state_dict(str(tmp_path / "b"))["w"], state["w"])


class _ReleasingStorage:
    """A storage whose data-file write finds the staging arena released under it
    (what a second save reusing it too early would do)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def write_file(self, path: str, buffers_: Any) -> None:
        if path.startswith("data/"):
            staging.POOL.guard.release()
        self.inner.write_file(path, buffers_)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_write_from_a_released_arena_fails_the_save_loudly(debug: None, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    url = str(tmp_path / "ck")
    monkeypatch.setattr(bytecp.api, "open_storage", lambda *a, **k: _ReleasingStorage(open_storage(*a, **k)))
    handle = bytecp.async_save(url, {"w": torch.randn(1 << 16)})
    with pytest.raises(Exception, match="a save's staging arena used after it was released"):
        handle.wait(60)
    assert not (tmp_path / "ck" / "metadata.json").exists()


def test_the_keepers_pool_poisons_a_free_arena_and_refuses_one_written_after(debug: None, tmp_path: Path) -> None:
    from bytecp.storage._keeper_arenas import Arenas

    arenas = Arenas(str(tmp_path), pool_max=2)
    name, path, size = arenas.lend(2 << 20, os.getpid())
    with open(path, "r+b") as f:
        f.write(os.urandom(size))
    arenas.release([name])  # dropped unadopted: back to the pool, poisoned
    (free,) = [p for _, p in arenas.free]
    assert np.all(np.fromfile(free, np.uint8) == POISON)
    with open(free, "r+b") as f:  # a rank writing through the mapping it kept
        f.seek(12345)
        f.write(b"\0")
    with pytest.raises(UseAfterRelease, match="byte 12345 of this free staging arena was written after"):
        arenas.lend(2 << 20, os.getpid())
