"""The keepers' file transfers: ``sendfile`` out of the shared memory,
``recv_into`` a mapping of the destination file, the crc32c checked there."""

from __future__ import annotations

import json
import os
import socket
import struct
import uuid
from pathlib import Path

import pytest
from bytecp.storage._keeper_wire import FileRange, request, send
from bytecp.storage.keeper_server import Keeper
from keepers import TOKEN, pair_fixture, spec, start_keepers

from bytecp.errors import StorageError
from bytecp.format.checksum import crc32c
from bytecp.storage_api import open_storage

pair = pair_fixture("w0", "w1")


def test_a_file_reaches_the_peer_whole_and_reads_back_in_ranges(pair: list[Keeper]) -> None:
    run = uuid.uuid4().hex
    data = os.urandom((3 << 20) + 17)  # not a whole number of pages
    st = open_storage(f"keeper://job/{run}", keepers=spec(pair), host="w0", token=TOKEN)
    st.write_file("d.bin", [data])
    with open(os.path.join(pair[1].root, "job", run, "d.bin"), "rb") as f:
        assert f.read() == data  # the peer's copy, received into its mapping
    peer = ("127.0.0.1", pair[1].port)
    answer, got = request(peer, {"op": "getv", "token": TOKEN, "path": f"job/{run}/d.bin",
                                 "ranges": [[5, 100], [1 << 20, 4096], [len(data) - 7, 7]]})
    assert bytes(got) == data[5:105] + data[1 << 20:(1 << 20) + 4096] + data[-7:]
    assert answer["crc32c"] == crc32c(got)
    _, tail = request(peer, {"op": "get", "token": TOKEN, "path": f"job/{run}/d.bin", "offset": len(data) + 5})
    assert bytes(tail) == b""  # beyond the end: nothing, as before


def test_a_put_corrupted_in_transfer_is_refused_and_leaves_no_file(pair: list[Keeper]) -> None:
    path = f"job/{uuid.uuid4().hex}/d.bin"
    data = os.urandom(2 << 20)
    header = json.dumps({"op": "put", "token": TOKEN, "path": path, "n": len(data),
                         "crc32c": crc32c(data) ^ 1}).encode()
    with socket.create_connection(("127.0.0.1", pair[1].port), timeout=30) as sock:
        sock.sendall(struct.pack("!I", len(header)) + header + data)
        (length,) = struct.unpack("!I", sock.recv(4, socket.MSG_WAITALL))
        answer = json.loads(sock.recv(length, socket.MSG_WAITALL))
    assert not answer["ok"] and "failed its crc32c check" in answer["error"]
    run_dir = os.path.join(pair[1].root, os.path.dirname(path))
    assert os.listdir(run_dir) == []  # neither the file nor its temporary


def test_a_peer_refusing_for_its_budget_says_so(pair: list[Keeper]) -> None:
    keepers = start_keepers(["r0", "r1"])
    keepers[1].budget = 10_000
    try:
        st = open_storage("keeper://run", keepers=spec(keepers), host="r0", token=TOKEN)
        with pytest.raises(StorageError, match="keeper r1: memory budget of 10000 bytes cannot hold"):
            st.write_file("step-1/d.bin", [bytes(4 << 20)])  # refused before its bytes are read
    finally:
        for k in keepers:
            k.close()


def test_a_file_range_beyond_the_end_is_refused(tmp_path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"x" * 10)
    a, b = socket.socketpair()
    with a, b, pytest.raises(StorageError, match="beyond its end"):
        send(a, {"op": "put"}, [FileRange(str(f), 4, 7)])


def test_shared_memory_that_cannot_be_reserved_is_an_error_not_a_sigbus(tmp_path: Path) -> None:
    """posix_fallocate reports a full /dev/shm (ENOSPC) before any mapping is
    touched: the keeper's arena and a received put refuse with advice, and
    leave no file; a filesystem without fallocate still gets a sparse file."""
    import errno

    from bytecp.storage import _keeper_wire as wire
    from bytecp.storage._keeper_arenas import Arenas

    real = os.posix_fallocate

    def full(fd: int, off: int, n: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    mp = pytest.MonkeyPatch()
    mp.setattr(os, "posix_fallocate", full)
    try:
        arenas = Arenas(str(tmp_path))
        with pytest.raises(StorageError, match="--budget-bytes"):  # the arena a rank would map
            arenas.lend(1 << 20, os.getpid())
        assert not [p for p in tmp_path.rglob("*") if p.is_file()]
        a, b = socket.socketpair()
        with a, b:  # a put into a full /dev/shm: refused, its payload read and dropped
            a.sendall(b"x" * 5000 + b"next")
            with pytest.raises(StorageError, match="cannot reserve 5000 bytes"):
                wire.recv_file(b, {"n": 5000}, str(tmp_path / "root"), "ck/data/f.bin")
            assert b.recv(4) == b"next"
        assert not [p for p in tmp_path.rglob("*") if p.is_file()]

        def unsupported(fd: int, off: int, n: int) -> None:
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")

        mp.setattr(os, "posix_fallocate", unsupported)
        _, path, _ = arenas.lend(4096, os.getpid())
        assert os.path.getsize(path) == 4096
    finally:
        mp.undo()
    assert os.posix_fallocate is real
