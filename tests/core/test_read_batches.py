"""How a load cuts its reads into batches (:func:`bytecp.loading.reader._batches`,
:func:`~bytecp.loading.reader.batch_bytes`): one batch a file where the files
divide evenly among the reader threads (every batch costs a ranged-read call
and its checks' arrays), files cut into pieces alike where they do not (no lone
batch read at the tail), every request exactly once, in file order."""

from __future__ import annotations

import random
import types
from pathlib import Path

import pytest
import torch

import bytecp
from bytecp.loading import reader
from bytecp.plan.load_plan import ReadRequest
from bytecp.tree.regions import Region

MiB = 1 << 20


def _requests(files: dict[str, int], each: int) -> tuple[list[types.SimpleNamespace], list[ReadRequest]]:
    """Requests of ``each`` bytes covering files of the given sizes (the chunks: one per request)."""
    chunks: list[types.SimpleNamespace] = []
    reqs: list[ReadRequest] = []
    for file, size in files.items():
        for off in range(0, size, each):
            n = min(each, size - off)
            reqs.append(ReadRequest(len(reqs), len(chunks), Region((0,), (n,)), off, n, 0, True))
            chunks.append(types.SimpleNamespace(file=file))
    return chunks, reqs[::-1]  # (out of order: the batches put them back in)


def _tail(batches: list[int], threads: int) -> float:
    """When the last thread ends, each taking the next batch as it is free."""
    free = [0] * threads
    for b in batches:
        i = free.index(min(free))
        free[i] += b
    return max(free)


