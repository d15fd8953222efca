"""Staging for async saves: GIL-free host copies (bitwise, any thread count,
crc32c fused with the copy), the arena laid out as the data files are
(page-aligned, zero-padded boxes written by O_DIRECT without a bounce
copy), and the options that steer it."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from bytecp.storage.local import LocalStorage
from torch import nn

import bytecp
from bytecp.format import checked_reads, checksum
from bytecp.format import metadata as fmt
from bytecp.format.checksum import crc32c, sums
from bytecp.plan.planner import WriteItem
from bytecp.saving.hostcopy import (
    SMALL_BYTES,
    SMALL_NUMEL,
    CopyPlan,
    copy_boxes,
    fast_copy_available,
    work_on_threads,
)
from bytecp.saving.staging import PAGE_ALIGN_MIN_BYTES, StagingPool
from bytecp.storage_api import open_storage
from bytecp.tools.inspect import verify
from bytecp.tree.dtypes import dtype_name, host_memoryview
from bytecp.tree.regions import full_region
from bytecp.tree.skeleton import Node
from bytecp.tree.state import FlatTree, TensorLeaf

from .helpers import same_bits


def _sources() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(3 << 20, generator=g)  # 12 MiB: split into pieces with several threads
    return [
        big,
        torch.randn(9 << 20, generator=g),  # 36 MiB: copied whole, then summed
        torch.randn(33, 77, generator=g),
        torch.randn(40, 30, generator=g).t(),  # not contiguous: torch's copy
        torch.randint(0, 255, (1000,), dtype=torch.uint8, generator=g),
        torch.randn(16, dtype=torch.complex64, generator=g).conj(),  # a lazy conjugate view
        torch.empty(0, 5),
        torch.arange(10, dtype=torch.int64)[2:9],  # storage offset
        torch.randn(SMALL_NUMEL, generator=g),  # the largest box torch copies with the small ones
        torch.randn(SMALL_NUMEL + 1, generator=g),  # under SMALL_BYTES but a memcpy (torch would split it)
        torch.randn(SMALL_NUMEL * 2, generator=g).to(torch.bfloat16),  # 128 KiB of bf16: a memcpy
    ]


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("checksums", [False, True])
def test_copy_boxes_is_bitwise_and_sums_what_it_copied(threads: int, checksums: bool, compiled: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    if compiled and checked_reads.compiled() is None:
        pytest.skip("the compiled checked reads are not built here, or this CPU lacks SSE4.2")
    if not compiled:  # each piece copied by memcpy, then summed in Python
        monkeypatch.setattr(checked_reads, "_LOADED", [None])
    srcs = _sources()
    dsts = [torch.full(s.shape, 7, dtype=s.dtype) if s.numel() else torch.empty(s.shape, dtype=s.dtype)
            for s in srcs]
    crcs = copy_boxes(list(zip(dsts, srcs, strict=True)), threads=threads, checksums=checksums)
    for d, s in zip(dsts, srcs, strict=True):
        assert same_bits(d, s.resolve_conj())
    if checksums:  # each box's crc32c and its block checksums, one pass (format/checksum.py)
        assert crcs == [sums(host_memoryview(d.contiguous())) for d in dsts]
        assert [c.crc for c in crcs if c is not None] == [crc32c(host_memoryview(d.contiguous())) for d in dsts]
    else:
        assert crcs == [None] * len(srcs)


@pytest.mark.parametrize("block", [64 << 10, 100_000, 1 << 30])
def test_a_large_box_summed_by_the_compiled_copies_is_split_in_whole_blocks(block: int,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled copies sum each block as they copy it, so a large box is shared by the
    threads in pieces of whole blocks and its crc32c is combined from its blocks' at the end:
    the same :class:`Sums` as one pass over it, whatever the block size (one not a power of two,
    one larger than the box)."""
    if checked_reads.compiled() is None:
        pytest.skip("the compiled checked reads are not built here, or this CPU lacks SSE4.2")
    monkeypatch.setattr(checksum, "BLOCK_BYTES", block)
    g = torch.Generator().manual_seed(1)
    srcs = [torch.randint(0, 255, ((40 << 20) + 12_345,), dtype=torch.uint8, generator=g),
            torch.randn(300_001, generator=g)]
    dsts = [torch.zeros_like(s) for s in srcs]
    plan = CopyPlan(list(zip(dsts, srcs, strict=True)))
    run = plan.start(checksums=True, split=True)
    assert run.block == block and sum(1 for u in run.units if u[1] == 0) == (1 if block > 40 << 20 else 3)
    work_on_threads(run, 3)
    got = run.result()
    for d, s, c in zip(dsts, srcs, got, strict=True):
        assert same_bits(d, s)
        assert c == sums(host_memoryview(s), block) and c is not None and c.crc == crc32c(host_memoryview(s))


