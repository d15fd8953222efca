"""The opened checkpoint: one listing of the data files, rows found without
asking the caller which index version the checkpoint has, and the other
ranks of a load working from what the coordinator found."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import bytecp
from bytecp.interop.export import TensorReader, select_tensors
from bytecp.loading.opened import OpenedCheckpoint, open_checkpoint
from bytecp.storage_api import Storage, open_storage
from bytecp.tools.gc import collect_garbage
from bytecp.tools.inspect import summarize, verify
from bytecp.tree.regions import Region, full_region


@pytest.fixture
def saved() -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    url = f"memory://bytecp-tests/{uuid.uuid4().hex}"
    model = {"w": torch.randn(64, 8), "b": torch.randn(8), "scalar": torch.tensor(3.0)}
    bytecp.save(url, {"model": model})
    yield url, model


def counting(storage: Storage) -> dict[str, int]:
    """Count the storage's listings and metadata reads (instance attributes shadow its methods)."""
    calls = {"file_sizes": 0, "metadata": 0}
    file_sizes, read_bytes = storage.file_sizes, storage.read_bytes

    def count_sizes(prefix: str = "") -> dict[str, int]:
        calls["file_sizes"] += 1
        return file_sizes(prefix)

    def count_reads(path: str, *args: Any) -> bytes:
        calls["metadata"] += path == "metadata.json"
        return read_bytes(path, *args)

    storage.file_sizes = count_sizes  # type: ignore[method-assign]
    storage.read_bytes = count_reads  # type: ignore[method-assign]
    return calls


def test_inspect_and_verify_list_the_data_files_once(saved: tuple[str, dict[str, torch.Tensor]]) -> None:
    url, _ = saved
    for tool in (summarize, lambda s: verify(s, io_threads=1)):
        storage = open_storage(url)
        calls = counting(storage)
        tool(storage)
        assert calls == {"file_sizes": 1, "metadata": 1}


def test_gc_lists_without_reading_the_index(saved: tuple[str, dict[str, torch.Tensor]]) -> None:
    url, _ = saved
    storage = open_storage(url)
    storage.write_file("data/20200101T000000-dead/0-0.bin", [b"x"])
    opened = open_checkpoint(storage)
    assert "data/20200101T000000-dead/0-0.bin" in opened.stored_files()
    assert collect_garbage(storage).removed == ["data/20200101T000000-dead/0-0.bin"]


def test_rows_for_boxes_and_all_rows_agree(saved: tuple[str, dict[str, torch.Tensor]]) -> None:
    url, model = saved
    opened = open_checkpoint(url)
    opened.check_sizes()
    every = opened.all_rows()
    assert {c.fqn for c in every} == {f"model.{k}" for k in model}
    box = Region((8, 0), (16, 8))
    got = opened.rows_for({"model.w": [box]})
    assert got.rows and {c.fqn for c in got.rows} == {"model.w"}
    assert got.files >= 1  # version 2: the segments the box meets were read
    assert all(Region(c.offsets, c.lengths).intersect(box) is not None for c in got.rows)


def test_other_ranks_neither_list_nor_reread_metadata(saved: tuple[str, dict[str, torch.Tensor]]) -> None:
    """What a load's coordinator broadcasts is enough for every other rank."""
    url, model = saved
    coordinator = open_checkpoint(url)
    coordinator.check_sizes()
    shared = coordinator.share()
    storage = open_storage(url)
    calls = counting(storage)
    rank = OpenedCheckpoint.received(storage, shared)
    rows = rank.rows_for({"model.w": [full_region((64, 8))]}).rows
    assert calls == {"file_sizes": 0, "metadata": 0}
    assert sum(c.nbytes for c in rows) == model["w"].numel() * 4


def test_export_reads_through_the_opened_checkpoint(saved: tuple[str, dict[str, torch.Tensor]]) -> None:
    url, model = saved
    opened = open_checkpoint(url)
    items, _ = select_tensors(opened.metadata, url)
    got = {it.name: t for it, t in TensorReader(opened).read(items)}
    assert got.keys() == model.keys()
    assert all(torch.equal(got[k], model[k]) for k in model)
