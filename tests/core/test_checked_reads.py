"""The compiled checked reads (``bytecp/format/_reads.c``, :mod:`bytecp.format.checked_reads`):
its crc32c against the checksum engine's on both of its paths, ``read_sums``
against Python (bytes read, sums of spans that cross ranges, the end of a
file, refusals), the local backend's ``read_ranges_summed`` and a load whose
targets read the same block at their edges (summed as fed instead)."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import bytecp
from bytecp.errors import ConfigError, CorruptCheckpointError
from bytecp.format import checked_reads, checksum
from bytecp.loading.checks import block_bytes_of
from bytecp.loading.opened import open_checkpoint
from bytecp.loading.reader import Target, execute_reads
from bytecp.plan.load_plan import plan_load
from bytecp.recorder import Trace
from bytecp.storage_api import open_storage
from bytecp.tree.regions import Region

MiB = 1 << 20


@pytest.fixture(scope="module")
def k():  # type: ignore[no-untyped-def]
    k = checked_reads.compiled()
    if k is None:
        pytest.skip("the compiled checked reads are not built here, or this CPU lacks SSE4.2")
    return k


def test_it_is_built_and_current_wherever_a_c_compiler_and_sse42_are() -> None:
    """The build is optional (a wheel installs without a compiler), so a C error in
    ``_reads.c`` would leave a checkout with no module, or an older one, and every test here
    skipped or run on stale code: where a compiler is and the CPU has the instruction, the
    module must be there, of this Python's ABI, and pass its self-check."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: the module is optional")
    if not os.path.exists("/proc/cpuinfo"):
        pytest.skip("not Linux: whether the CPU has SSE4.2 is not read here")
    with open("/proc/cpuinfo") as f:
        if "sse4_2" not in f.read():
            pytest.skip("this CPU lacks SSE4.2: the module is not used")
    from bytecp.format import _reads  # noqa: F401 - built at install

    assert _reads.ABI == checked_reads.ABI, "bytecp/format/_reads.c changed without a rebuild: reinstall"
    assert checked_reads.compiled() is not None


@pytest.mark.parametrize("wide", [True, False], ids=["vpclmulqdq", "sse4.2"])
def test_its_crc32c_is_the_engines_at_every_length_start_and_seed(k, wide: bool) -> None:  # type: ignore[no-untyped-def]
    if wide and not k.WIDE:
        pytest.skip("this CPU has no AVX-512 VPCLMULQDQ: the three-stream path is the one used")
    data = memoryview(random.Random(3).randbytes(3 * MiB))
    lengths = [*range(0, 600), 767, 768, 769, 1023, 4096, 24575, 24576, 24577, 65537, 256 << 10, MiB + 3, 3 * MiB - 16]
    for n in lengths:
        for at in (0, 1, 7, 13) if n < 3 * MiB - 16 else (0, 15):
            piece = data[at : at + n]
            for seed in (0, 0xFFFFFFFF, 0x1234ABCD):
                assert k.crc32c(piece, seed, wide) == checksum.crc32c(piece, seed), (n, at, seed)


