"""The version-4 commit beyond the exact check's world size: each rank checks
its own chunks, the coordinator that together they hold every element once.

Jobs of more than ``EXACT_CHECK_RANKS`` ranks send the coordinator only
their part entries; here the limit is lowered to 0 so that a one-process
save takes that path.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import bytecp
from bytecp.errors import ConfigError
from bytecp.format import parts_build, parts_wire
from bytecp.format.chunk_batch import fqn_hash
from bytecp.saving import writer


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 8, generator=g), "b": torch.randn(8, generator=g), "s": torch.tensor(3.0)}


def test_a_save_past_the_exact_check_commits_and_loads_bitwise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer, "EXACT_CHECK_RANKS", 0)
    state = _state()
    bytecp.save(str(tmp_path / "ck"), state)
    got = bytecp.load_state_dict(str(tmp_path / "ck"))
    assert set(got) == set(state) and all(torch.equal(got[k], v) for k, v in state.items())


def test_parts_that_do_not_add_up_are_never_committed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that lost a chunk (its part holds one element fewer): the
    coordinator's sum differs from the tensors' and nothing is committed."""
    monkeypatch.setattr(writer, "EXACT_CHECK_RANKS", 0)
    real = parts_build.build_part

    def short(*args, **kwargs):  # type: ignore[no-untyped-def]
        part = real(*args, **kwargs)
        part.entries.elements -= 1
        return part

    monkeypatch.setattr(writer, "build_part", short)
    with pytest.raises(ConfigError, match=r"chunks hold 520 elements, the state.s tensors 521") as e:
        bytecp.save(str(tmp_path / "ck"), _state())
    assert "\n" not in str(e.value)
    assert not (tmp_path / "ck" / "metadata.json").exists()
    assert not any((tmp_path / "ck").rglob("*.bin")), list((tmp_path / "ck").rglob("*"))


# ----------------------------------------------------------------- the entries' wire form
def _entries(rank: int, **kw: object) -> parts_wire.PartEntries:
    base: dict[str, object] = dict(rank=rank, nbytes=300, elements=10, lo=[3], hi=[5], offset=[0, 100],
                                   size=[100, 200], rows=[2, 3], crc=[7, 8], names=["b", "w"], name_seg=[0, 0],
                                   scalars=[parts_wire.Scalar("s", "data/x/é-0.bin", 4096, 4, 9)])
    return parts_wire.PartEntries(**(base | kw))  # type: ignore[arg-type]


def test_part_entries_decode_together_as_they_were_built() -> None:
    a, b, empty = _entries(5), _entries(2, scalars=[], names=["w"], name_seg=[0]), parts_wire.PartEntries(9)
    cols = parts_wire.decode_all([a.encode(), empty.encode(), b.encode()])
    assert cols.rank.tolist() == [2, 5] and cols.nbytes.tolist() == [300, 300] and cols.elements == 20  # ascending
    assert cols.band["lo"].tolist() == [3, 3] and cols.band["rank"].tolist() == [5, 2]
    assert cols.band["offset"].tolist() == [0, 0] and cols.band["crc32c"].tolist() == [7, 7]
    table = parts_wire.NameTable(["w", "b", "s"])
    assert [table.names[i] for i in table.ids(cols.wide["name"], lambda i: -1, "x")] == ["b", "w", "w"]
    seg = cols.wide["seg"]
    assert cols.segments["rank"][seg].tolist() == [5, 5, 2] and cols.segments["offset"][seg].tolist() == [100] * 3
    assert cols.segments["rows"][seg].tolist() == [3, 3, 3] and cols.segments["named"].tolist() == [1, 2, 1, 1]
    sc = cols.scalars
    assert len(sc) == 1 and sc.rank.tolist() == [5] and sc.hash.tolist() == [fqn_hash("s")]
    assert sc.file.to_pylist() == ["data/x/é-0.bin"] and (sc.offset.tolist(), sc.nbytes.tolist()) == ([4096], [4])
    assert sc.crc32c.tolist() == [9]
    blobs, d = parts_build.build_directory([a, b], "sid", 1024, ["b", "s", "w"])
    assert d.ranks == [2, 5] and d.scalar_pages["first"] == ["s"] and d.wide_pages["rows"] == [3]


@pytest.mark.parametrize("case, match", [
    ("truncated", "position 0 of the commit's gather"),
    ("unknown name", "rank 1: its index part lists wide rows of a tensor missing from the state"),
    ("0-dim twice", "tensor 's': ranks 1 and 2 both wrote its value"),
    ("overlap", "rank 1: its index part places two segments at overlapping bytes"),
    ("outside", "rank 1: its index part places a segment outside the part"),
    ("bands", "rank 1: its index part lists a segment outside the 1024 bands"),
    ("no name", "rank 1: its index part lists an empty segment, or a wide one naming no tensor"),
    ("bad segment", "rank 1: its index part names a wide segment it does not have"),
    ("sent twice", "rank 1: its index part was sent twice"),
])
def test_the_coordinator_refuses_entries_a_rank_got_wrong(case: str, match: str) -> None:
    one = _entries(1)
    wire = {
        "truncated": [one.encode()[:-3]],
        "unknown name": [_entries(1, names=["b", "zz"]).encode()],
        "0-dim twice": [one.encode(), _entries(2).encode()],
        "overlap": [_entries(1, offset=[0, 50]).encode()],
        "outside": [_entries(1, nbytes=299).encode()],
        "bands": [_entries(1, hi=[1024]).encode()],
        "no name": [_entries(1, names=[], name_seg=[]).encode()],
        "bad segment": [_entries(1, name_seg=[0, 1]).encode()],
        "sent twice": [one.encode(), _entries(1, scalars=[]).encode()],
    }[case]
    with pytest.raises(ConfigError, match=match) as e:
        parts_build.build_directory(wire, "sid", 1024, ["b", "s", "w"])
    assert "\n" not in str(e.value)
