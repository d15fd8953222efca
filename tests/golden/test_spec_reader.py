"""The spec reader (spec_reader.py, written from docs/FORMAT.md alone) on
checkpoints written now: every write path follows the spec, and version 4's
lookup (§5.6) finds exactly the entries a box needs in a multi-part golden."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from golden_encoding import assert_same
from spec_reader import read_segment, row_bands, spec_metadata, spec_read, v4_lookup, v4_rows

import bytecp

HERE = Path(__file__).resolve().parent


# ----------------------------------------------------------------- every write path follows the spec
def _fresh_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    state: dict[str, Any] = {
        "a": torch.randn(300, 7, generator=g),  # larger than one batch of the small budget below
        "b": torch.randint(0, 9, (5, 0), generator=g),
        "c": torch.randn(4, 6, generator=g).t(),
        "c_tied": None,  # the same tensor as "c": stored once, as an alias
        "s": torch.tensor(2.5, dtype=torch.bfloat16),
        "extra": {"step": 3, "pair": (1, "x"), "inf": float("-inf")},
    }
    state["c_tied"] = state["c"]
    return state


@pytest.mark.parametrize(
    "how",
    ["save", "async_save", "async_save_batched", "async_save_lazy"],
)
def test_fresh_checkpoints_follow_the_spec(tmp_path: Path, how: str) -> None:
    """What today's writers produce, read with the spec reader, equals the state saved."""
    state = _fresh_state()
    url = str(tmp_path / "ck")
    if how == "save":
        bytecp.save(url, state)
    else:
        budget = 4096 if how == "async_save_batched" else None
        handle = bytecp.async_save(
            url, state, lazy=how.endswith("lazy"), memory_budget_bytes=budget
        )
        handle.wait()
    got, per_rank = spec_read(tmp_path / "ck")
    assert per_rank == {}
    assert_same(got, state)
    assert json.loads((tmp_path / "ck" / "metadata.json").read_text())["aliases"] == {"c_tied": "c"}


# ----------------------------------------------------------------- version 4's lookup (FORMAT.md §5.6)
PARTS = HERE / "v4" / "parts" / "checkpoint"
#: (tensor, offsets, lengths) -> the entries §5.6's lookup finds: (kind, lo|first, hi|last, rank|page).
#: Rank 1's band segment meets bands 4..7 only: its 0-dim ``s`` is listed in a scalar page, not at band 0;
#: its wide rows (grid, lin, rep) share one segment, named by an entry per tensor.
LOOKUPS = [
    ("tail", (998, 0), (2, 3), [("band", 1021, 1023, 1), ("wide", "tail", "tail", 0)]),
    ("lin", (8,), (2,), [("band", 0, 11, 0), ("wide", "lin", "lin", 1)]),
    ("lin", (1000,), (24,), [("band", 1021, 1023, 1), ("wide", "lin", "lin", 1)]),
    ("grid", (0, 0), (1, 4), [("band", 0, 11, 0), ("wide", "grid", "grid", 1)]),
    ("rep", (0, 0), (3, 5), [("band", 0, 11, 0), ("band", 4, 7, 1), ("wide", "rep", "rep", 1)]),  # bands 0..955
    ("s", (), (), [("scalar", "s", "s", 0)]),
]


def _key(e: dict[str, Any]) -> tuple[Any, ...]:
    if e["kind"] == "scalar":
        return (e["kind"], e["first"], e["last"], e["page"])
    return (e["kind"], e["lo"], e["hi"], e["rank"]) if e["kind"] == "band" else \
        (e["kind"], e["first"], e["last"], e["rank"])


@pytest.mark.parametrize("fqn, offsets, lengths, want", LOOKUPS, ids=[f"{x[0]}{list(x[1])}" for x in LOOKUPS])
def test_v4_lookup_reads_only_what_a_box_needs(fqn: str, offsets: tuple[int, ...], lengths: tuple[int, ...],
                                               want: list[tuple[Any, ...]]) -> None:
    """The spec reader's lookup finds these entries; bytecp reads at most as
    many segments for the same box, and every row meeting the box is among
    what either finds."""
    from bytecp.format import parts_read
    from bytecp.loading.opened import open_checkpoint
    from bytecp.tree.regions import Region

    md = spec_metadata((PARTS / "metadata.json").read_bytes())
    rows, entries = v4_rows(PARTS, md)
    box = {"offsets": list(offsets), "lengths": list(lengths)}
    found = v4_lookup(md, entries, fqn, box)
    assert [_key(e) for e in found] == want
    lo, hi = row_bands(box, md["tensors"][fqn]["shape"], md["index"]["buckets"])
    for row in rows:  # a row meeting the box is listed by one of the entries found
        meets = row["fqn"] == fqn and all(
            o < bo + bn and bo < o + n
            for o, n, bo, bn in zip(row["offsets"], row["lengths"], offsets, lengths, strict=True))
        assert not meets or row["entry"] in found, row
    ck = open_checkpoint(str(PARTS))
    got, segments = parts_read.read_parts(ck.storage, ck.metadata, {fqn: [Region(offsets, lengths)]})
    # bytecp reads at most as many (none of the band entries for a box its wide rows tile, §5.6)
    assert segments <= len(found)
    assert {c.fqn for c in got} == {fqn}
    meeting = {(tuple(r["offsets"]), tuple(r["lengths"])) for r in rows if r["fqn"] == fqn and all(
        o < bo + bn and bo < o + n for o, n, bo, bn in zip(r["offsets"], r["lengths"], offsets, lengths, strict=True))}
    assert meeting <= {(c.offsets, c.lengths) for c in got}
    assert lo <= hi


def test_spec_reader_refuses_malformed_segments() -> None:
    """The spec reader's segment checks (FORMAT.md §5.6, Segment encoding) on a golden segment
    damaged as a crafted one would be (the CRC-32C recomputed): each is refused."""
    import crc32c

    md = spec_metadata((PARTS / "metadata.json").read_bytes())
    rows, entries = v4_rows(PARTS, md)
    e = next(x for x in entries if x["kind"] == "band")
    part = (PARTS / f"index/{md['save_id']}/{e['rank']}.bin").read_bytes()
    seg = part[e["offset"] : e["offset"] + e["nbytes"]]
    assert read_segment(seg, 0, len(seg), crc32c.crc32c(seg), e["rows"], md["save_id"])

    def word(k: int, value: int) -> bytes:
        return seg[: 8 * k] + value.to_bytes(8, "little", signed=True) + seg[8 * k + 8 :]

    n = e["rows"]
    for bad in (seg + bytes(8), word(0, 1), word(1, n + 1), word(3, -1), word(6, 99), word(6 + 2 * n, 65),
                seg[:-1] + b"\x01" if seg[-1] == 0 else word(5, 10**6)):
        rows_said = n + 1 if bad == word(1, n + 1) else n
        with pytest.raises(AssertionError):
            read_segment(bad, 0, len(bad), crc32c.crc32c(bad), rows_said, md["save_id"])
    with pytest.raises(AssertionError):
        read_segment(seg, 0, len(seg), crc32c.crc32c(seg), n, "another-save")