@pytest.mark.parametrize("mapped", [False, True], ids=["pread", "mapped"])
def test_read_sums_reads_every_range_and_sums_spans_across_adjacent_ranges(  # type: ignore[no-untyped-def]
        k, tmp_path: Path, mapped: bool) -> None:
    rng = random.Random(5)
    data = rng.randbytes(4 * MiB)
    (tmp_path / "f.bin").write_bytes(data)
    for trial in range(40):
        ranges, spans, at = [], [], rng.randrange(0, 1000)
        while at < len(data) - 10:
            n = min(rng.choice([1, 7, 100, 4096, 300_000, MiB]), len(data) - at)
            ranges.append((at, bytearray(n)))
            at += n + (0 if rng.random() < 0.6 else rng.randrange(1, 5000))
        # spans: inside runs of adjacent ranges (crossing their edges), some bytes left unsummed
        runs: list[list[int]] = [[ranges[0][0], ranges[0][0] + len(ranges[0][1])]]
        for off, b in ranges[1:]:
            if off == runs[-1][1]:
                runs[-1][1] += len(b)
            else:
                runs.append([off, off + len(b)])
        for lo, hi in runs:
            cuts = sorted({lo, hi, *(rng.randrange(lo, hi + 1) for _ in range(rng.randrange(0, 6)))})
            for a, b in zip(cuts, cuts[1:], strict=False):
                if rng.random() < 0.8:
                    spans += [a, b]
        spans_a = np.asarray(spans, np.int64)
        out = np.zeros(len(spans) // 2, np.uint32)
        with open(tmp_path / "f.bin", "rb") as f:
            piece = rng.choice([4096, 65536, 256 << 10])
            before = k.mapped_bytes()
            assert k.read_sums(f.fileno(), ranges, spans_a, out, piece, mapped) is None
        # every byte copied out of a mapping of the file when mapped, none when not
        assert k.mapped_bytes() - before == (sum(len(b) for _, b in ranges) if mapped else 0), trial
        for off, b in ranges:
            assert bytes(b) == data[off : off + len(b)], trial
        assert out.tolist() == checked_reads.sums_of_spans(ranges, spans_a).tolist(), trial
        assert out.tolist() == [checksum.crc32c(data[a:b]) for a, b in zip(spans[::2], spans[1::2], strict=True)]


def test_a_mapped_read_larger_than_its_window_is_read_and_summed_across_windows(  # type: ignore[no-untyped-def]
        k, tmp_path: Path) -> None:
    """A mapped read maps 16 MiB of the file at a time (the mapped pages count in the process's
    resident set): a range of 40 MiB, spans and pieces that cross the windows' edges."""
    data = np.random.default_rng(4).integers(0, 256, 40 * MiB, np.uint8).tobytes()
    (tmp_path / "f.bin").write_bytes(data)
    spans = np.asarray([100, 20 * MiB, 20 * MiB, 33 * MiB + 7, 39 * MiB, 40 * MiB - 5], np.int64)
    with open(tmp_path / "f.bin", "rb") as f:
        for piece in (256 << 10, 64 * MiB):  # (a piece longer than a window: cut at its edge)
            buf, out = bytearray(40 * MiB - 5), np.zeros(3, np.uint32)
            before = k.mapped_bytes()
            assert k.read_sums(f.fileno(), [(0, buf)], spans, out, piece, True) is None
            assert k.mapped_bytes() - before == 40 * MiB - 5  # (all of it from the windows' mappings)
            assert buf == data[: 40 * MiB - 5]
            assert out.tolist() == [checksum.crc32c(data[a:b]) for a, b in zip(spans[::2], spans[1::2], strict=True)]


@pytest.mark.parametrize("mapped", [False, True], ids=["pread", "mapped"])
def test_read_sums_reports_the_end_of_the_file_and_refuses_what_it_cannot_read(  # type: ignore[no-untyped-def]
        k, tmp_path: Path, mapped: bool) -> None:
    (tmp_path / "f.bin").write_bytes(os.urandom(10_000))
    none, out0 = np.zeros(0, np.int64), np.zeros(0, np.uint32)
    with open(tmp_path / "f.bin", "rb") as f:
        fd = f.fileno()
        assert k.read_sums(fd, [(0, bytearray(100)), (9_000, bytearray(3_000))], none, out0, 4096, mapped) == (1, 1_000)
        assert k.read_sums(fd, [(0, bytearray(100)), (20_000, bytearray(10))], none, out0, 4096, mapped) == (1, 0)
        with pytest.raises(ValueError, match="in file order, not overlapping"):
            k.read_sums(fd, [(100, bytearray(100)), (150, bytearray(10))], none, out0, 4096)
        with pytest.raises(ValueError, match="spans must be in order"):
            k.read_sums(fd, [(0, bytearray(100))], np.asarray([50, 60, 40, 45], np.int64), np.zeros(2, np.uint32), 64)
        with pytest.raises(ValueError, match="one uint32 a pair"):
            k.read_sums(fd, [(0, bytearray(100))], np.asarray([50, 60], np.int64), np.zeros(2, np.uint32), 64)
        with pytest.raises((BufferError, TypeError)):
            k.read_sums(fd, [(0, b"read-only")], none, out0, 64)
        with pytest.raises(ValueError, match="8-byte aligned"):
            k.read_sums(fd, [(0, bytearray(100))], np.zeros(17, np.int8)[1:].view(np.int64), np.zeros(1, np.uint32), 64)

        class Emptying:  # an offset whose conversion runs Python that empties the list being read
            def __index__(self) -> int:
                ranges.clear()
                return 0

        ranges: list = [(Emptying(), bytearray(100)), (200, bytearray(100))]  # type: ignore[type-arg]
        assert k.read_sums(fd, ranges, none, out0, 64, mapped) is None  # (read from its own copy of the list)
        far = (1 << 63) - 1000  # a span's pieces near the largest offset: no overflow past it
        try:
            got = k.read_sums(fd, [(far, bytearray(100))], np.asarray([far, far + 100], np.int64),
                              np.zeros(1, np.uint32), 1 << 40, mapped)
        except OSError:
            pass
        else:
            assert got == (0, 0)
    dfd = os.open(tmp_path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as e:
            k.read_sums(dfd, [(0, bytearray(10))], none, out0, 64, mapped)
        assert e.value.errno == 21  # EISDIR (not a regular file: not mapped, read)
    finally:
        os.close(dfd)


@pytest.mark.parametrize("wide", [True, False], ids=["avx-512", "sse"])
def test_the_mapped_reads_copy_is_exact_at_every_size_alignment_and_seed(k, wide: bool) -> None:  # type: ignore[no-untyped-def]
    """The copy from a mapping: plain below 64 KiB, streamed above (summed in the copy on AVX-512,
    from the source piece by piece without), its head to a 64-byte boundary and its tail plain."""
    if wide and not k.WIDE:
        pytest.skip("this CPU has no AVX-512 VPCLMULQDQ: the SSE path is the one used")
    data = memoryview(random.Random(9).randbytes(3 * MiB))
    for n in (0, 1, 63, 64, 65_535, 65_536, 65_537, 65_536 + 255, 65_536 + 256, 300_001, MiB, 3 * MiB - 64):
        for at, to in ((0, 0), (1, 0), (0, 1), (13, 63), (64, 17)):
            src = data[at : at + n]
            dst = memoryview(bytearray(len(src) + 128))
            for seed, summed in ((0, True), (0x1234ABCD, True), (0xFFFFFFFF, True), (99, False)):
                dst[:] = b"\xa5" * len(dst)
                got = k.copy_sum(dst[to : to + len(src)], src, seed, summed, wide)
                assert got == (checksum.crc32c(src, seed) if summed else seed), (n, at, to, seed)
                assert dst[to : to + len(src)] == src, (n, at, to)
                assert dst[:to] == b"\xa5" * to and dst[to + len(src):] == b"\xa5" * (len(dst) - to - len(src))


def test_copy_summed_copies_boxes_and_sums_each_block(k) -> None:  # type: ignore[no-untyped-def]
    """A save's staging copies (``bytecp.saving.hostcopy``): boxes between addresses, each block's
    crc32c (the last one shorter, one for an empty box), or copied only when ``out`` is empty."""
    rng = random.Random(11)
    srcs = [np.frombuffer(rng.randbytes(n), np.uint8) for n in (3 * MiB + 17, 0, 1, 65_536, 200_000)]
    for block in (65_536, 100_000, 1 << 30):
        dsts = [np.full(len(a) + 1, 0xA5, np.uint8) for a in srcs]  # a byte past each box: untouched
        boxes = np.asarray([v for d, a in zip(dsts, srcs, strict=True) for v in (d.ctypes.data, a.ctypes.data, len(a))],
                           np.int64)
        want = [checksum.crc32c(a[o : o + block].tobytes()) for a in srcs for o in range(0, max(len(a), 1), block)]
        out = np.zeros(len(want), np.uint32)
        assert k.copy_summed(boxes, block, out) is None
        assert out.tolist() == want
        for d, a in zip(dsts, srcs, strict=True):
            assert d[:-1].tobytes() == a.tobytes() and d[-1] == 0xA5
        for d in dsts:
            d[:] = 0
        k.copy_summed(boxes, block, np.zeros(0, np.uint32))  # copied, not summed
        assert all(d[:-1].tobytes() == a.tobytes() and d[-1] == 0 for d, a in zip(dsts, srcs, strict=True))
    with pytest.raises(ValueError, match="one uint32 a block of every box"):
        k.copy_summed(boxes, 65_536, np.zeros(3, np.uint32))
    with pytest.raises(ValueError, match="negative length"):
        k.copy_summed(np.asarray([0, 0, -1], np.int64), 65_536, np.zeros(1, np.uint32))
    with pytest.raises(ValueError, match="int64 triples"):
        k.copy_summed(np.zeros(4, np.int64), 65_536, np.zeros(1, np.uint32))


@pytest.mark.parametrize("block", [4096, 100_003, 64 << 10])
def test_crc_of_blocks_is_the_crc32c_of_one_pass(k, block: int) -> None:  # type: ignore[no-untyped-def]
    """A box's crc32c from its blocks' (the compiled save copies'): below one block, at exactly one,
    one byte over, and past 256 blocks (where it combines through tables)."""
    for n in (1, block - 1, block, block + 1, 3 * block + 7, 300 * block + 5):
        data = random.Random(n).randbytes(n)
        crcs = np.asarray([checksum.crc32c(data[o : o + block]) for o in range(0, n, block)], np.uint32)
        assert k.crc_of_blocks(crcs, block, n) == checksum.crc32c(data), (block, n)
    with pytest.raises(ValueError, match="one aligned uint32 a block"):
        k.crc_of_blocks(np.zeros(2, np.uint32), block, 3 * block)


_CUT_SHORT = """
import os, sys, threading, time
import numpy as np
from bytecp.format import checked_reads, checksum
k = checked_reads.compiled()
path, data = sys.argv[1], os.urandom(8 << 20)
with open(path, "wb") as f:
    f.write(data)
stop = threading.Event()
def cut() -> None:  # the file cut to 1 MiB and written back, again and again
    fd = os.open(path, os.O_RDWR)
    while not stop.is_set():
        os.ftruncate(fd, 1 << 20)
        os.pwrite(fd, data[1 << 20:], 1 << 20)
    os.close(fd)
t = threading.Thread(target=cut)
t.start()
fd, buf, out = os.open(path, os.O_RDONLY), bytearray(len(data)), np.zeros(1, np.uint32)
whole = short = 0
end = time.monotonic() + 1.5
while time.monotonic() < end or k.mapped_faults() == 0 and time.monotonic() < end + 20:
    got = k.read_sums(fd, [(0, buf)], np.asarray([0, len(data)], np.int64), out, 1 << 18, True)
    if got is None:  # read whole: every byte and its sum right
        assert bytes(buf) == data and int(out[0]) == checksum.crc32c(data)
        whole += 1
    else:  # cut short: what was read is the file's
        assert got[0] == 0 and got[1] >= 1 << 20 and bytes(buf[:got[1]]) == data[:got[1]], got
        short += 1
stop.set()
t.join()
print(whole, short, k.mapped_faults())
"""


@pytest.mark.spawn
def test_a_mapped_file_cut_short_during_a_copy_is_read_again_not_a_crash(k, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A copy from a mapping faults (SIGBUS) where the file was cut short after it was mapped: the
    guard takes the fault, the piece is read again with pread, and the call reports the end of the
    file -- the process lives on, with Python's faulthandler on as under pytest."""
    run = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _CUT_SHORT, str(tmp_path / "f.bin")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    whole, short, faults = map(int, run.stdout.split())
    assert faults > 0 and short > 0, (whole, short, faults)


_BUS_HANDLER = """
import ctypes, os, signal, sys
import torch
import bytecp
libc = ctypes.CDLL(None, use_errno=True)
def handler() -> int:  # SIGBUS's handler as the kernel has it (struct sigaction begins with it)
    act = ctypes.create_string_buffer(256)
    assert libc.sigaction(int(signal.SIGBUS), None, act) == 0
    return int.from_bytes(act.raw[:8], "little")
before = handler()
bytecp.save(sys.argv[1], {"w": torch.arange(1 << 20, dtype=torch.float32)})
got = {"w": torch.empty(1 << 20)}
bytecp.load(sys.argv[1], got)
assert torch.equal(got["w"], torch.arange(1 << 20, dtype=torch.float32))
print(int(handler() != before))
"""


@pytest.mark.spawn
def test_a_process_with_mapped_reads_off_keeps_its_sigbus_handler(k, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The guard over SIGBUS is installed by a mapped read only: with ``BYTECP_MAPPED_READS=0`` a
    process (Python's faulthandler on) keeps its own handler through the self-check and a load; with
    mapped reads on, the first mapped read (the self-check's, at the load) installs the guard."""
    changed = []
    for want in ("0", "1"):
        env = {**os.environ, "BYTECP_MAPPED_READS": want}
        run = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _BUS_HANDLER, str(tmp_path / want)],
                             capture_output=True, text=True, timeout=120, env=env)
        assert run.returncode == 0, run.stderr[-2000:]
        changed.append(run.stdout.split()[-1])
    assert changed == ["0", "1"]


def test_the_mapped_reads_setting(k, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    data = os.urandom(3 * MiB)
    (tmp_path / "f.bin").write_bytes(data)
    st = open_storage(str(tmp_path))
    real, asked, copied = k.read_sums, [], []

    def spy(*args: object) -> object:  # what the local backend asks of the compiled call
        asked.append(args[5])
        return real(*args)

    monkeypatch.setattr(k, "read_sums", spy)
    got = []
    for want in ("0", "1", ""):
        monkeypatch.setenv("BYTECP_MAPPED_READS", want)
        assert checked_reads.mapped() is (want != "0")
        buf = memoryview(bytearray(2 * MiB))
        before = k.mapped_bytes()
        got.append(st.read_ranges_summed("f.bin", [(7, buf)], np.asarray([7, 2 * MiB + 7], np.int64)).tolist())
        copied.append(k.mapped_bytes() - before)
        assert buf == data[7 : 2 * MiB + 7]
    assert got == [[checksum.crc32c(data[7 : 2 * MiB + 7])]] * 3
    assert asked == [False, True, True] and copied == [0, 2 * MiB, 2 * MiB]  # the setting reaches the read, which maps
    monkeypatch.setenv("BYTECP_MAPPED_READS", "on")
    with pytest.raises(ConfigError, match="BYTECP_MAPPED_READS='on': use 0"):
        checked_reads.mapped()


def test_the_local_backend_sums_buffered_reads_and_names_a_short_file(k, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    data = os.urandom(2 * MiB)
    (tmp_path / "f.bin").write_bytes(data)
    st = open_storage(str(tmp_path))
    assert st.sums_reads and not open_storage(str(tmp_path), direct=True).sums_reads
    bufs = [memoryview(bytearray(MiB - 5)), memoryview(bytearray(5))]
    crcs = st.read_ranges_summed("f.bin", [(10, bufs[0]), (MiB + 5, bufs[1])], np.asarray([10, MiB + 10], np.int64))
    assert crcs.tolist() == [checksum.crc32c(data[10 : MiB + 10])]
    with pytest.raises(CorruptCheckpointError, match=r"f\.bin: file is truncated: wanted bytes \[2097000, 2098000\)"):
        st.read_ranges_summed("f.bin", [(2_097_000, memoryview(bytearray(1000)))], np.zeros(0, np.int64))


def test_a_failing_or_unwanted_build_is_not_used(k, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("BYTECP_CHECKED_READS", "0")
    assert checked_reads.load() is None
    monkeypatch.setenv("BYTECP_CHECKED_READS", "yes")
    with pytest.raises(ConfigError, match="BYTECP_CHECKED_READS='yes': use 0"):
        checked_reads.load()
    monkeypatch.setattr(checked_reads, "_self_check", lambda k: "its crc32c differs (a test)")
    monkeypatch.setenv("BYTECP_CHECKED_READS", "1")
    with pytest.raises(ConfigError, match="BYTECP_CHECKED_READS=1 but .* its crc32c differs"):
        checked_reads.load()
    monkeypatch.delenv("BYTECP_CHECKED_READS")
    assert checked_reads.load() is None and "are not used: its crc32c differs" in caplog.text


def test_a_process_that_cannot_make_the_checks_file_sums_in_python_without_a_warning(
        k, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    """(a file size limit, RLIMIT_FSIZE: writing the self-check's file fails with EFBIG)"""
    import errno

    def refused(*a: object) -> int:
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(os, "memfd_create", refused)
    assert checked_reads.load() is None and not caplog.text


@pytest.mark.parametrize("apart", [False, True], ids=["one-block-shared", "apart"])
def test_a_resharded_load_is_summed_by_the_storage_unless_its_checks_share_a_block(  # type: ignore[no-untyped-def]
        k, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, apart: bool) -> None:
    """Rows 100..200 and 600..700 of a tensor (1 MiB blocks of 262 rows): each
    check's blocks summed by the compiled read, one span a block; rows 100..200
    and 200..300 share the block holding row 200 (their checks overlap): fed to
    the checks as before. Bitwise either way, and a flip in a block read is
    refused either way."""
    import types

    w = torch.randn(1024, 1000)
    monkeypatch.setattr(checksum, "BLOCK_BYTES", MiB)
    bytecp.save(str(tmp_path / "ck"), {"w": w})
    boxes = [Region((100, 0), (100, 1000)), Region((600 if apart else 200, 0), (100, 1000))]
    spans: list[int] = []

    def counted(fd: int, ranges: list, segs: np.ndarray, *rest: object) -> object:  # type: ignore[type-arg]
        spans.append(len(segs) // 2)
        return k.read_sums(fd, ranges, segs, *rest)

    monkeypatch.setattr(checked_reads, "_LOADED", [types.SimpleNamespace(read_sums=counted)])

    def load() -> list[torch.Tensor]:
        opened = open_checkpoint(str(tmp_path / "ck"))
        rows = opened.rows_for({"w": boxes}).rows
        blocks = block_bytes_of(opened.metadata)
        targets = [Target("w", b, torch.empty(b.lengths)) for b in boxes]
        reqs = plan_load([("w", b) for b in boxes], rows, block_bytes=blocks, itemsizes={"w": 4})
        execute_reads(opened.storage, rows, targets, reqs, io_threads=1, verify=True, trace=Trace("load", "t"),
                      block_bytes=blocks)
        return [t.view for t in targets]

    got = load()
    assert all(torch.equal(g, w[b.slices()]) for g, b in zip(got, boxes, strict=True))
    assert spans == ([2] if apart else [])  # rows 100..200: block 0; 600..700: block 2
    (row,) = open_checkpoint(str(tmp_path / "ck")).all_rows()
    raw = bytearray((tmp_path / "ck" / row.file).read_bytes())
    raw[row.byte_offset + 150 * 4000 + 3] ^= 1  # row 150: block 0 of the chunk
    (tmp_path / "ck" / row.file).write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'w' region \[0:1024, 0:1000\], block 0 of 4"):
        load()


_WINDOWED = """
import os, sys
import numpy as np
from bytecp.format import checked_reads

def peak_kib() -> int:  # (this process's own: ru_maxrss keeps the forking parent's peak across exec)
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM:")).split()[1])

k = checked_reads.compiled()
n = os.path.getsize(sys.argv[1])
buf = bytearray(b"\\x01") * n  # (every page of the destination touched before the peak is taken)
before, mapped = peak_kib(), k.mapped_bytes()
with open(sys.argv[1], "rb") as f:
    got = k.read_sums(f.fileno(), [(0, buf)], np.asarray([0, n], np.int64), np.zeros(1, np.uint32), 1 << 18, True)
assert got is None and k.mapped_bytes() - mapped == n, (got, k.mapped_bytes() - mapped)
print(peak_kib() - before)
"""


@pytest.mark.spawn
def test_a_mapped_read_holds_one_window_of_the_file_in_the_resident_set(k, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The file's pages a mapped read has mapped count in the process's resident set while mapped:
    a 128 MiB read from the page cache raises the peak by about one 16 MiB window, not the file."""
    path = tmp_path / "f.bin"
    path.write_bytes(np.random.default_rng(5).integers(0, 256, 128 * MiB, np.uint8).tobytes())
    run = subprocess.run([sys.executable, "-c", _WINDOWED, str(path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    grew_kib = int(run.stdout)
    assert grew_kib < 40 * 1024, f"the peak resident set grew by {grew_kib} KiB reading 128 MiB mapped"