def test_boxes_torch_would_split_over_its_threads_are_memcpy_pieces() -> None:
    """Small boxes go to torch together only while torch copies each on the
    calling thread (at most SMALL_NUMEL elements); larger ones are pieces."""
    srcs = _sources()
    plan = CopyPlan([(torch.empty_like(s), s) for s in srcs])
    small = {i for i in plan.small}
    for i, s in enumerate(srcs):
        nbytes = s.numel() * s.element_size()
        assert (i in small) == (nbytes < SMALL_BYTES and s.numel() <= SMALL_NUMEL), (i, s.shape, s.dtype)
    assert len(srcs) - 3 in small and len(srcs) - 2 not in small and len(srcs) - 1 not in small


def test_copy_errors_reach_the_caller_from_any_thread() -> None:
    srcs = [torch.randn(1 << 20), torch.randn(1 << 20), torch.randn(3, 3)]
    dsts = [torch.empty(1 << 20), torch.empty(1 << 20), torch.empty(3, 4)]  # the last one does not fit
    with pytest.raises(RuntimeError):
        copy_boxes(list(zip(dsts, srcs, strict=True)), threads=3)


def test_fast_copies_release_the_gil() -> None:
    if not fast_copy_available():
        pytest.skip("no C library memcpy on this platform: torch's copy is used")
    src, dst = torch.randn(64 << 20 // 4), torch.empty(64 << 20 // 4)
    ticks = 0
    stop = threading.Event()

    def count() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1

    t = threading.Thread(target=count)
    t.start()
    try:
        for _ in range(5):
            copy_boxes([(dst, src)], threads=1, checksums=True)
    finally:
        stop.set()
        t.join()
    assert same_bits(dst, src)
    assert ticks > 1000  # the other thread ran Python while the copies ran


def _flat(tensors: dict[str, torch.Tensor]) -> tuple[FlatTree, list[WriteItem]]:
    leaves = {k: TensorLeaf.full(v) for k, v in tensors.items()}
    items = [WriteItem(k, full_region(tuple(v.shape)), dtype_name(v.dtype), v.element_size(), tuple(v.shape))
             for k, v in tensors.items()]
    return FlatTree(Node.container("dict", ()), leaves, {}, {}, {}), items


def test_large_boxes_are_laid_out_in_the_arena_as_in_a_data_file() -> None:
    pool = StagingPool()
    a = {"big": torch.randn(PAGE_ALIGN_MIN_BYTES // 4 + 3), "small": torch.randn(5), "big2": torch.randn(100_000)}
    flat, items = _flat(a)
    # the arena first holds other bytes, so its padding must be written as zeros
    other, other_items = _flat({"x": torch.full((400_000,), -1.0)})
    pool.stage(other, other_items)
    for s in pool.stage(flat, items, checksums=True):
        t = a[s.item.fqn]
        assert bytes(s.data) == bytes(host_memoryview(t))
        assert s.sums is not None and s.sums.crc == crc32c(s.data) and s.sums == sums(s.data)
        if s.item.nbytes >= PAGE_ALIGN_MIN_BYTES:
            assert s.padded is not None
            assert len(s.padded) % fmt.ALIGNMENT == 0 and len(s.padded) - len(s.data) < fmt.ALIGNMENT
            addr = torch.frombuffer(s.padded, dtype=torch.uint8).data_ptr()
            assert addr % fmt.ALIGNMENT == 0
            assert bytes(s.padded[len(s.data):]) == bytes(len(s.padded) - len(s.data))
        else:
            assert s.padded is None
    assert pool.allocations == 1


def test_aligned_buffers_are_written_direct_without_a_bounce_copy(tmp_path: Path, monkeypatch) -> None:
    st = LocalStorage(str(tmp_path), direct=True)
    flat, items = _flat({"w": torch.randn(300_000), "b": torch.randn(3)})
    staged = StagingPool().stage(flat, items)
    aligned = staged[0].padded
    assert aligned is not None
    unaligned = memoryview(b"\x01" * 1000)
    tail = memoryview(bytes(range(256)) * 5)
    calls: list[tuple[int, int]] = []
    real = os.pwrite

    def pwrite(fd: int, data: object, offset: int) -> int:
        mv = memoryview(data)  # type: ignore[arg-type]
        calls.append((offset, len(mv)))
        return real(fd, mv, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    st.write_file("data/f.bin", [unaligned, memoryview(bytes((-1000) % 4096)), aligned, tail])
    if not st.direct:
        pytest.skip("this filesystem refuses O_DIRECT: buffered writes were used")
    want = b"\x01" * 1000 + bytes((-1000) % 4096) + bytes(aligned) + bytes(tail)
    assert (tmp_path / "data" / "f.bin").read_bytes() == want
    # the bounced first page, then the aligned view in one write of its own
    assert calls[:2] == [(0, 4096), (4096, len(aligned))]


def test_async_save_writes_the_same_files_as_a_sync_save(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(300, 301), nn.ReLU(), nn.Linear(301, 7))
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(4, 300)).sum().backward()
    opt.step()
    state = {"model": m, "optimizer": opt}
    bytecp.save(str(tmp_path / "sync"), state)
    bytecp.async_save(str(tmp_path / "eager"), state).wait(timeout=60)
    bytecp.async_save(str(tmp_path / "lazy"), state, lazy=True).wait(timeout=60)
    # the second eager save copies the cached plan's share, summed on the way
    bytecp.async_save(str(tmp_path / "eager2"), state, verify_replicas=True).wait(timeout=60)

    def contents(name: str) -> list[bytes]:
        return sorted(p.read_bytes() for p in (tmp_path / name / "data").rglob("*.bin"))

    want = contents("sync")
    for name in ("eager", "lazy", "eager2"):
        assert contents(name) == want, name
        checked, problems = verify(open_storage(str(tmp_path / name)))
        assert checked and not problems, (name, problems)


def test_staging_options_are_validated() -> None:
    m = nn.Linear(2, 2)
    for kw in ({"staging_threads": 0}, {"background_nice": -1}, {"background_nice": 20}):
        with pytest.raises(bytecp.ConfigError, match=next(iter(kw))):
            bytecp.async_save("/tmp/never", {"model": m}, **kw)


class _Priority:
    """A recorder noting the scheduling priority of the thread that ends a save."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_report(self, report: object) -> None:
        self.seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    def on_event(self, name: str, value: float, labels: dict[str, str]) -> None:
        pass


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="no per-thread nice values on this OS")
def test_the_background_thread_runs_at_the_lower_priority_asked_for(tmp_path: Path) -> None:
    m = nn.Linear(8, 8)
    rec = _Priority()
    for nice in (0, 5):
        bytecp.async_save(str(tmp_path / f"n{nice}"), {"model": m}, background_nice=nice, monitor=rec).wait(60)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert rec.seen == [mine, min(19, mine + 5)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # the caller's is untouched


def test_a_snapshot_keeps_the_tensors_in_the_live_trees_order() -> None:
    """The copy of a cached share comes in plan order; the snapshot's tree
    must keep the live order (every rank compares a digest of its specs)."""
    from bytecp.plan.exchange import specs_digest

    flat, items = _flat({"a": torch.randn(4), "b": torch.randn(3), "c": torch.randn(2)})
    copy, _ = StagingPool().snapshot(flat, [items[2], items[0]])
    assert list(copy.tensors) == ["a", "b", "c"] and not copy.tensors["b"].shards
    assert specs_digest(copy) == specs_digest(flat)
    assert torch.equal(copy.tensors["c"].shards[0].tensor, flat.tensors["c"].shards[0].tensor)


@pytest.mark.parametrize("debug", [False, True])
def test_a_save_of_an_unchanged_state_reuses_the_last_placement_and_writes_the_same_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, debug: bool) -> None:
    """Async saves of a state whose description is kept copy into the arena
    as the last one laid it out (no layout or views per box on the caller's
    thread): each one's files are byte for byte a blocking save's of the same
    state, the padding zeros included (in debug mode the released arena is
    poisoned between saves, so the padding is written again); a change of
    structure lays the boxes out afresh."""
    from bytecp.saving.staging import POOL

    if debug:
        monkeypatch.setenv("BYTECP_DEBUG_BUFFERS", "1")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(300, 301), nn.ReLU(), nn.Linear(301, 7))  # boxes above and below a page
    opt = torch.optim.Adam(m.parameters())
    state = {"model": m, "optimizer": opt}

    def contents(name: str) -> list[bytes]:
        return sorted(p.read_bytes() for p in (tmp_path / name / "data").rglob("*.bin"))

    def step(i: int) -> None:
        m(torch.randn(4, 300, generator=torch.Generator().manual_seed(i))).sum().backward()
        opt.step()
        opt.zero_grad()

    step(0)
    for name in ("first", "planned"):  # described and laid out, then the plan cached (its boxes the next stages')
        bytecp.async_save(str(tmp_path / name), state).wait(timeout=60)
    for i, how in enumerate(["eager", "lazy", "eager", "verify", "changed", "eager"], start=1):
        step(i)
        if how == "changed":  # another structure: laid out afresh, then kept in turn
            m[2] = nn.Linear(301, 9)
            opt = torch.optim.Adam(m.parameters())
            state["optimizer"] = opt
            step(i)
        reused = POOL.reused
        bytecp.save(str(tmp_path / f"sync{i}"), state)
        bytecp.async_save(str(tmp_path / f"async{i}"), state, lazy=how == "lazy",
                          verify_replicas=how == "verify").wait(timeout=60)
        assert POOL.reused == reused + (how != "changed"), how
        assert contents(f"async{i}") == contents(f"sync{i}"), (i, how)
        checked, problems = verify(open_storage(str(tmp_path / f"async{i}")))
        assert checked and not problems, (i, how, problems)
        same = bytecp.load_state_dict(str(tmp_path / f"async{i}"))["model"]
        assert all(same_bits(same[k], v) for k, v in m.state_dict().items()), (i, how)


@pytest.mark.parametrize("lazy", [False, True])
def test_an_incremental_save_copies_what_changed_into_the_last_placement(tmp_path: Path, lazy: bool) -> None:
    """A manager's incremental saves copy only the boxes that changed since
    the previous save: some of the boxes of the last full stage, copied into
    their places there. Every checkpoint loads bitwise as the state at its step."""
    from bytecp.saving.staging import POOL

    torch.manual_seed(1)
    m = nn.Sequential(nn.Linear(64, 300), nn.ReLU(), nn.Linear(300, 5), nn.Linear(5, 5))
    for p in m[0].parameters():  # frozen: unchanged between saves (referenced, not copied)
        p.requires_grad_(False)
    opt = torch.optim.Adam([p for p in m.parameters() if p.requires_grad])
    state = {"model": m, "optimizer": opt}
    mgr = bytecp.CheckpointManager(str(tmp_path / "run"), every_n_steps=1, keep_last=None, async_save=True,
                                   lazy=lazy)
    want = {}
    for step in range(1, 6):
        m(torch.randn(4, 64, generator=torch.Generator().manual_seed(step))).sum().backward()
        opt.step()
        opt.zero_grad()
        if step == 4:  # every box: the full stage's own places again
            bytecp.async_save(str(tmp_path / "full"), state, lazy=lazy).wait(timeout=60)
        reused = POOL.reused
        mgr.maybe_save(step, state)
        mgr.wait()
        if step >= 3:  # (the first saves describe, lay out and plan)
            assert POOL.reused == reused + 1, step
        want[step] = {k: v.clone() for k, v in m.state_dict().items()}

    for step, sd in want.items():
        got = bytecp.load_state_dict(str(tmp_path / "run" / f"step-{step}"))["model"]
        assert all(same_bits(got[k], v) for k, v in sd.items()), step
        checked, problems = verify(open_storage(str(tmp_path / "run" / f"step-{step}")))
        assert checked and not problems, (step, problems)
    md = fmt.Metadata.from_bytes((tmp_path / "run" / "step-5" / "metadata.json").read_bytes(), "step-5")
    assert md.references, "the frozen layer was copied again, not referenced"


def test_laying_boxes_out_keeps_the_pinned_arena_and_an_empty_stage_keeps_the_placement(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage that lays boxes out anew lets the last placement's views go,
    never the arena's pinning (a CUDA state's next stage would find it
    pageable, allocate a larger arena and never reuse a placement); a stage
    of no boxes (an incremental save with nothing changed) leaves the
    placement to the next one. Pinning faked: this host has no CUDA."""
    from bytecp.plan.exchange import holdings
    from bytecp.saving import arena
    from bytecp.tree.state import flatten_tree, prebuild

    closed: list[int] = []

    class Pinned:  # a pinned arena as bytecp.device_memory.PinnedBuffer gives it, close() recorded
        def __init__(self, n: int) -> None:
            self.tensor = torch.zeros(n + 4096, dtype=torch.uint8)

        def close(self) -> None:
            closed.append(self.tensor.data_ptr())

    def host_arena(n: int, pinned: bool) -> tuple[torch.Tensor, Pinned]:
        assert pinned, "the arena was allocated pageable"
        b = Pinned(n)
        return b.tensor, b

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(arena, "_host_arena", host_arena)
    state = {"w": torch.randn(100_000), "b": torch.randn(7)}
    flat = flatten_tree({"model": prebuild(state, "model")})  # a kept description's piece
    items = holdings(flat, 0)[0].items
    pool = StagingPool()
    pool.arena(items, pinned=True)  # what prewarm does for a CUDA state
    for _ in range(3):
        staged = pool.stage(flat, items)
        assert all(bytes(s.data) == bytes(host_memoryview(state[s.item.fqn.split(".")[-1]])) for s in staged)
        pool.stage(flat, [])
    assert closed == [] and pool.allocations == 1 and pool.reused == 2
    pool.release()
    assert len(closed) == 1


@pytest.mark.parametrize("debug", [False, True])
def test_saves_under_a_memory_budget_copy_their_batches_into_the_last_placement(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, debug: bool) -> None:
    """A save under a memory budget stages its boxes batch by batch; each
    batch is some of the boxes of the last full stage, copied into their
    places there (the arena holds them all). Budgeted, eager, lazy and
    blocking saves in turn: every checkpoint is the state at its call,
    bitwise, and verifies clean."""
    from bytecp.saving.staging import POOL

    if debug:
        monkeypatch.setenv("BYTECP_DEBUG_BUFFERS", "1")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(300, 301), nn.ReLU(), nn.Linear(301, 7), nn.Linear(7, 600))
    opt = torch.optim.Adam(m.parameters())
    state = {"model": m, "optimizer": opt}
    budgeted = 0
    for i, how in enumerate(["eager", "eager", "budget", "eager", "budget", "lazy", "budget", "sync", "eager"]):
        m(torch.randn(4, 300, generator=torch.Generator().manual_seed(i))).sum().backward()
        opt.step()
        opt.zero_grad()
        want = {k: v.clone() for k, v in m.state_dict().items()}
        url, reused = str(tmp_path / f"c{i}"), POOL.reused
        if how == "sync":
            bytecp.save(url, state)
        else:
            bytecp.async_save(url, state, lazy=how == "lazy",
                              memory_budget_bytes=(200 << 10) if how == "budget" else None).wait(timeout=60)
        if how == "budget" and i > 2:
            budgeted += POOL.reused - reused
        got = bytecp.load_state_dict(url)["model"]
        assert all(same_bits(got[k], v) for k, v in want.items()), (i, how)
        checked, problems = verify(open_storage(url))
        assert checked and not problems, (i, how, problems)
    assert budgeted >= 4, "the budgeted saves' batches were laid out anew"
