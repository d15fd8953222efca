# mypy: disable-error-code="arg-type"
"""The storage contract (``bytecp.storage.testing``): pytest mixin classes
every backend runs -- bytecp's own and third-party ones.

A third-party backend's test module::

    import pytest
    from bytecp.storage.testing import StorageContract, StorageFixtures

    class MyFixtures(StorageFixtures):
        @pytest.fixture
        def storage(self, tmp_path):
            yield MyStorage(...)          # a fresh, empty bytecp.storage_api.Storage

    class TestMyBackend(MyFixtures, StorageContract):
        pass

Needs pytest (bytecp's ``test`` extra). A backend's test module combines a fixtures base (a
subclass of :class:`StorageFixtures` whose ``storage`` fixture yields a fresh, empty
:class:`~bytecp.storage_api.Storage`) with :class:`StorageContract` (or a subset of the mixins).
A backend's real gap is declared in ``xfail`` (test name -> reason): an xfail, never a silent skip.
"""

from __future__ import annotations

import array
import random
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from bytecp.plugins import missing_extra

try:
    import pytest
    import torch
except ModuleNotFoundError as e:  # the contract extra
    raise missing_extra(e, "contract", __name__) from None

from bytecp.contract import DeclaredGaps
from bytecp.errors import (
    CheckpointExistsError,
    CorruptCheckpointError,
    StorageError,
    StorageNotFoundError,
)
from bytecp.storage_api import Storage

__all__ = [
    "StorageFixtures", "StorageContract", "WriteReadTests", "ListDeleteTests", "CommitTests",
    "StreamTests", "RenameTests", "ConcurrencyTests", "ErrorTests", "MiB", "payload",
]

MiB = 1 << 20


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


class StorageFixtures(DeclaredGaps):
    """Base: subclasses provide the ``storage`` fixture (fresh and empty per test). ``xfail`` names known gaps."""

    #: bytes of the "large" file; above the backend's multipart/chunk threshold where it has one
    large_size: int = 3 * MiB + 12345

    @pytest.fixture
    def storage(self) -> Storage:
        raise NotImplementedError("a backend's fixtures base provides `storage`")


