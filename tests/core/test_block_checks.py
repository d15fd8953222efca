"""Block checksums (format version 5): a load checks every byte it places,
resharded or not.

A chunk over one block records the crc32c of each block; a load that reads
part of a chunk reads the whole blocks it meets (at most one block more at
each edge) and checks each; a byte flipped inside what a load reads is
refused naming the file, the tensor and the region, and the same flip
outside it is not that load's business (``bytecp verify`` finds it). Older
checkpoints record no block checksums and load as before.
"""

from __future__ import annotations

import dataclasses
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

import bytecp
from bytecp.errors import CorruptCheckpointError
from bytecp.format import checked_reads, checksum
from bytecp.format.checksum import Summer, block_count, block_crc, crc32c, crc32c_combine, sums
from bytecp.format.metadata import ChunkRecord
from bytecp.loading.checks import Verifier, block_bytes_of, cover
from bytecp.loading.opened import open_checkpoint
from bytecp.loading.reader import Target, execute_reads
from bytecp.plan.load_plan import plan_load
from bytecp.recorder import Trace
from bytecp.storage_api import open_storage
from bytecp.tools.inspect import verify
from bytecp.tree.regions import Region

MiB = 1 << 20
GOLDEN_V4 = Path(__file__).resolve().parents[1] / "golden" / "v4" / "plain" / "checkpoint"


