"""``inspect`` and ``verify`` of a version-4 checkpoint read its index a
part at a time (:func:`bytecp.format.parts_stream.iter_parts`): the same
report as reading every row at once, and the same refusals, with the
exact tiling check up to ``EXACT_ROWS`` rows and per-part checks beyond."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import bytecp
from bytecp.format import metadata as fmt
from bytecp.format import parts_stream
from bytecp.loading.opened import open_checkpoint
from bytecp.storage_api import open_storage
from bytecp.tools import inspect as tools

from .index_tools import index_rows, rewrite_index

PARTS = Path(__file__).parents[1] / "golden" / "v4" / "parts" / "checkpoint"


@pytest.fixture(params=[tools.EXACT_ROWS, 0, 3], ids=["exact", "per-part", "exact-then-per-part"])
def exact_rows(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(tools, "EXACT_ROWS", request.param)
    return int(request.param)


def test_a_part_at_a_time_reports_what_every_row_at_once_does(tmp_path: Path, exact_rows: int) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(PARTS, ck)
    st = open_storage(str(ck))
    opened = open_checkpoint(st)
    every = opened.all_rows()
    listed, batches = parts_stream.iter_parts(st, opened.metadata)
    got = list(batches)
    d = opened.metadata.index
    assert len(got) == len(d.ranks) + 1  # one batch per part, then the scalar pages' rows
    assert listed == len(every) and sorted(map(str, every)) == sorted(str(c) for b in got for c in b)
    summary = tools.summarize(st)
    assert summary["totals"]["chunks"] == len(every)
    assert {f: t["chunks"] for f, t in summary["tensors"].items()} == {
        f: sum(c.fqn == f for c in every) for f in opened.metadata.tensors}
    checked, problems = tools.verify(st)
    assert not problems and checked == sum(c.nbytes for c in every) + sum(
        r.nbytes for r in opened.metadata.objects.values() if r.is_blob)


def test_a_damaged_byte_is_found_either_way(tmp_path: Path, exact_rows: int) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(PARTS, ck)
    data = sorted((ck / "data").rglob("*.bin"))[0]
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF
    data.write_bytes(bytes(raw))
    _, problems = tools.verify(open_storage(str(ck)))
    assert any("crc32c mismatch" in str(p) for p in problems)


@pytest.mark.parametrize("damage", ["overlap", "gap"])
def test_rows_that_do_not_tile_a_tensor_are_refused_either_way(tmp_path: Path, exact_rows: int, damage: str) -> None:
    ck = tmp_path / "ck"
    bytecp.save(str(ck), {"w": torch.arange(20.0).reshape(10, 2)}, io_threads=1)
    cols = index_rows(ck).to_pydict()
    if damage == "overlap":  # one more row: the same chunk claimed again at rows 0..4
        for k in cols:
            cols[k].append(cols[k][0])
        cols["lengths"][-1], cols["nbytes"][-1] = [5, 2], 40
    else:  # the chunk covers rows 0..4 only
        cols["lengths"][0], cols["nbytes"][0] = [5, 2], 40
    rewrite_index(ck, cols)
    st = open_storage(str(ck))
    match = "overlap" if damage == "overlap" else "chunks hold 10 of 20 elements"
    with pytest.raises(bytecp.CorruptCheckpointError, match=match):
        tools.summarize(st)
    with pytest.raises(bytecp.CorruptCheckpointError, match=match):
        tools.verify(st)
    assert fmt.METADATA_FILE in {p.name for p in ck.iterdir()}