class WriteReadTests:
    large_size: int  # from the fixtures base
    def test_roundtrip_one_buffer(self, storage: Storage) -> None:
        data = payload(1000)
        storage.write_file("data/0-0.bin", [data])
        assert storage.read_bytes("data/0-0.bin") == data
        assert storage.size("data/0-0.bin") == 1000
        assert storage.exists("data/0-0.bin")

    def test_write_concatenates_buffers_of_every_kind(self, storage: Storage) -> None:
        t = torch.arange(1000, dtype=torch.float32)
        parts = [
            b"head",
            bytearray(b"-bytearray-"),
            memoryview(payload(300, 1))[7:200],
            b"",
            array.array("d", [1.5, 2.5, -3.0]),  # a non-byte format
            memoryview(t.numpy()),
        ]
        expected = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
        storage.write_file("mixed.bin", parts)
        assert storage.read_bytes("mixed.bin") == expected

    def test_empty_file(self, storage: Storage) -> None:
        storage.write_file("empty.bin", [])
        assert storage.exists("empty.bin")
        assert storage.size("empty.bin") == 0
        assert storage.read_bytes("empty.bin") == b""

    def test_overwrite_replaces_whole_file(self, storage: Storage) -> None:
        storage.write_file("f.bin", [payload(5000, 1)])
        storage.write_file("f.bin", [b"short"])
        assert storage.read_bytes("f.bin") == b"short"

    def test_ranged_reads(self, storage: Storage) -> None:
        data = payload(100_000, 2)
        storage.write_file("r.bin", [data])
        rng = random.Random(3)
        for _ in range(20):
            off = rng.randrange(0, len(data))
            n = rng.randrange(0, len(data) - off + 1)
            assert storage.read_bytes("r.bin", off, n) == data[off : off + n]
        assert storage.read_bytes("r.bin", len(data), 0) == b""
        assert storage.read_bytes("r.bin", 99_990) == data[99_990:]

    def test_read_into_tensor_memory(self, storage: Storage) -> None:
        src = torch.randn(64, 33, generator=torch.Generator().manual_seed(0))
        storage.write_file("t.bin", [memoryview(src.numpy()).cast("B")])
        dst = torch.empty_like(src)
        storage.read_into("t.bin", 0, memoryview(dst.numpy()))
        assert torch.equal(src, dst)
        # a sub-range straight into a slice of a flat tensor
        flat = torch.zeros(src.numel())
        row = 5 * 33 * 4
        storage.read_into("t.bin", row, memoryview(flat[: 33 * 2].numpy()).cast("B"))
        assert torch.equal(flat[: 33 * 2], src[5:7].reshape(-1))

    def test_large_file(self, storage: Storage) -> None:
        n = self.large_size
        data = payload(n, 4)
        cut1, cut2 = n // 3 + 1, n // 3 * 2 + 7  # buffer edges inside parts
        view = memoryview(data)
        storage.write_file("large/0-0.bin", [view[:cut1], view[cut1:cut2], view[cut2:]])
        assert storage.size("large/0-0.bin") == n
        out = bytearray(n)
        storage.read_into("large/0-0.bin", 0, memoryview(out))
        assert out == data
        off = n // 2 - 1000
        assert storage.read_bytes("large/0-0.bin", off, 2 * MiB if n > off + 2 * MiB else n - off) == data[
            off : off + (2 * MiB if n > off + 2 * MiB else n - off)
        ]

    def test_read_ranges_batch(self, storage: Storage) -> None:
        data = payload(300_000, 12)
        storage.write_file("b.bin", [data])
        spans = [(250_000, 10), (0, 100), (100, 50), (5_000, 7), (120_000, 60_000), (299_990, 10), (40, 30), (7, 0)]
        outs = [(off, memoryview(bytearray(n))) for off, n in spans]
        storage.read_ranges("b.bin", outs)
        for off, v in outs:
            assert bytes(v) == data[off : off + len(v)]
        storage.read_ranges("b.bin", [])
        storage.write_file("c.bin", [data[::-1]])  # several files' ranges in one call (a rank's index segments)
        reads = [(n, [(o, memoryview(bytearray(k))) for o, k in spans]) for n in ("b.bin", "c.bin", "b.bin")]
        storage.read_files(reads)
        assert all(bytes(v) == (data if n == "b.bin" else data[::-1])[o : o + len(v)] for n, outs in reads for o, v in outs)
        storage.read_files([])

    def test_read_ranges_errors(self, storage: Storage) -> None:
        storage.write_file("s.bin", [b"0123456789"])
        with pytest.raises(CorruptCheckpointError, match="s.bin"):
            storage.read_ranges("s.bin", [(0, memoryview(bytearray(4))), (8, memoryview(bytearray(4)))])
        with pytest.raises(StorageNotFoundError, match="gone.bin"):
            storage.read_ranges("gone.bin", [(0, memoryview(bytearray(4)))])
        with pytest.raises(StorageNotFoundError, match="gone.bin"):
            storage.read_files([("s.bin", [(0, memoryview(bytearray(4)))]), ("gone.bin", [(0, memoryview(bytearray(4)))])])

    def test_read_past_end_names_the_file(self, storage: Storage) -> None:
        storage.write_file("short.bin", [b"0123456789"])
        with pytest.raises(CorruptCheckpointError, match="short.bin"):
            storage.read_bytes("short.bin", 5, 10)
        with pytest.raises(CorruptCheckpointError, match="short.bin"):
            storage.read_bytes("short.bin", 20, 1)

    def test_missing_file_is_not_found(self, storage: Storage) -> None:
        with pytest.raises(StorageNotFoundError, match="nope.bin"):
            storage.read_bytes("nope.bin", 0, 4)
        with pytest.raises(StorageNotFoundError, match="nope.bin"):
            storage.size("nope.bin")
        assert not storage.exists("nope.bin")
        assert isinstance(StorageNotFoundError("x"), FileNotFoundError)

    def test_directory_is_not_a_file(self, storage: Storage) -> None:
        storage.write_file("dir/a.bin", [b"a"])
        assert not storage.exists("dir")