@pytest.mark.parametrize("n", [0, 1, 4095, MiB, MiB + 1, 3 * MiB + 77, 4 * MiB])
def test_sums_in_one_pass_are_the_crc32c_of_the_chunk_and_of_each_block(n: int) -> None:
    data = os.urandom(n)
    got = sums(data, MiB)
    assert got.crc == crc32c(data)
    assert len(got.blocks) == 4 * block_count(n, MiB) == (4 * -(-n // MiB) if n > MiB else 0)
    for k in range(block_count(n, MiB)):
        assert block_crc(got.blocks, k) == crc32c(data[k * MiB : (k + 1) * MiB])
    rnd = random.Random(n)
    s, at = Summer(MiB), 0
    while at < n:  # fed in pieces of any size: the same sums
        step = rnd.randint(1, 700_000)
        s.update(memoryview(data)[at : at + step])
        at += step
    assert s.result() == got
    head = os.urandom(33)
    assert crc32c_combine(crc32c(head), crc32c(data), n) == crc32c(head + data)
    assert crc32c_combine(crc32c(head), crc32c(data[:MiB]), min(n, MiB)) == crc32c(head + data[:MiB])  # tabled


def test_sums_of_ranges_on_a_pool_are_the_sums_of_each_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """(the memory tier's keeper sums an adopted arena's ranges so) Pieces of whole blocks summed on
    threads and combined in order give what one pass over each range gives, at every edge."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(checksum, "PIECE_BYTES", 2 * MiB)
    data = os.urandom(9 * MiB + 5)
    ranges = [(0, 0), (3, 1), (0, MiB), (7, MiB + 1), (MiB - 1, 2 * MiB), (11, 2 * MiB + 1), (5, 7 * MiB + 3),
              (0, len(data))]
    want = [sums(data[o:o + n], MiB) for o, n in ranges]
    with ThreadPoolExecutor(3) as pool:
        assert checksum.sums_of_ranges(memoryview(data), ranges, pool, MiB) == want
    assert checksum.sums_of_ranges(memoryview(data), ranges, block_bytes=MiB) == want


def test_a_piece_that_fails_leaves_no_piece_reading_the_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    """(the keeper closes the arena's mapping after summing) The error of one piece is what is raised,
    and only once every other piece has ended: the mapping then closes."""
    import mmap
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(checksum, "PIECE_BYTES", MiB)
    real, calls, lock = checksum._crc, [0], threading.Lock()

    def crc(data: Any, value: int = 0) -> int:
        with lock:
            calls[0] += 1
            first = calls[0] == 1
        if first:
            del data  # (as the C function would: the traceback keeps no slice of the mapping)
            raise RuntimeError("the first piece fails")
        time.sleep(0.002)  # the others still run when it does
        return int(real(data, value))

    monkeypatch.setattr(checksum, "_crc", crc)
    m = mmap.mmap(-1, 8 * MiB)
    view = memoryview(m)
    with ThreadPoolExecutor(4) as pool, pytest.raises(RuntimeError, match="the first piece fails"):
        try:
            checksum.sums_of_ranges(view, [(0, 8 * MiB)], pool, 256 << 10)
        finally:
            view.release()
            m.close()  # BufferError if a piece still held a slice of it


def _chunk(data: bytes, block_bytes: int) -> ChunkRecord:
    s = sums(data, block_bytes)
    return ChunkRecord("w", "uint8", (len(data),), (0,), (len(data),), "data/x/0-0.bin", 8192, len(data), s.crc,
                       s.blocks)


def test_cover_reads_at_most_one_block_more_at_each_edge() -> None:
    c = _chunk(os.urandom(10_000), 4096)
    assert cover(c, 0, 10_000, 4096) == (0, 10_000)  # whole: the chunk's crc32c
    assert cover(c, 5000, 6000, 4096) == (4096, 8192)
    assert cover(c, 4096, 8192, 4096) == (4096, 8192)  # aligned: nothing more
    assert cover(c, 8000, 9999, 4096) == (4096, 10_000)  # the last block is shorter
    assert cover(c, 5000, 6000, None) is None  # format version 4: nothing checks a part
    small = _chunk(os.urandom(3000), 4096)
    assert not small.blocks and cover(small, 10, 20, 4096) == (0, 3000)  # one block or less: read whole


def test_a_verifiers_spans_are_its_blocks_in_file_bytes_with_their_checksums() -> None:
    """What a storage that sums as it reads is given: the cover's blocks at the
    chunk's file offset (the last one shorter) and each block's checksum; a
    whole chunk one span against its crc32c; a row short of block checksums
    (built by hand: the index decoder refuses one) wants -1, which no sum is."""
    data = os.urandom(10_000)
    c = _chunk(data, 4096)
    spans, want = Verifier(c, 4096, 10_000, 4096, "u", Region((0,), (1,))).spans(8192)
    assert spans == [8192 + 4096, 8192 + 8192, 8192 + 8192, 8192 + 10_000]
    assert want == [crc32c(data[4096:8192]), crc32c(data[8192:])] == [block_crc(c.blocks, 1), block_crc(c.blocks, 2)]
    assert Verifier(c, 0, 10_000, 4096, "u", Region((0,), (1,))).spans(8192) == ([8192, 18_192], [c.crc32c])
    short = ChunkRecord(*dataclasses.astuple(c)[:-1], c.blocks[:8])  # two of its three block checksums
    assert Verifier(short, 4096, 10_000, 4096, "u", Region((0,), (1,))).spans(8192)[1] == [block_crc(c.blocks, 1), -1]


def test_verifier_checks_each_block_as_its_last_byte_arrives() -> None:
    data = bytearray(os.urandom(10_000))
    c = _chunk(bytes(data), 4096)
    v = Verifier(c, 4096, 10_000, 4096, "file:///ck", Region((4500,), (100,)))
    for piece in (data[4096:5000], data[5000:8200], data[8200:]):
        v.feed(piece)
    v.done()
    data[9000] ^= 1
    v = Verifier(c, 4096, 10_000, 4096, "file:///ck", Region((9000,), (5,)))
    v.feed(data[4096:8192])  # block 1 is sound
    with pytest.raises(CorruptCheckpointError) as e:
        v.feed(data[8192:])
    assert str(e.value) == ("file:///ck/data/x/0-0.bin: checksum mismatch in tensor 'w' region [0:10000], block 2 "
                            "of 3 (bytes 16384..18192), read to load its region [9000:9005]; the file changed since the "
                            "save: `bytecp verify file:///ck` lists every damaged chunk, or load an earlier checkpoint")


def test_a_whole_chunk_is_summed_as_one_run_and_a_mismatch_still_names_its_block() -> None:
    """Read whole, a chunk with block checksums is checked against its own
    crc32c at done() (one sum a piece, not one a block); on a mismatch its
    blocks are summed again from the pieces fed, naming the first bad one.
    Pieces whose memory is reused before done() (a pinned slab) switch it to
    block by block, every earlier piece checked then."""
    data = bytearray(os.urandom(10_000))
    c = _chunk(bytes(data), 4096)
    v = Verifier(c, 0, 10_000, 4096, "file:///ck", Region((0,), (10_000,)))
    for at in range(0, 10_000, 3000):
        v.feed(data[at : at + 3000])
    v.done()
    data[5000] ^= 1
    v = Verifier(c, 0, 10_000, 4096, "file:///ck", Region((0,), (10_000,)))
    for at in range(0, 10_000, 3000):
        v.feed(data[at : at + 3000])  # nothing raised as the pieces arrive
    with pytest.raises(CorruptCheckpointError, match=r"region \[0:10000\], block 1 of 3 \(bytes 12288..16384\)"):
        v.done()
    v = Verifier(c, 0, 10_000, 4096, "file:///ck", Region((0,), (10_000,)))
    v.feed(data[:3000])
    with pytest.raises(CorruptCheckpointError, match=r"block 1 of 3"):
        v.feed(data[3000:6000], kept=False)  # block 1 ends in a later piece: checked once it arrives
        v.feed(data[6000:], kept=False)


def test_local_reads_call_each_as_each_range_arrives(tmp_path: Path) -> None:
    """``each(i)`` runs once range ``i`` is in and before range ``i + 1`` is
    read, in order, inside the one call (a loader sums each piece while it
    is in the CPU's cache)."""
    data = os.urandom(5 * MiB)
    (tmp_path / "f.bin").write_bytes(data)
    storage = open_storage(str(tmp_path))
    assert storage.reads_each
    bufs = [memoryview(bytearray(MiB)) for _ in range(4)]
    ranges = [(k * MiB + 7, b) for k, b in enumerate(bufs)]
    seen: list[tuple[int, bool, bool]] = []
    storage.read_ranges("f.bin", ranges, each=lambda i: seen.append(
        (i, bytes(bufs[i]) == data[i * MiB + 7 : (i + 1) * MiB + 7], i + 1 < 4 and any(bufs[i + 1]))))
    assert seen == [(0, True, False), (1, True, False), (2, True, False), (3, True, False)]
    assert not open_storage(str(tmp_path), direct=True).reads_each  # through a bounce buffer: summed after


def test_a_checked_load_splits_a_box_only_where_whole_blocks_lie_between_its_pieces() -> None:
    """Columns of a row-major chunk: without checks, a row at a time (most bytes
    between rows are not wanted); checked, rows less than a block apart are one
    span (the blocks between them are read whole anyway), rows further apart stay
    apart (no block between them is read)."""
    rows = [ChunkRecord("w", "float32", (1024, 4096), (0, 0), (1024, 4096), "f", 0, 16 * MiB, 0, bytes(4 * 16)),
            ChunkRecord("v", "float32", (16, 1 << 19), (0, 0), (16, 1 << 19), "f", 0, 32 * MiB, 0, bytes(4 * 32))]
    col = [("w", Region((0, 0), (1024, 100))), ("v", Region((0, 0), (16, 100)))]
    plain = plan_load(col, rows, itemsizes={"w": 4, "v": 4})
    checked = plan_load(col, rows, itemsizes={"w": 4, "v": 4}, block_bytes=MiB)
    assert [r.chunk for r in plain].count(0) == 1024 and [r.chunk for r in checked].count(0) == 1  # 16 KiB rows
    assert [r.chunk for r in plain].count(1) == [r.chunk for r in checked].count(1) == 16  # rows 2 MiB apart


class Counting:
    """A storage that counts the bytes read."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.read = inner, 0

    def read_ranges(self, path: str, ranges: Any, **kw: Any) -> None:
        self.read += sum(len(b) for _, b in ranges)
        self.inner.read_ranges(path, ranges, **kw)

    def read_ranges_summed(self, path: str, ranges: Any, spans: Any) -> Any:
        self.read += sum(len(b) for _, b in ranges)
        return self.inner.read_ranges_summed(path, ranges, spans)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def load_box(url: str, fqn: str, box: Region, dtype: torch.dtype, *, verify_: bool = True,
             threads: int = 4) -> tuple[torch.Tensor, int]:
    """``box`` of tensor ``fqn`` read as a load's read phase reads it; -> the box and the bytes read."""
    opened = open_checkpoint(url)
    rows = opened.rows_for({fqn: [box]}).rows
    blocks = block_bytes_of(opened.metadata) if verify_ else None
    reqs = plan_load([(fqn, box)], rows, itemsizes={fqn: dtype.itemsize}, block_bytes=blocks)
    out = torch.full(box.lengths, -1, dtype=dtype)
    storage = Counting(opened.storage)
    execute_reads(storage, rows, [Target(fqn, box, out)], reqs, io_threads=threads, verify=verify_,  # type: ignore[arg-type]
                  trace=Trace("load", url), block_bytes=blocks)
    return out, storage.read


def _flip(ck: Path, fqn: str, at: int) -> tuple[str, int]:
    """Flip a bit of byte ``at`` of tensor ``fqn``'s chunk; -> its data file and the byte's offset in it."""
    (row,) = [r for r in open_checkpoint(str(ck)).all_rows() if r.fqn == fqn]
    path = ck / row.file
    raw = bytearray(path.read_bytes())
    raw[row.byte_offset + at] ^= 0x10
    path.write_bytes(bytes(raw))
    return row.file, row.byte_offset + at


@pytest.fixture(params=["summed", "fed"])
def reads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each load test on both read paths: the local disk's compiled checked
    reads (every checked span summed by the storage as it reads it), and
    ranges fed to the checks as they arrive (every other storage's way)."""
    if request.param == "fed":
        monkeypatch.setattr(checked_reads, "_LOADED", [None])
    elif checked_reads.compiled() is None:
        pytest.skip("the compiled checked reads are not built here, or this CPU lacks SSE4.2")
    assert open_storage("/tmp").sums_reads == (request.param == "summed")
    return str(request.param)


@pytest.fixture()
def ck(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reads: str) -> tuple[Path, torch.Tensor]:
    """A tensor of 4,096,000 bytes saved at 1 MiB blocks: blocks 0..3, the last one shorter."""
    w = torch.randn(1024, 1000)
    with monkeypatch.context() as m:
        m.setattr(checksum, "BLOCK_BYTES", MiB)
        bytecp.save(str(tmp_path / "ck"), {"w": w, "b": torch.randn(10)})
    return tmp_path / "ck", w


def test_resharded_reads_are_bitwise_and_read_at_most_a_block_more_at_each_edge(ck: tuple[Path, torch.Tensor]) -> None:
    path, w = ck
    md = open_checkpoint(str(path)).metadata
    assert md.format_version == 5 and block_bytes_of(md) == MiB
    for box in (Region((100, 0), (200, 1000)), Region((0, 300), (1024, 50)), Region((1000, 0), (24, 1000)),
                Region((262, 144), (2, 1))):
        got, read = load_box(str(path), "w", box, torch.float32)
        assert torch.equal(got, w[box.slices()]), box
        first, last = box.offsets[0] * 4000, (box.offsets[0] + box.lengths[0]) * 4000
        assert read <= (last - first) + 2 * MiB, (box, read)


def test_a_flip_inside_a_block_a_resharded_load_reads_is_refused_naming_tensor_region_and_file(
        ck: tuple[Path, torch.Tensor]) -> None:
    path, w = ck
    file, at = _flip(path, "w", 150 * 4000 + 17)  # row 150: block 0, read partly by a load of rows 100..300
    with pytest.raises(CorruptCheckpointError) as e:
        load_box(str(path), "w", Region((100, 0), (200, 1000)), torch.float32)
    assert str(e.value) == (f"{path}/{file}: checksum mismatch in tensor 'w' region [0:1024, 0:1000], block 0 of 4 "
                            f"(bytes {at - 150 * 4000 - 17}..{at - 150 * 4000 - 17 + MiB}), read to load its region "
                            f"[100:300, 0:1000]; the file changed since the save: `bytecp verify {path}` lists every "
                            "damaged chunk, or load an earlier checkpoint")
    # the same flip outside what a load reads is not that load's: rows 600..800 are blocks 2 and 3
    got, _ = load_box(str(path), "w", Region((600, 0), (200, 1000)), torch.float32)
    assert torch.equal(got, w[600:800])
    # ... and bytecp verify, which reads everything, names the block
    _, problems = verify(open_storage(str(path)))
    assert len(problems) == 1 and problems[0].what == "w" and "block(s) 0 (bytes" in problems[0].message
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch in tensor 'w'"):
        bytecp.load_state_dict(str(path))  # a whole-chunk read: every block
    assert "checksum" not in str(load_box(str(path), "w", Region((100, 0), (200, 1000)), torch.float32,
                                          verify_=False)[0])  # verify=False reads it unchecked


def test_a_whole_chunk_load_names_the_block_too(ck: tuple[Path, torch.Tensor]) -> None:
    path, w = ck
    _flip(path, "w", 4_095_999)  # the last byte
    with pytest.raises(CorruptCheckpointError, match=r"region \[0:1024, 0:1000\], block 3 of 4 .* its region \[0:1024"):
        bytecp.load(str(path), {"w": torch.zeros_like(w), "b": torch.zeros(10)})
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'w' region \[0:1024, 0:1000\], block 3 of 4"):
        bytecp.load_state_dict(str(path))


def test_a_version_4_checkpoint_reads_partly_as_before_unchecked(reads: str) -> None:
    """Older checkpoints record no block checksums: a partial read is not checked (as before), and exact."""
    opened = open_checkpoint(str(GOLDEN_V4))
    assert opened.metadata.format_version == 4 and block_bytes_of(opened.metadata) is None
    row = next(r for r in opened.all_rows() if len(r.lengths) == 2 and r.lengths[0] > 1)
    dtype = getattr(torch, row.dtype)
    whole, _ = load_box(str(GOLDEN_V4), row.fqn, Region(row.offsets, row.lengths), dtype)
    part = Region((row.offsets[0] + 1, row.offsets[1]), (1, row.lengths[1]))
    got, read = load_box(str(GOLDEN_V4), row.fqn, part, dtype)
    assert torch.equal(got, whole[1:2]) and read == part.numel * dtype.itemsize  # only its own bytes


def test_the_writer_block_size_is_the_one_recorded_and_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reads: str) -> None:
    """A save at 4 KiB blocks records 4096 (a golden file uses it); readers use the value recorded."""
    bytecp.save(str(tmp_path / "default"), {"w": torch.zeros(1)})
    assert block_bytes_of(open_checkpoint(str(tmp_path / "default")).metadata) == 256 << 10  # the writer's default
    monkeypatch.setattr(checksum, "BLOCK_BYTES", 4096)
    w = torch.randn(50, 100)  # 20,000 bytes: 5 blocks
    bytecp.save(str(tmp_path / "ck"), {"w": w})
    monkeypatch.setattr(checksum, "BLOCK_BYTES", MiB)
    opened = open_checkpoint(str(tmp_path / "ck"))
    assert block_bytes_of(opened.metadata) == 4096 and len(opened.all_rows()[0].blocks) == 4 * 5
    got, read = load_box(str(tmp_path / "ck"), "w", Region((21, 0), (3, 100)), torch.float32)
    assert torch.equal(got, w[21:24]) and read == 4096  # rows 21..23: bytes 8400..9600, one block


def test_the_golden_version_5_checkpoint_is_read_and_checked_block_by_block(tmp_path: Path, reads: str) -> None:
    """tests/golden/v5/blocks, written at 4 KiB blocks: rows 10..12 of ``rows`` (bytes 4000..5200
    of its first slab) read block 0 and 1 of that chunk only; a flip in block 1 is refused, in block 2 not."""
    import shutil

    src = Path(__file__).resolve().parents[1] / "golden" / "v5" / "blocks"
    shutil.copytree(src, tmp_path / "case")
    ck = tmp_path / "case" / "checkpoint"
    full = bytecp.load_state_dict(str(ck))["rows"]
    got, read = load_box(str(ck), "rows", Region((10, 0), (3, 100)), torch.float32)
    assert torch.equal(got, full[10:13]) and read == 2 * 4096
    (row,) = [r for r in open_checkpoint(str(ck)).all_rows() if r.fqn == "rows" and r.offsets == (0, 0)]
    assert len(row.blocks) == 4 * 3
    raw = bytearray((ck / row.file).read_bytes())
    raw[row.byte_offset + 9000] ^= 1  # block 2 of the slab: not read
    (ck / row.file).write_bytes(bytes(raw))
    assert torch.equal(load_box(str(ck), "rows", Region((10, 0), (3, 100)), torch.float32)[0], full[10:13])
    raw[row.byte_offset + 4500] ^= 1  # block 1: read
    (ck / row.file).write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'rows' region \[0:25, 0:100\], block 1 of 3"):
        load_box(str(ck), "rows", Region((10, 0), (3, 100)), torch.float32)


def test_verify_checks_blocks_of_chunks_not_of_object_blobs(tmp_path: Path) -> None:
    """An object blob over one block has no block checksums (only chunks do): verify passes it."""
    bytecp.save(str(tmp_path / "ck"), {"t": torch.randn(300_000), "o": {"big": (1, float("inf"), "x" * 400_000)}})
    checked, problems = verify(open_storage(str(tmp_path / "ck")))
    assert not problems and checked > 1_200_000  # the chunk and the blob
