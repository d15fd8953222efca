"""Version-4 indexes of several parts (FORMAT.md §5.6): crafted damage is
refused with one line naming the file at fault, by ``load_state_dict``,
``bytecp verify`` and ``bytecp inspect``; a real 3-rank save loads bitwise
in one process and resharded on 2 ranks, each rank reading only the
segments its boxes meet.

The damaged checkpoints are rewritten in one process: a one-process save,
whose rows are then given to four fake ranks (row shards of ``w``) and laid
out again with :mod:`bytecp.format.parts_build`, as four saving ranks would.
"""

from __future__ import annotations

import io
import itertools
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import bytecp
from bytecp.cli import main as cli
from bytecp.format import metadata as fmt
from bytecp.format import parts_fetch, parts_read, segment_wire
from bytecp.format.checksum import crc32c
from bytecp.format.chunk_batch import ChunkBatch
from bytecp.format.parts_build import build_directory, build_part
from bytecp.format.parts_schema import (
    BAND_ENTRY_SCHEMA,
    PART_SCHEMA,
    WIDE_ENTRY_SCHEMA,
    buckets_for,
    part_file,
)
from bytecp.loading.opened import open_checkpoint
from bytecp.tree.regions import Region
from bytecp.tree.state import Shard, TensorLeaf

from .index_tools import encode_segment, index_rows, segment_table

pytestmark = pytest.mark.timeout(300)
RANKS = 4


def _state() -> dict[str, Any]:
    """``w``: 64 boxes of 4 rows, 16 of 1024 elements each (banded);
    ``v``: one whole box (wide); a 0-dim tensor."""
    w = torch.arange(1024, dtype=torch.int32).reshape(256, 4)
    return {
        "w": TensorLeaf((256, 4), torch.int32, [Shard(Region((i, 0), (4, 4)), w[i : i + 4]) for i in range(0, 256, 4)]),
        "v": torch.linspace(-1, 1, 64).reshape(8, 8),
        "s": torch.tensor(7, dtype=torch.int64),
    }


def _want() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(1024, dtype=torch.int32).reshape(256, 4),
            "v": torch.linspace(-1, 1, 64).reshape(8, 8), "s": torch.tensor(7, dtype=torch.int64)}


def _md(ck: Path) -> dict[str, Any]:
    return json.loads((ck / "metadata.json").read_text())


def _write_md(ck: Path, md: dict[str, Any]) -> None:
    (ck / "metadata.json").write_text(json.dumps(md))