class ListDeleteTests:
    def test_list_files_recursive_sorted_relative(self, storage: Storage) -> None:
        for p in ["metadata.json", "data/1-0.bin", "data/0-0.bin", "index/0.parquet", "data/sub/x"]:
            storage.write_file(p, [p.encode()])
        assert storage.list_files() == sorted(
            ["metadata.json", "data/0-0.bin", "data/1-0.bin", "data/sub/x", "index/0.parquet"]
        )
        assert storage.list_files("data") == ["data/0-0.bin", "data/1-0.bin", "data/sub/x"]
        assert storage.list_files("data/") == storage.list_files("data")

    def test_file_sizes_in_one_listing(self, storage: Storage) -> None:
        files = {"data/s1/0-0.bin": 4096 * 3, "data/s1/1-0.bin": 7, "data/s2/0-0.bin": 0, "index/s1/0.parquet": 5}
        for p, n in files.items():
            storage.write_file(p, [payload(n)])
        assert storage.file_sizes("data") == {p: n for p, n in files.items() if p.startswith("data/")}
        assert storage.file_sizes() == files
        assert storage.file_sizes("nothing") == {}

    def test_list_missing_prefix_is_empty(self, storage: Storage) -> None:
        assert storage.list_files() == []
        assert storage.list_files("nothing/here") == []
        assert storage.list_children("nothing") == []

    def test_prefix_is_a_directory_not_a_string_prefix(self, storage: Storage) -> None:
        storage.write_file("step-1/a", [b"1"])
        storage.write_file("step-10/a", [b"10"])
        assert storage.list_files("step-1") == ["step-1/a"]

    def test_list_children(self, storage: Storage) -> None:
        for p in ["step-10/metadata.json", "step-10/data/0.bin", "step-20/data/0.bin", "latest"]:
            storage.write_file(p, [b"x"])
        assert storage.list_children() == ["latest", "step-10", "step-20"]
        assert storage.list_children("step-10") == ["data", "metadata.json"]

    def test_delete_ignores_missing(self, storage: Storage) -> None:
        storage.write_file("a/1", [b"1"])
        storage.write_file("a/2", [b"2"])
        storage.delete(["a/1", "a/missing"])
        assert storage.list_files() == ["a/2"]
        storage.delete([])

    def test_delete_prefix(self, storage: Storage) -> None:
        for p in ["old/data/0.bin", "old/metadata.json", "new/metadata.json"]:
            storage.write_file(p, [b"x"])
        storage.delete_prefix("old")
        assert storage.list_files() == ["new/metadata.json"]
        assert not storage.exists("old/metadata.json")

    def test_child_is_rooted_below(self, storage: Storage) -> None:
        storage.write_file("step-5/data/0.bin", [b"abc"])
        child = storage.child("step-5")
        assert type(child) is type(storage)
        assert child.list_files() == ["data/0.bin"]
        assert child.read_bytes("data/0.bin") == b"abc"
        child.commit("metadata.json", b"{}")
        assert storage.exists("step-5/metadata.json")


class CommitTests:
    def test_commit_publishes_small_file(self, storage: Storage) -> None:
        storage.write_file("data/0.bin", [b"d"])
        assert not storage.exists("metadata.json")
        storage.commit("metadata.json", b'{"version": 1}')
        assert storage.read_bytes("metadata.json") == b'{"version": 1}'

    def test_commit_replaces_and_leaves_no_temporaries(self, storage: Storage) -> None:
        storage.commit("metadata.json", b"old")
        storage.commit("metadata.json", b"new-and-longer")
        assert storage.read_bytes("metadata.json") == b"new-and-longer"
        assert storage.list_files() == ["metadata.json"]

    def test_readers_see_old_or_new_never_torn(self, storage: Storage) -> None:
        versions = [payload(20_000, i) for i in range(4)]
        storage.commit("metadata.json", versions[0])
        seen: list[bytes] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def reader() -> None:
            while not stop.is_set():
                try:
                    seen.append(storage.read_bytes("metadata.json"))
                except StorageNotFoundError as e:  # never acceptable: the file always exists
                    errors.append(e)
                except CorruptCheckpointError:
                    pass  # size and body read separately; the re-read below is what counts

        t = threading.Thread(target=reader)
        t.start()
        try:
            for v in versions[1:] * 2:
                storage.commit("metadata.json", v)
        finally:
            stop.set()
            t.join(timeout=60)
        assert not errors
        assert seen and all(s in versions for s in seen)