@pytest.mark.parametrize(("files", "threads", "count"), [
    ({f"{i}.bin": 100 * MiB for i in range(4)}, 4, 4),  # one a file
    ({"a.bin": 99 * MiB, "b.bin": 101 * MiB, "c.bin": 100 * MiB, "d.bin": 100 * MiB}, 4, 4),  # nearly alike: whole
    ({f"{i}.bin": 250 * MiB for i in range(4)}, 4, 8),  # a file over the upper bound: two pieces alike
    ({"0.bin": 400 * MiB}, 4, 4),  # one file: a piece a thread
    ({f"{i}.bin": 100 * MiB for i in range(4)}, 8, 8),  # more threads than files: each file cut alike
    ({f"{i}.bin": 200 * MiB for i in range(5)}, 4, 15),  # five files, four threads: no lone fifth at the end
    ({f"{i}.bin": 100 * MiB for i in range(3)}, 4, 12),
    ({"0.bin": 3 * MiB}, 8, 1),  # small: one batch
    ({"0.bin": 2048 * MiB}, 2, 16),  # large: no batch over the upper bound
])
def test_batches_are_few_and_keep_every_thread_busy_to_the_end(files: dict[str, int], threads: int, count: int) -> None:
    chunks, reqs = _requests(files, MiB)
    batches = reader._batches(chunks, reqs, threads)  # type: ignore[arg-type]
    assert len(batches) == count
    assert sorted(r.target for b in batches for r in b) == list(range(len(reqs)))  # each request once
    for b in batches:
        assert len({chunks[r.chunk].file for r in b}) == 1  # one file a batch (one ranged-read call)
        assert [r.byte_offset for r in b] == sorted(r.byte_offset for r in b)
        assert [r.byte_offset for r in b] == list(range(b[0].byte_offset, b[-1].byte_offset + 1, MiB))  # contiguous
        assert sum(r.nbytes for r in b) <= max(reader.READ_BATCH_MAX_BYTES, reader.READ_BATCH_MIN_BYTES * 3 // 2)
    sizes = [sum(r.nbytes for r in b) for b in batches]
    share = sum(files.values()) / threads
    if max(sizes) > reader.READ_BATCH_MIN_BYTES * 3 // 2:  # (at the lower bound a load is small: the tail is short)
        assert _tail(sizes, threads) <= 1.125 * share + MiB  # (+ a request: pieces end on requests)
    for file in files:  # a file's pieces alike, to a request
        mine = [s for b, s in zip(batches, sizes, strict=True) if chunks[b[0].chunk].file == file]
        assert max(mine) - min(mine) <= MiB


def test_a_request_larger_than_a_batch_is_never_split() -> None:
    chunks, reqs = _requests({"0.bin": 1200 * MiB}, 600 * MiB)
    batches = reader._batches(chunks, reqs, 4)  # type: ignore[arg-type]
    assert sorted(len(b) for b in batches) == [1, 1] and {r.nbytes for b in batches for r in b} == {600 * MiB}


def test_large_requests_beside_a_piece_edge_never_take_a_batch_past_the_bound() -> None:
    """Requests of random sizes up to a batch's bound (a piece takes each request whose middle byte
    falls in it): no batch of two or more requests passes the bound, and each request is read once."""
    rng = random.Random(7)
    bound = reader.READ_BATCH_MAX_BYTES
    for _ in range(200):
        chunks: list[types.SimpleNamespace] = []
        reqs: list[ReadRequest] = []
        for f in range(rng.randint(1, 5)):
            off = 0
            for _ in range(rng.randint(1, 12)):
                n = rng.randint(1, bound)
                reqs.append(ReadRequest(len(reqs), len(chunks), Region((0,), (n,)), off, n, 0, True))
                chunks.append(types.SimpleNamespace(file=f"{f}.bin"))
                off += n
        batches = reader._batches(chunks, reqs, rng.randint(1, 16))  # type: ignore[arg-type]
        assert sorted(r.target for b in batches for r in b) == list(range(len(reqs)))
        assert all(len(b) == 1 or sum(r.nbytes for r in b) <= bound for b in batches)


def test_the_batch_size_stays_within_its_bounds() -> None:
    lo, hi = reader.READ_BATCH_MIN_BYTES, reader.READ_BATCH_MAX_BYTES
    assert reader.batch_bytes([], 4) == lo and reader.batch_bytes([MiB], 4) == lo
    assert reader.batch_bytes([1 << 40] * 3, 4) == hi  # a terabyte: the upper bound, quickly
    assert reader.batch_bytes([100 * MiB], 1) == 100 * MiB  # one thread: a batch for the file
    for sizes in ([7 * MiB] * 13, [300 * MiB, 5 * MiB, 90 * MiB], [64 * MiB] * 9):
        for threads in (2, 3, 4, 8, 16):
            assert lo <= reader.batch_bytes(sizes, threads) <= hi


def test_a_load_of_several_files_reads_one_batch_a_file_bitwise(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A save's four data files (its four writer threads), loaded with four reader
    threads: four batches, every tensor bitwise; with three threads the files are cut."""
    monkeypatch.setattr("bytecp.saving.writer.FILE_TARGET_BYTES", MiB)  # (a file a writer thread from 4 MiB)
    state = {f"t{i}": torch.randn(1 << 18, generator=torch.Generator().manual_seed(i)) for i in range(32)}
    bytecp.save(str(tmp_path / "ck"), state, io_threads=4)
    files = sorted(p.name for p in (tmp_path / "ck" / "data").rglob("*.bin"))
    assert len(files) == 4, files
    monkeypatch.setattr(reader, "READ_BATCH_MIN_BYTES", 64 << 10)  # (the files are 8 MiB: cut below the default)
    seen: list[int] = []
    cut = reader._batches

    def counted(*a: object) -> list[list[ReadRequest]]:
        out = cut(*a)  # type: ignore[arg-type]
        seen.append(len(out))
        return out

    monkeypatch.setattr(reader, "_batches", counted)
    for threads in (4, 3):
        seen.clear()
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        bytecp.load(str(tmp_path / "ck"), target, io_threads=threads)
        assert len(seen) == 1
        if threads == 4:
            assert seen == [4]
        else:  # (four files, three threads: cut)
            assert seen[0] > 4
        assert all(torch.equal(target[k], v) for k, v in state.items())