def multi_part(ck: Path) -> None:
    """Save ``_state()`` at ``ck`` and rewrite its index as the parts of
    :data:`RANKS` ranks: rank ``r`` the rows ``64r..64r+63`` of ``w``, the
    last rank also ``v`` and ``s``."""
    bytecp.save(str(ck), _state())
    as_parts(ck, lambda c, r: c.offsets[0] // 64 == r if c.fqn == "w" else r == RANKS - 1)


def as_parts(ck: Path, holds: Callable[[fmt.ChunkRecord, int], bool]) -> None:
    """Rewrite the index of the checkpoint at ``ck`` as the parts of
    :data:`RANKS` ranks, rank ``r`` the rows ``holds(row, r)``."""
    opened = open_checkpoint(str(ck))
    md = opened.metadata
    rows, _ = parts_read.read_parts(opened.storage, md, None)
    sid = md.save_id
    for r in md.index.ranks:  # type: ignore[union-attr]
        (ck / part_file(sid, r)).unlink()
    buckets = buckets_for(RANKS)
    entries = []
    for r in range(RANKS):
        mine = [c for c in rows if holds(c, r)]
        tensors = {c.fqn: md.tensors[c.fqn] for c in mine}
        part = build_part(ChunkBatch.of(mine), tensors, md.data_files, sid, r, buckets)
        (ck / part_file(sid, r)).write_bytes(b"".join(part.blobs))
        entries.append(part.entries)
    pages, directory = build_directory(entries, sid, buckets, md.tensors)
    (ck / directory.file).write_bytes(b"".join(pages))
    raw = _md(ck)
    raw["index"] = directory.to_json()
    _write_md(ck, raw)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ck = tmp_path_factory.mktemp("parts") / "ck"
    multi_part(ck)
    return ck


@pytest.fixture
def ck(pristine: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ck"
    shutil.copytree(pristine, dst)
    return dst


# ----------------------------------------------------------------- directory surgery
def read_directory(ck: Path) -> dict[str, list[list[dict[str, Any]]]]:
    """The directory's entries, page by page: {"band": [[entry, ...], ...], "wide": [...],
    "scalar": [[row, ...]]} (scalar pages: rows of 0-dim chunks)."""
    md = _md(ck)
    raw = (ck / md["index"]["directory"]["file"]).read_bytes()
    out: dict[str, list[list[dict[str, Any]]]] = {}
    for kind in ("band", "wide", "scalar"):
        col = md["index"][f"{kind}_pages"]
        out[kind] = [pq.ParquetFile(pa.BufferReader(raw[o : o + n])).read().to_pylist()
                     for o, n in zip(col["offset"], col["nbytes"], strict=True)]
    return out


def write_directory(ck: Path, pages: dict[str, list[list[dict[str, Any]]]]) -> None:
    """Write the pages (entries edited as an attacker would) with valid crc32c
    and page bounds in metadata.json."""
    md = _md(ck)
    sid = md["save_id"].encode()
    blobs: list[bytes] = []
    for kind, schema, a, b in (("band", BAND_ENTRY_SCHEMA, "lo", "hi"), ("wide", WIDE_ENTRY_SCHEMA, "first", "last"),
                               ("scalar", PART_SCHEMA, "fqn", "fqn")):
        schema = schema.with_metadata({**(schema.metadata or {}), b"bytecp.save_id": sid})
        lo, hi = ("first", "last") if kind != "band" else ("lo", "hi")
        col: dict[str, list[Any]] = {lo: [], hi: [], "offset": [], "nbytes": [], "rows": [], "crc32c": []}
        for entries in pages[kind]:
            sink = io.BytesIO()
            pq.write_table(pa.Table.from_pylist(entries, schema=schema), sink)
            blob = sink.getvalue()
            col[lo].append(entries[0][a])
            col[hi].append(max(e[b] for e in entries))
            col["offset"].append(sum(len(x) for x in blobs))
            col["nbytes"].append(len(blob))
            col["rows"].append(len(entries))
            col["crc32c"].append(crc32c(blob))
            blobs.append(blob)
        md["index"][f"{kind}_pages"] = col
    (ck / md["index"]["directory"]["file"]).write_bytes(b"".join(blobs))
    md["index"]["directory"]["nbytes"] = sum(len(x) for x in blobs)
    _write_md(ck, md)


def _flip(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0xFF
    path.write_bytes(bytes(raw))


def _entries_of(pages: dict[str, list[list[dict[str, Any]]]], rank: int) -> list[dict[str, Any]]:
    """Rank ``rank``'s segments: one entry of each (the first naming it, for a wide one)."""
    got: dict[int, dict[str, Any]] = {}
    for kind in ("band", "wide"):
        for page in pages[kind]:
            for e in page:
                if e["rank"] == rank:
                    got.setdefault(e["offset"], e)
    return [got[o] for o in sorted(got)]


# ----------------------------------------------------------------- the damage
def missing_part(ck: Path) -> str:
    f = part_file(_md(ck)["save_id"], 2)
    (ck / f).unlink()
    return f


def damaged_segment(ck: Path) -> str:
    f = part_file(_md(ck)["save_id"], 1)
    e = _entries_of(read_directory(ck), 1)[-1]
    _flip(ck / f, e["offset"] + e["nbytes"] // 2)
    return f


def damaged_page(ck: Path) -> str:
    md = _md(ck)
    col = md["index"]["band_pages"]
    _flip(ck / md["index"]["directory"]["file"], col["offset"][0] + col["nbytes"][0] // 2)
    return md["index"]["directory"]["file"]


def overlapping_segments(ck: Path) -> str:
    pages = read_directory(ck)
    rank = max(_md(ck)["index"]["parts"]["rank"], key=lambda r: len(_entries_of(pages, r)))
    first, second = _entries_of(pages, rank)[:2]
    second["offset"] = first["offset"] + first["nbytes"] // 2  # inside the part, over the first
    write_directory(ck, pages)
    return part_file(_md(ck)["save_id"], rank)


def past_the_end(ck: Path) -> str:
    pages = read_directory(ck)
    last = _entries_of(pages, 3)[-1]
    last["nbytes"] += 100
    write_directory(ck, pages)
    return _md(ck)["index"]["directory"]["file"]


def from_another_save(ck: Path) -> str:
    """Rank 1's part of another save of the same state at another location:
    sizes and crc32c of the directory fixed, so only the save id tells."""
    other = ck.parent / "other"
    multi_part(other)
    md = _md(ck)
    shutil.copyfile(other / part_file(_md(other)["save_id"], 1), ck / part_file(md["save_id"], 1))
    theirs = _entries_of(read_directory(other), 1)
    pages = read_directory(ck)
    for e, t in zip(_entries_of(pages, 1), theirs, strict=True):
        e.update({k: t[k] for k in ("offset", "nbytes", "rows", "crc32c")})
    write_directory(ck, pages)
    md = _md(ck)
    md["index"]["parts"]["nbytes"][1] = _md(other)["index"]["parts"]["nbytes"][1]
    _write_md(ck, md)
    return part_file(md["save_id"], 1)


def row_outside_its_bands(ck: Path) -> str:
    pages = read_directory(ck)
    e = next(e for e in _entries_of(pages, 2) if "lo" in e and e["hi"] > e["lo"])
    e["hi"] = e["lo"]  # its rows meet more bands than the entry now says
    write_directory(ck, pages)
    return part_file(_md(ck)["save_id"], 2)


def ranks_not_ascending(ck: Path) -> str:
    md = _md(ck)
    parts = md["index"]["parts"]
    parts["rank"][0], parts["rank"][1] = parts["rank"][1], parts["rank"][0]
    parts["nbytes"][0], parts["nbytes"][1] = parts["nbytes"][1], parts["nbytes"][0]
    _write_md(ck, md)
    return "metadata.json"


def scalar_page_with_a_shaped_row(ck: Path) -> str:
    """A row of ``w`` (2-d) moved into the scalar page (and out of its part's entry)."""
    pages = read_directory(ck)
    e = _entries_of(pages, 0)[0]
    part = ck / part_file(_md(ck)["save_id"], 0)
    row = segment_table(part.read_bytes()[e["offset"] : e["offset"] + e["nbytes"]]).to_pylist()[0]
    pages["scalar"][0] = sorted([*pages["scalar"][0], row], key=lambda r: r["fqn"])
    write_directory(ck, pages)
    return _md(ck)["index"]["directory"]["file"]


def scalar_listed_twice(ck: Path) -> str:
    pages = read_directory(ck)
    pages["scalar"][0] = pages["scalar"][0] * 2
    write_directory(ck, pages)
    return _md(ck)["index"]["directory"]["file"]


def wide_entries_disagree(ck: Path) -> str:
    """A second entry for rank 3's wide segment (naming ``w``) with another checksum."""
    pages = read_directory(ck)
    (e,) = [x for page in pages["wide"] for x in page]
    pages["wide"][0] = [e, {**e, "first": "w", "last": "w", "crc32c": e["crc32c"] ^ 1}]
    write_directory(ck, pages)
    return _md(ck)["index"]["directory"]["file"]


def wide_row_not_named(ck: Path) -> str:
    """Rank 3's wide segment (the rows of ``v``) named as if it held ``w``."""
    pages = read_directory(ck)
    (e,) = [x for page in pages["wide"] for x in page]
    e["first"] = e["last"] = "w"
    write_directory(ck, pages)
    return part_file(_md(ck)["save_id"], 3)


def zero_dim_row_in_a_part(ck: Path) -> str:
    """The row of ``s`` written as a band segment at the end of rank 0's part
    (band 0, where ``w``'s first rows are), and no scalar page."""
    md = _md(ck)
    pages = read_directory(ck)
    (row,) = pages["scalar"][0]
    blob = encode_segment([row], md["save_id"])
    part = ck / part_file(md["save_id"], 0)
    size = part.stat().st_size
    part.write_bytes(part.read_bytes() + blob)
    pages["band"][0].insert(0, {"lo": 0, "hi": 0, "rank": 0, "offset": size, "nbytes": len(blob), "rows": 1,
                                "crc32c": crc32c(blob)})
    pages["scalar"] = []
    write_directory(ck, pages)
    md = _md(ck)
    md["index"]["parts"]["nbytes"][0] = size + len(blob)
    _write_md(ck, md)
    return part_file(md["save_id"], 0)


def scalar_pages_overlap(ck: Path) -> str:
    md = _md(ck)
    col = md["index"]["scalar_pages"]
    for k in col:  # the one page listed twice: same names, overlapping bytes
        col[k] = col[k] * 2
    _write_md(ck, md)
    return "metadata.json"


DAMAGE: dict[str, Callable[[Path], str]] = {f.__name__: f for f in (
    missing_part, damaged_segment, damaged_page, overlapping_segments, past_the_end, from_another_save,
    row_outside_its_bands, ranks_not_ascending, scalar_page_with_a_shaped_row, scalar_listed_twice,
    wide_entries_disagree, wide_row_not_named, zero_dim_row_in_a_part, scalar_pages_overlap)}


def test_pristine_multi_part_loads(pristine: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _md(pristine)["index"]["parts"]["rank"] == list(range(RANKS))
    got = bytecp.load_state_dict(str(pristine))
    for k, v in _want().items():
        assert torch.equal(got[k], v), k
    assert cli(["verify", str(pristine)]) == 0 and cli(["inspect", str(pristine)]) == 0
    capsys.readouterr()


PHRASE = {"ranks_not_ascending": "ranks out of order", "scalar_pages_overlap": "scalar pages whose names overlap"}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_parts_refused_in_one_line(ck: Path, damage: str, capsys: pytest.CaptureFixture[str]) -> None:
    """(``PHRASE``: damage to metadata.json, which other checks name too: the words of the one that must catch it)"""
    name = DAMAGE[damage](ck)
    with pytest.raises(bytecp.CorruptCheckpointError) as e:
        bytecp.load_state_dict(str(ck))
    msg = str(e.value)
    assert "\n" not in msg and name in msg and PHRASE.get(damage, name) in msg, msg
    for cmd in ("verify", "inspect"):
        capsys.readouterr()
        assert cli([cmd, str(ck)]) != 0
        out = capsys.readouterr()
        lines = [ln for ln in (out.err + out.out).splitlines() if name in ln]
        assert len(lines) == 1, (cmd, out.err, out.out)
        assert "Traceback" not in out.err, out.err


def test_parts_read_at_once_in_rank_order(ck: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """From a remote storage the parts are read several at a time: the rows come
    in the same order as one at a time, and with two parts damaged the error
    names the lower rank's, every time, with no reader thread left behind."""
    import threading

    opened = open_checkpoint(str(ck))
    rows, n = parts_read.read_parts(opened.storage, opened.metadata, None)  # a local disk: one at a time
    monkeypatch.setattr(opened.storage, "remote", True, raising=False)  # read as from S3: all 4 at once
    read, threads = parts_read._decode_segments, set()
    both, calls = threading.Barrier(2, timeout=60), itertools.count()

    def on_thread(*a: Any) -> Any:
        name = threading.current_thread().name
        threads.add(name)
        if name.startswith("bytecp-index") and next(calls) < 2:  # the pool's first two reads wait for each
            both.wait()  # other: they run at once, or time out
        return read(*a)

    monkeypatch.setattr(parts_read, "_decode_segments", on_thread)
    assert parts_read.read_parts(opened.storage, opened.metadata, None) == (rows, n)
    assert len({t for t in threads if t.startswith("bytecp-index")}) >= 2, threads  # (one part alone: here)
    sid, pages = _md(ck)["save_id"], read_directory(ck)
    for r in (2, 1):  # (band segments both: the wide ones, rank 3's, are read first)
        e = _entries_of(pages, r)[-1]
        _flip(ck / part_file(sid, r), e["offset"] + e["nbytes"] // 2)
    for _ in range(5):
        with pytest.raises(bytecp.CorruptCheckpointError, match=part_file(sid, 1)):
            parts_read.read_parts(opened.storage, opened.metadata, None)
    assert not [t for t in threading.enumerate() if t.name.startswith("bytecp-index")]


def test_parts_read_from_a_local_disk_in_one_request_per_batch(ck: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """From a local disk every part's segments come in one ``read_files`` request (a
    request is bounded by a worker thread: a hand-off per part cost more than its read),
    several when they pass ``BATCH_BYTES``; the rows are the same either way."""
    opened = open_checkpoint(str(ck))
    st = opened.storage
    calls: list[list[str]] = []
    read_files, read_ranges = st.read_files, st.read_ranges
    monkeypatch.setattr(st, "read_files", lambda reads: (calls.append([p for p, _ in reads]), read_files(reads))[1])
    monkeypatch.setattr(st, "read_ranges", lambda path, ranges: (calls.append([path]), read_ranges(path, ranges))[1])
    rows, n = parts_read.read_parts(st, opened.metadata, None)
    sid = _md(ck)["save_id"]
    parts = [c for c in calls if "directory" not in c[0]]
    # the wide segments (rank 3's), then the band segments of every rank
    assert parts == [[part_file(sid, 3)], [part_file(sid, r) for r in range(RANKS)]], calls
    calls.clear()
    monkeypatch.setattr(parts_fetch, "BATCH_BYTES", 1)  # one part a request
    assert parts_read.read_parts(st, opened.metadata, None) == (rows, n)
    assert [c for c in calls if "directory" not in c[0]] == [[f] for c in parts for f in c], calls


def test_a_failed_local_batch_names_the_lowest_ranks_fault(ck: Path) -> None:
    """A batch that fails (here: rank 2's part gone) is read again a part at a time:
    rank 1's damaged segment, lower, is the fault named, as from a remote storage."""
    opened = open_checkpoint(str(ck))
    sid, pages = _md(ck)["save_id"], read_directory(ck)
    e = _entries_of(pages, 1)[-1]
    _flip(ck / part_file(sid, 1), e["offset"] + e["nbytes"] // 2)
    (ck / part_file(sid, 2)).unlink()
    with pytest.raises(bytecp.CorruptCheckpointError, match=f"{part_file(sid, 1)} segment .*checksum mismatch"):
        parts_read.read_parts(opened.storage, opened.metadata, None)


def test_a_timed_out_part_read_is_not_called_corrupt(ck: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A transient storage error (a hung request, a dropped connection) reaches the caller as
    it is, to be retried; only a missing or short part is a corrupt index."""
    from bytecp.errors import TransientStorageError

    opened = open_checkpoint(str(ck))
    st, sid = opened.storage, _md(ck)["save_id"]
    read_ranges = st.read_ranges

    def hung(path: str, ranges: Any) -> None:
        if path == part_file(sid, 2):
            raise TransientStorageError(f"{path} (read_ranges): no answer within 0.3 s")
        read_ranges(path, ranges)

    def hung_batch(reads: Any) -> None:
        for path, ranges in reads:
            hung(path, ranges)

    monkeypatch.setattr(st, "read_ranges", hung)
    monkeypatch.setattr(st, "read_files", hung_batch)
    with pytest.raises(TransientStorageError, match=part_file(sid, 2)):
        parts_read.read_parts(st, opened.metadata, None)


def test_parts_read_at_once_stay_a_bounded_window_ahead() -> None:
    """A streaming reader (``inspect``/``verify`` over 131,072 parts) holds at most
    2 x PART_READERS parts read ahead of it, not every part."""
    import threading

    started, lock = [0], threading.Lock()

    def run(rank: int, mine: list[Any]) -> int:
        with lock:
            started[0] += 1
        return rank

    got = parts_fetch._at_once([(r, []) for r in range(200)], 4, run)
    for i, rank in enumerate(got):
        assert rank == i
        with lock:
            assert started[0] <= i + 1 + 2 * 4, (i, started[0])


# ----------------------------------------------------------------- a real 3-rank save
SHAPES = {"a": ((96, 8), torch.float32), "b": ((31, 5), torch.bfloat16), "emb": ((3072, 2), torch.int16)}


def _full(fqn: str) -> torch.Tensor:
    if fqn == "r":
        return torch.arange(9, dtype=torch.float64).reshape(3, 3) / 7
    shape, dtype = SHAPES[fqn]
    n = shape[0] * shape[1]
    return (torch.arange(n, dtype=torch.int64) * 7919 % 32749).to(dtype).reshape(shape)


def _rows(n: int, rank: int, world: int) -> tuple[int, int]:
    """FSDP's row shard: ceil(n / world) rows per rank, the last ones short."""
    per = -(-n // world)
    return min(n, rank * per), min(n, (rank + 1) * per)


def _boxes(fqn: str, rank: int, world: int, *, columns: bool = False) -> list[Region]:
    shape = SHAPES[fqn][0]
    if columns:  # the loading ranks: column shards
        lo, hi = _rows(shape[1], rank, world)
        return [Region((0, lo), (shape[0], hi - lo))]
    lo, hi = _rows(shape[0], rank, world)
    step = 16 if fqn == "emb" else hi - lo  # emb: each rank's rows as boxes of 16 (banded rows)
    return [Region((i, 0), (min(step, hi - i), shape[1])) for i in range(lo, hi, step)]


def save_rank(url: str) -> int:
    """(each of 3 gloo ranks) Row shards of a, b, emb; r replicated."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    state: dict[str, Any] = {"r": _full("r")}
    for fqn, (shape, dtype) in SHAPES.items():
        full = _full(fqn)
        state[fqn] = TensorLeaf(shape, dtype, [Shard(b, full[b.slices()].clone()) for b in _boxes(fqn, rank, world)])
    bytecp.save(url, state)
    return rank


def load_rank(url: str) -> bool:
    """(each of 2 gloo ranks) DTensors: column shards of a, row shards of b
    and emb (torch's even chunks); r whole."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard as Split

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    target: dict[str, Any] = {"r": torch.zeros(3, 3, dtype=torch.float64)}
    want: dict[str, torch.Tensor] = {}
    for fqn, (shape, dtype) in SHAPES.items():
        dim = 1 if fqn == "a" else 0
        want[fqn] = torch.chunk(_full(fqn), world, dim)[rank]
        local = torch.full(want[fqn].shape, 3, dtype=dtype)
        target[fqn] = DTensor.from_local(local, mesh, [Split(dim)], run_check=False, shape=torch.Size(shape),
                                         stride=torch.empty(shape).stride())
    bytecp.load(url, target)
    assert torch.equal(target["r"], _full("r"))
    for fqn in SHAPES:
        assert torch.equal(target[fqn].to_local(), want[fqn]), fqn
    return True


@pytest.mark.spawn
def test_three_rank_save_loads_anywhere_reading_what_it_needs(tmp_path: Path) -> None:
    from dist.pool import WorkerPool

    url = str(tmp_path / "ck")
    pool = WorkerPool(3)
    try:
        assert pool.run(save_rank, url, timeout=180) == [0, 1, 2]
    finally:
        pool.close()
    md = _md(tmp_path / "ck")
    assert md["format_version"] == 5 and md["index"]["parts"]["rank"] == [0, 1, 2]
    assert all((tmp_path / "ck" / part_file(md["save_id"], r)).is_file() for r in range(3))
    got = bytecp.load_state_dict(url)
    for fqn in (*SHAPES, "r"):
        assert got[fqn].dtype == _full(fqn).dtype and torch.equal(got[fqn], _full(fqn)), fqn

    opened = open_checkpoint(url)
    pages = read_directory(tmp_path / "ck")
    wide_segments = {(e["rank"], e["offset"]) for page in pages["wide"] for e in page}
    total = sum(md["index"]["band_pages"]["rows"]) + len(wide_segments) + len(pages["scalar"])
    _, every = parts_read.read_parts(opened.storage, opened.metadata, None)
    assert every == total >= 3
    # a wide segment per part holds all its wide rows, and the directory names each of its tensors
    assert len(wide_segments) == 3 and sum(md["index"]["wide_pages"]["rows"]) > 3
    # a box inside rank 1's rows of emb (banded): the one or two segments of rank 1 around it
    rows, n = parts_read.read_parts(opened.storage, opened.metadata, {"emb": [Region((1030, 0), (2, 2))]})
    assert 1 <= n <= 2 and rows and all(c.fqn == "emb" and 1024 <= c.offsets[0] < 2048 for c in rows), (n, rows)
    # a box inside rank 1's rows of a: its shards are wide (a third of the tensor), so one segment of each
    # part names it; they tile the box, so none of the band segments (of emb) whose bands 426..468 meet
    # the box is read
    rows, n = parts_read.read_parts(opened.storage, opened.metadata, {"a": [Region((40, 0), (4, 8))]})
    wide = [e for page in pages["wide"] for e in page if e["first"] <= "a" <= e["last"]]
    band = [e for page in pages["band"] for e in page if e["lo"] <= 468 and 426 <= e["hi"]]
    assert len(wide) == 3 and 0 < len(band) < 10 and n == len(wide)
    # of the three wide rows read, only rank 1's meets the box's bands: the others hold none of its elements
    assert {c.offsets for c in rows} == {(32, 0)}

    pool = WorkerPool(2)
    try:
        assert pool.run(load_rank, url, timeout=180) == [True, True]
    finally:
        pool.close()


# ----------------------------------------------------------------- crafted segments (FORMAT.md §5.6, segment encoding)
def _words(blob: bytes) -> tuple[list[int], dict[str, int]]:
    """A segment's words, and where its parts start (in words): columns, dims, block checksums (encoding
    2, format version 5), string lengths, strings."""
    w = np.frombuffer(blob, "<i8", len(blob) // 8).tolist()
    n, m, f, dims = w[1:5]
    h = 7 if w[0] == segment_wire.MAGIC_BLOCKS else 6
    packed = -(-w[6] // 2) if h == 7 else 0
    at = {"name_id": h, "file_id": h + n, "ndim": h + 2 * n, "offsets": h + 6 * n, "blocks": h + 6 * n + 2 * dims}
    at["strlen"] = at["blocks"] + packed
    at["strings"] = at["strlen"] + 1 + m + f
    return w, at


def _extra_blocks(blob: bytes) -> tuple[bytes, int | None]:
    """Two block checksums more than the rows' sizes make (one word more: the segment's size agrees)."""
    w, at = _words(blob)
    w[6] += 2
    w.insert(at["strlen"], 0)
    return _pack(w[: at["strings"] + 1], blob[8 * at["strings"] :]), None


def _pack(words: list[int], tail: bytes = b"") -> bytes:
    return np.asarray(words, "<i8").tobytes() + tail


def _swap_segment(ck: Path, rank: int, change: Callable[[bytes], tuple[bytes, int | None]]) -> str:
    """Rank ``rank``'s first segment replaced by ``change(its bytes)`` -> (new bytes, rows the directory
    says or None: unchanged), appended to the part, its entry moved there with a valid crc32c (as an
    attacker would). -> the part's path."""
    md = _md(ck)
    pages = read_directory(ck)
    e = _entries_of(pages, rank)[0]
    part = ck / part_file(md["save_id"], rank)
    raw = part.read_bytes()
    blob, rows = change(raw[e["offset"] : e["offset"] + e["nbytes"]])
    for kind in ("band", "wide"):
        for page in pages[kind]:
            for x in page:
                if (x["rank"], x["offset"]) == (rank, e["offset"]):
                    x.update(offset=len(raw), nbytes=len(blob), crc32c=crc32c(blob), rows=rows or x["rows"])
    part.write_bytes(raw + blob)
    write_directory(ck, pages)
    md = _md(ck)
    md["index"]["parts"]["nbytes"][md["index"]["parts"]["rank"].index(rank)] = len(raw) + len(blob)
    _write_md(ck, md)
    return part_file(md["save_id"], rank)


def _set(key: str, k: int, value: Callable[[int], int]) -> Callable[[bytes], tuple[bytes, int | None]]:
    def change(blob: bytes) -> tuple[bytes, int | None]:
        w, at = _words(blob)
        i = at[key] + k if key in at else k
        w[i] = value(w[i])
        return _pack(w[: at["strings"]], blob[8 * at["strings"] :]), None
    return change


def _reencode(blob: bytes, *, save_id: str | None = None, extra: str | None = None,
              utf8: bool = True) -> bytes:
    seg = segment_table(blob)
    n, m, f = np.frombuffer(blob, "<i8", 3, 8).tolist()
    _, at = _words(blob)
    strings = blob[8 * at["strings"] :]
    lens = np.frombuffer(blob, "<i8", 1 + m + f, 8 * at["strlen"]).tolist()
    sid = strings[: lens[0]].decode()
    rows = seg.to_pylist()
    blocks = blob[:8] == segment_wire.MAGIC_BLOCKS.to_bytes(8, "little")
    out = encode_segment(rows, save_id or sid, blocks)
    if extra is not None:  # an unused name listed after the others (allowed): strings of chosen length
        names = sorted({r["fqn"] for r in rows})
        files = sorted({r["file"] for r in rows})
        out = segment_wire.encode(sid, [*names, extra], files, *_cols(rows, names, files),
                                  np.asarray([x for r in rows for x in r["blocks"]], np.uint32) if blocks else None)
    if not utf8:
        w, at = _words(out)
        tail = bytearray(out[8 * at["strings"] :])
        tail[w[at["strlen"]]] = 0xFF  # the first name's first byte
        out = out[: 8 * at["strings"]] + bytes(tail)
    return out


def _cols(rows: list[dict[str, Any]], names: list[str], files: list[str]) -> list[np.ndarray]:
    return [np.asarray([names.index(r["fqn"]) for r in rows]), np.asarray([files.index(r["file"]) for r in rows]),
            np.asarray([len(r["offsets"]) for r in rows]),
            *(np.asarray([r[k] for r in rows]) for k in ("byte_offset", "nbytes", "crc32c")),
            np.asarray([x for r in rows for x in r["offsets"]], np.int64),
            np.asarray([x for r in rows for x in r["lengths"]], np.int64)]


def _padded(blob: bytes) -> bytes:
    """Non-zero padding after the strings (a name added first so that there is padding)."""
    _, at = _words(blob)
    for k in range(8):
        out = _reencode(blob, extra="~" * (k + 1))
        n_str = int(np.frombuffer(out, "<i8", 1, 40)[0])  # (word 5 in either encoding)
        if n_str % 8:
            return out[:-1] + b"\x01"
    raise AssertionError("no padding")


SEGMENT_DAMAGE: dict[str, tuple[Callable[[bytes], tuple[bytes, int | None]], str]] = {
    "bad_magic": (_set("magic", 0, lambda x: x ^ 1), "is not the segment magic"),
    "negative_count": (_set("names", 2, lambda x: -1), "negative count"),
    "rows_not_the_directorys": (lambda b: (_set("rows", 1, lambda x: x + 1)(b)[0], None), "rows, the directory says"),
    "dims_past_its_bytes": (_set("dims", 4, lambda x: x + 1), "makes it"),
    "more_rows_than_its_bytes": (lambda b: (_set("rows", 1, lambda x: x + 1)(b)[0],
                                            int(np.frombuffer(b, "<i8", 1, 8)[0]) + 1), "makes it"),
    "directory_rows_differ": (lambda b: (b, int(np.frombuffer(b, "<i8", 1, 8)[0]) + 1), "the directory says"),
    "name_id_out_of_range": (_set("name_id", 0, lambda x: 99), "names tensor 99 of its"),
    "file_id_out_of_range": (_set("file_id", 0, lambda x: -1), "names file -1 of its"),
    "ndim_negative": (_set("ndim", 0, lambda x: -1), "has -1 dimensions"),
    "ndim_over_the_limit": (_set("ndim", 0, lambda x: 65), "has 65 dimensions"),
    "ndim_sum_differs": (_set("ndim", 0, lambda x: x - 1), "dimensions in all, its header says"),
    "negative_offset": (_set("offsets", 0, lambda x: -5), "has offset -5"),
    "string_length_overflows": (_set("strlen", 1, lambda x: 1 << 62), "outside its"),
    "string_lengths_differ": (_set("strlen", 1, lambda x: x + 1), "string lengths add up to"),
    "not_utf8": (lambda b: (_reencode(b, utf8=False), None), "is not UTF-8"),
    "trailing_bytes": (lambda b: (b + bytes(8), None), "trailing bytes"),
    "another_save": (lambda b: (_reencode(b, save_id="another-save"), None), "belongs to save 'another-save'"),
    "nonzero_padding": (lambda b: (_padded(b), None), "padding after its strings is not zero"),
    "not_words": (lambda b: (b[:-3], None), "are not a segment"),
    "block_checksums_not_the_rows'": (_extra_blocks, "block checksums (one per"),
}


@pytest.mark.parametrize("damage", list(SEGMENT_DAMAGE))
def test_crafted_segments_refused_in_one_line(ck: Path, damage: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Each refusal of the segment decoder: one line naming the part and the segment's bytes, no
    allocation from the crafted counts (the crc32c and the directory were fixed, as an attacker would)."""
    change, phrase = SEGMENT_DAMAGE[damage]
    name = _swap_segment(ck, 1, change)
    with pytest.raises(bytecp.CorruptCheckpointError) as e:
        bytecp.load_state_dict(str(ck))
    msg = str(e.value)
    assert "\n" not in msg and f"{name} segment at bytes" in msg and phrase in msg, msg
    capsys.readouterr()
    assert cli(["verify", str(ck)]) != 0
    out = capsys.readouterr()
    assert len([ln for ln in (out.err + out.out).splitlines() if name in ln]) == 1, (out.err, out.out)


def test_segment_records_only_of_wanted_tensors(ck: Path) -> None:
    """Rows of tensors not wanted are dropped before any record is built; a row naming a tensor
    metadata.json lacks is refused even when not wanted."""
    md = open_checkpoint(str(ck)).metadata
    rows = index_rows(ck).to_pylist()
    both = [r for r in rows if r["fqn"] == "v"] + [r for r in rows if r["fqn"] == "w"][:3]
    seg = segment_wire.decode("seg", encode_segment(both, md.save_id), len(both), md.save_id)
    got = segment_wire.to_records(seg, md, "seg", {"v"})
    assert [c.fqn for c in got] == ["v"] and got[0].global_shape == (8, 8)
    assert len(segment_wire.to_records(seg, md, "seg", None)) == 4
    ghost = [*both, {**both[0], "fqn": "ghost"}]
    seg = segment_wire.decode("seg", encode_segment(ghost, md.save_id), len(ghost), md.save_id)
    with pytest.raises(bytecp.CorruptCheckpointError, match="seg: a row names tensor 'ghost', which metadata.json lacks"):
        segment_wire.to_records(seg, md, "seg", {"v"})


def test_scalar_page_rows_only_of_wanted_tensors(ck: Path) -> None:
    """A scalar page's rows, checked on columns, are built only for the tensors wanted, as every row read alone."""
    opened = open_checkpoint(str(ck))
    every, _ = parts_read.read_parts(opened.storage, opened.metadata, None)
    rows, n = parts_read.read_parts(opened.storage, opened.metadata, {"s": [Region((), ())]})
    assert rows == [c for c in every if c.fqn == "s"] and rows[0].global_shape == () and n == 1
    rows, _ = parts_read.read_parts(opened.storage, opened.metadata, {"v": [Region((0, 0), (8, 8))]})
    assert rows and all(c.fqn == "v" for c in rows)


def test_a_ranks_band_rows_are_cut_across_gaps() -> None:
    """``build_part``'s band segments: at most ``limit`` bands from their
    first row, no gap of more than ``limit / 16`` bands between two rows
    once a segment has 16 (a rank's rows of tensors sharded differently lie
    apart: one segment over both would be read by every reader between),
    at once across a gap of more than ``limit`` (or ``4 * limit`` from the first row)."""
    from bytecp.format.parts_build import _cut_bands

    def cut(lo: list[int], limit: int = 4096) -> list[list[int]]:
        return [g.tolist() for g in _cut_bands(np.arange(len(lo)), np.asarray(lo), limit)]

    assert cut([100] * 20 + [401]) == [list(range(20)), [20]]  # 301 > 4096 / 16 bands after 20 rows
    assert cut([100] * 20 + [356]) == [list(range(21))]  # 256: not more
    assert cut([100] * 5 + [401]) == [list(range(6))]  # 5 rows: kept together
    assert cut([100] * 5 + [100 + 4097]) == [list(range(5)), [5]]  # far apart: cut at once
    assert cut([100] * 5 + [100 + 4097 + i for i in range(30)]) == [list(range(5)), list(range(5, 35))]
    steady = [100 + 200 * i for i in range(30)]  # no gap over 256, but 4,096 bands from the first
    assert cut(steady) == [list(range(21)), list(range(21, 30))]
    assert cut([100] * 20 + [164], limit=512) == [list(range(21))]  # 64 bands at least (512 / 16 = 32)
    assert cut([100] * 20 + [165], limit=512) == [list(range(20)), [20]]