class ExclusiveCommitTests:
    """``commit(..., exclusive=True)``: publish only if nothing is there yet."""

    def test_exclusive_commit_publishes_when_absent(self, storage: Storage) -> None:
        storage.write_file("data/0.bin", [b"d"])
        storage.commit("metadata.json", b'{"v": 1}', exclusive=True)
        assert storage.read_bytes("metadata.json") == b'{"v": 1}'
        assert storage.list_files() == ["data/0.bin", "metadata.json"]  # no temporaries

    def test_exclusive_commit_refuses_an_existing_file(self, storage: Storage) -> None:
        storage.commit("metadata.json", b"first", exclusive=True)
        with pytest.raises(CheckpointExistsError, match="metadata.json"):
            storage.commit("metadata.json", b"second", exclusive=True)
        assert storage.read_bytes("metadata.json") == b"first"
        assert storage.list_files() == ["metadata.json"]
        assert isinstance(CheckpointExistsError("x"), FileExistsError)

    def test_exclusive_commit_of_the_same_bytes_is_idempotent(self, storage: Storage) -> None:
        """A retried commit whose first attempt landed (its answer lost) is not a conflict."""
        storage.commit("metadata.json", b"mine", exclusive=True)
        storage.commit("metadata.json", b"mine", exclusive=True)
        assert storage.read_bytes("metadata.json") == b"mine"

    def test_overwrite_commit_still_replaces(self, storage: Storage) -> None:
        storage.commit("metadata.json", b"old", exclusive=True)
        storage.commit("metadata.json", b"new", exclusive=False)
        assert storage.read_bytes("metadata.json") == b"new"

    def test_exclusive_commits_racing_from_threads_one_wins(self, storage: Storage) -> None:
        """Eight threads commit different bytes at once, 5 rounds: exactly one
        succeeds each round and the file holds the winner's bytes."""
        if storage.exclusive_commit != "atomic":
            pytest.xfail(
                f"{type(storage).__name__} commits exclusively by check-then-publish here: "
                "a commit between the check and the publish is replaced"
            )
        n = 8
        for rnd in range(5):
            path = f"round-{rnd}/metadata.json"
            barrier = threading.Barrier(n)

            def one(i: int, path: str = path, barrier: threading.Barrier = barrier, rnd: int = rnd) -> str:
                barrier.wait()
                try:
                    storage.commit(path, f"writer {i} of round {rnd}".encode(), exclusive=True)
                    return "won"
                except CheckpointExistsError:
                    return "lost"

            with ThreadPoolExecutor(n) as pool:
                outcomes = list(pool.map(one, range(n)))
            assert outcomes.count("won") == 1, outcomes
            assert storage.read_bytes(path) == f"writer {outcomes.index('won')} of round {rnd}".encode()
            assert storage.list_files(f"round-{rnd}") == [path]


