"""The reader threads of a load are kept for the next one: a second load
starts no thread, a failed load's pool is not kept, and loads on several
threads at once each have their own pool (:func:`bytecp.loading.reader._read_pool`)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import bytecp
from bytecp.errors import CorruptCheckpointError


def _readers() -> set[int]:
    return {t.ident or 0 for t in threading.enumerate() if t.name.startswith("bytecp-read")}


@pytest.fixture()
def ck(tmp_path: Path) -> tuple[str, dict[str, torch.Tensor]]:
    """A checkpoint of 8 tensors of 4 MiB: several read batches, so a pool is used."""
    state = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(8)}
    bytecp.save(str(tmp_path / "ck"), state)
    return str(tmp_path / "ck"), state


def test_a_second_load_starts_no_reader_thread(ck: tuple[str, dict[str, torch.Tensor]]) -> None:
    url, state = ck
    bytecp.load(url, {k: torch.zeros_like(v) for k, v in state.items()})
    first = _readers()
    assert first, "the first load used a reader pool"
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    bytecp.load(url, target)
    assert _readers() == first
    assert all(torch.equal(target[k], v) for k, v in state.items())


def test_a_failed_load_keeps_no_pool_and_the_next_load_works(ck: tuple[str, dict[str, torch.Tensor]]) -> None:
    url, state = ck
    data = [p for p in Path(url).rglob("*") if p.is_file() and p.stat().st_size > 1 << 20][0]
    good = data.read_bytes()
    data.write_bytes(good[:100] + bytes([good[100] ^ 0xFF]) + good[101:])
    with pytest.raises(CorruptCheckpointError):
        bytecp.load(url, {k: torch.zeros_like(v) for k, v in state.items()})
    data.write_bytes(good)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    bytecp.load(url, target)
    assert all(torch.equal(target[k], v) for k, v in state.items())


def test_concurrent_loads_each_read_their_own(ck: tuple[str, dict[str, torch.Tensor]]) -> None:
    url, state = ck
    targets = [{k: torch.zeros_like(v) for k, v in state.items()} for _ in range(3)]
    errors: list[BaseException] = []

    def load(t: dict[str, torch.Tensor]) -> None:
        try:
            bytecp.load(url, t)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=load, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert all(torch.equal(t[k], v) for t in targets for k, v in state.items())