class StreamTests:
    """``write_stream``: files larger than memory, published whole or not at all."""

    large_size: int  # from the fixtures base

    @staticmethod
    def _reused(data: bytes, step: int) -> Iterator[memoryview]:
        """Yield ``data`` in pieces through ONE reused buffer (the producer
        overwrites a piece as soon as the next is asked for)."""
        buf = bytearray(step)
        for off in range(0, len(data), step):
            n = min(step, len(data) - off)
            buf[:n] = data[off : off + n]
            yield memoryview(buf)[:n]

    def test_stream_roundtrip_with_reused_buffer(self, storage: Storage) -> None:
        data = payload(self.large_size, 21)
        n = storage.write_stream("out/big.safetensors", self._reused(data, 1_000_003), size_hint=len(data))
        assert n == len(data)
        assert storage.read_bytes("out/big.safetensors") == data
        assert storage.list_files() == ["out/big.safetensors"]  # no temporaries

    def test_stream_of_pieces_of_every_kind_and_none(self, storage: Storage) -> None:
        t = torch.arange(100, dtype=torch.float32)
        parts = [b"head", b"", bytearray(b"-x-"), memoryview(t.numpy()), array.array("d", [1.5])]
        expected = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
        assert storage.write_stream("mixed.bin", iter(parts)) == len(expected)
        assert storage.read_bytes("mixed.bin") == expected
        assert storage.write_stream("empty.bin", iter([])) == 0
        assert storage.read_bytes("empty.bin") == b""

    def test_failing_producer_publishes_nothing_and_keeps_the_old_file(self, storage: Storage) -> None:
        storage.write_file("keep.bin", [b"old contents"])
        data = payload(self.large_size, 22)

        def broken() -> Iterator[memoryview]:
            yield from self._reused(data[: len(data) // 2 + 1], 1_000_003)
            raise RuntimeError("producer failed")

        with pytest.raises(RuntimeError, match="producer failed"):
            storage.write_stream("keep.bin", broken(), size_hint=len(data))
        with pytest.raises(RuntimeError, match="producer failed"):
            storage.write_stream("new.bin", broken(), size_hint=len(data))
        assert storage.read_bytes("keep.bin") == b"old contents"
        assert storage.list_files() == ["keep.bin"]
        uploads = getattr(storage, "list_incomplete_uploads", None)
        assert uploads is None or uploads() == []


class RenameTests:
    """``rename`` where ``atomic_rename`` holds: staged directories published in one step."""

    def test_rename_directory_new_and_replace(self, storage: Storage) -> None:
        if not storage.atomic_rename:
            with pytest.raises(NotImplementedError):
                storage.rename("a", "b")
            return
        storage.write_file("stage/x.bin", [b"new x"])
        storage.write_file("stage/sub/y.bin", [b"new y"])
        storage.rename("stage", "out")
        assert storage.list_files() == ["out/sub/y.bin", "out/x.bin"]
        storage.write_file("stage2/z.bin", [b"z"])
        with pytest.raises(CheckpointExistsError, match="out"):
            storage.rename("stage2", "out")
        assert storage.list_files() == ["out/sub/y.bin", "out/x.bin", "stage2/z.bin"]
        storage.rename("stage2", "out", replace=True)
        assert storage.list_files() == ["out/z.bin"]
        storage.write_file("f.bin", [b"f"])
        storage.rename("f.bin", "g.bin")
        assert storage.read_bytes("g.bin") == b"f" and not storage.exists("f.bin")


class ConcurrencyTests:
    def test_many_threads_write_and_read(self, storage: Storage) -> None:
        files = {f"data/{i}-0.bin": payload(50_000 + i, i) for i in range(12)}
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(lambda kv: storage.write_file(kv[0], [kv[1]]), files.items()))
        assert storage.list_files("data") == sorted(files)
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda k: storage.read_bytes(k), files))
        assert got == list(files.values())

    def test_parallel_ranged_reads_of_one_file(self, storage: Storage) -> None:
        data = payload(400_000, 9)
        storage.write_file("big.bin", [data])
        out = bytearray(len(data))
        view = memoryview(out)
        step = 33_333
        with ThreadPoolExecutor(6) as pool:
            list(
                pool.map(
                    lambda off: storage.read_into("big.bin", off, view[off : off + step]),
                    range(0, len(data), step),
                )
            )
        assert out == data


class ErrorTests:
    def test_errors_are_storage_errors_naming_the_url(self, storage: Storage) -> None:
        with pytest.raises(StorageError) as info:
            storage.read_bytes("missing/file.bin", 0, 1)
        assert "missing/file.bin" in str(info.value)

    def test_repr_names_the_url(self, storage: Storage) -> None:
        assert storage.url in repr(storage)


class StorageContract(
    WriteReadTests, ListDeleteTests, CommitTests, ExclusiveCommitTests, StreamTests, RenameTests,
    ConcurrencyTests, ErrorTests,
):
    """Every mixin: what a backend must pass."""
