"""async_save and lazy mode in one process: returns before the bytes are on
storage, snapshots the state at the call, reuses staging memory, never loses
a background failure."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import bytecp
from bytecp.saving import handles
from bytecp.saving.staging import POOL

from .helpers import same_bits


def model_and_opt(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(64, 129), nn.ReLU(), nn.Linear(129, 3))
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    step(m, opt)
    return m, opt


def step(m: nn.Module, opt: torch.optim.Optimizer) -> None:
    m(torch.randn(8, 64)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def snapshot(m: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {
        "model": {k: v.clone() for k, v in m.state_dict().items()},
        "optim": {(i, k): v.clone() for i, st in opt.state_dict()["state"].items() for k, v in st.items()},
    }


def assert_loaded_equals(url: str, snap: dict) -> None:
    m2, opt2 = model_and_opt(seed=5)
    bytecp.load(url, {"model": m2, "optimizer": opt2})
    for k, v in snap["model"].items():
        assert same_bits(v, m2.state_dict()[k]), k
    for (i, k), v in snap["optim"].items():
        assert same_bits(v, opt2.state_dict()["state"][i][k]), (i, k)


def test_async_returns_before_bytes_are_on_storage(tmp_path: Path, monkeypatch) -> None:
    m, opt = model_and_opt()
    snap = snapshot(m, opt)
    url = str(tmp_path / "ck")
    monkeypatch.setenv("BYTECP_FAULT_DELAY", "write:0:1.0")
    h = bytecp.async_save(url, {"model": m, "optimizer": opt})
    assert h.staged() and not h.done()
    assert not (tmp_path / "ck" / "metadata.json").exists()
    step(m, opt)  # training goes on: the staged copy is what gets written
    md = h.wait(timeout=60)
    assert h.done() and md.save_id and (tmp_path / "ck" / "metadata.json").exists()
    assert_loaded_equals(url, snap)


def _lazy_started_late(tmp_path: Path, monkeypatch: Any) -> tuple[nn.Module, torch.optim.Optimizer, Any, str, Any]:
    """A lazy save whose copy starts half a second after the call."""
    m, opt = model_and_opt()
    snap = snapshot(m, opt)
    url = str(tmp_path / "ck")
    monkeypatch.setenv("BYTECP_FAULT_DELAY", "stage:0:0.5")  # the copy starts late
    h = bytecp.async_save(url, {"model": m, "optimizer": opt}, lazy=True)
    assert not h.staged()
    return m, opt, snap, url, h


def test_lazy_checkpoint_is_the_state_at_the_call(tmp_path: Path, monkeypatch) -> None:
    m, opt, snap, url, h = _lazy_started_late(tmp_path, monkeypatch)
    for _ in range(3):  # the first step waits in the pre-step hook, then training runs on
        step(m, opt)
    h.wait(timeout=60)
    assert not same_bits(snap["model"]["0.weight"], m.state_dict()["0.weight"])
    assert_loaded_equals(url, snap)


def test_a_lazy_save_waits_for_an_optimizer_rebuilt_after_the_call(tmp_path: Path, monkeypatch) -> None:
    """Layers unfrozen right after a lazy call and the optimizer rebuilt over
    the same parameters: its first step (not the saved optimizer's) still
    waits for the copy, so the checkpoint holds the state at the call."""
    m, _, snap, url, h = _lazy_started_late(tmp_path, monkeypatch)
    rebuilt = torch.optim.SGD(m.parameters(), lr=0.5)
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    rebuilt.step()  # waits in the process-wide hook until the copies are done
    h.wait(timeout=60)
    assert not same_bits(snap["model"]["0.weight"], m.state_dict()["0.weight"])
    assert_loaded_equals(url, snap)
    t = time.perf_counter()
    rebuilt.step()  # nothing in flight: the hook only looks at an empty list
    assert time.perf_counter() - t < 5


def test_lazy_hook_coexists_with_hooks_registered_after_it(tmp_path: Path) -> None:
    m, opt = model_and_opt()
    snap = snapshot(m, opt)
    h = bytecp.async_save(str(tmp_path / "ck"), {"model": m, "optimizer": opt}, lazy=True)
    calls = []
    later = opt.register_step_pre_hook(lambda *a: calls.append(1))
    for _ in range(2):
        step(m, opt)  # must not break the optimizer's hook iteration
    h.wait(timeout=60)
    later.remove()
    assert calls == [1, 1]
    assert len(opt._optimizer_step_pre_hooks) == 0  # bytecp hooks no optimizer of its own
    assert not handles._WATCHED  # and its process-wide hook forgot the save
    assert_loaded_equals(str(tmp_path / "ck"), snap)


def test_staging_memory_is_reused_across_saves(tmp_path: Path) -> None:
    m, opt = model_and_opt()
    bytecp.async_save(str(tmp_path / "a"), {"model": m, "optimizer": opt}).wait()
    before = POOL.allocations
    for i in range(3):
        step(m, opt)
        bytecp.async_save(str(tmp_path / f"b{i}"), {"model": m, "optimizer": opt}).wait()
    assert POOL.allocations == before


def test_memory_budget_stages_in_batches(tmp_path: Path) -> None:
    m, opt = model_and_opt()
    snap = snapshot(m, opt)
    url = str(tmp_path / "ck")
    h = bytecp.async_save(url, {"model": m, "optimizer": opt}, memory_budget_bytes=40_000)
    step(m, opt)
    h.wait(timeout=60)
    assert len(list((tmp_path / "ck" / "data").rglob("*.bin"))) >= 3
    assert_loaded_equals(url, snap)


def test_one_save_in_flight_and_failures_are_never_lost(tmp_path: Path, monkeypatch, caplog) -> None:
    m, opt = model_and_opt()
    monkeypatch.setenv("BYTECP_FAULT_ERROR", "write:0")
    with caplog.at_level(logging.ERROR, logger="bytecp"):
        h = bytecp.async_save(str(tmp_path / "bad"), {"model": m, "optimizer": opt})
        with pytest.raises(RuntimeError, match="injected failure"):
            h.wait(timeout=60)
    assert any("async save" in r.message and "failed" in r.message for r in caplog.records)
    monkeypatch.delenv("BYTECP_FAULT_ERROR")
    # seen by wait(): the next save proceeds
    bytecp.async_save(str(tmp_path / "ok"), {"model": m, "optimizer": opt}).wait()
    # unseen: the next save (sync or async) raises it once
    monkeypatch.setenv("BYTECP_FAULT_ERROR", "write:0")
    bytecp.async_save(str(tmp_path / "bad2"), {"model": m, "optimizer": opt})
    bytecp.wait_for_pending_save(60)  # the write (and its fault) run in the background
    monkeypatch.delenv("BYTECP_FAULT_ERROR")
    with pytest.raises(bytecp.BytecpError, match="previous async save .* failed"):
        bytecp.save(str(tmp_path / "next"), {"model": m})
    bytecp.save(str(tmp_path / "next"), {"model": m})
    assert not (tmp_path / "bad" / "metadata.json").exists()


def test_a_new_save_waits_for_the_previous(tmp_path: Path, monkeypatch) -> None:
    m, opt = model_and_opt()
    monkeypatch.setenv("BYTECP_FAULT_DELAY", "write:0:0.6")
    first = bytecp.async_save(str(tmp_path / "a"), {"model": m, "optimizer": opt})
    second = bytecp.async_save(str(tmp_path / "b"), {"model": m, "optimizer": opt})
    assert first.done()  # the second call waited for it
    second.wait(timeout=60)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: pinned staging and side-stream copies need a GPU")
def test_cuda_state_is_staged_through_pinned_memory(tmp_path: Path) -> None:
    m = nn.Linear(256, 257).cuda()
    want = {k: v.cpu() for k, v in m.state_dict().items()}
    h = bytecp.async_save(str(tmp_path / "ck"), {"model": m})
    with torch.no_grad():
        m.weight.add_(1)
    h.wait(timeout=60)
    sd = bytecp.load_state_dict(str(tmp_path / "ck"))
    for k, v in want.items():
        assert same_bits(v, sd["model"][k])


def test_repeated_lazy_saves_each_hold_the_state_at_their_call(tmp_path: Path) -> None:
    """Saves after the first reuse what the first worked out (names, boxes):
    each checkpoint is still bitwise the state at its own call."""
    m, opt = model_and_opt()
    snaps = []
    for i in range(3):
        snaps.append(snapshot(m, opt))
        h = bytecp.async_save(str(tmp_path / f"ck{i}"), {"model": m, "optimizer": opt}, lazy=True)
        step(m, opt)  # waits in the pre-step hook for the copy, then changes every tensor
        h.wait(timeout=60)
    for i, snap in enumerate(snaps):
        assert_loaded_equals(str(tmp_path / f"ck{i}"), snap)


@pytest.mark.parametrize("lazy", [True, False])
def test_the_collector_is_resumed_after_the_call_and_left_as_the_user_set_it(tmp_path: Path, lazy: bool) -> None:
    import gc

    m, opt = model_and_opt()
    state = {"model": m, "optimizer": opt}
    assert gc.isenabled()
    bytecp.async_save(str(tmp_path / "a"), state, lazy=lazy).wait(timeout=60)
    assert gc.isenabled()  # the background thread turned it on again
    gc.disable()  # a training loop that collects by itself
    try:
        bytecp.async_save(str(tmp_path / "b"), state, lazy=lazy).wait(timeout=60)
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(bytecp.ConfigError):  # a call that fails turns it on itself
        bytecp.async_save(str(tmp_path / "c"), state, lazy=lazy, framework="no-such-framework")
    assert gc.isenabled()


@contextlib.contextmanager
def _open_in_another_thread(block: Callable[[], Any]) -> Iterator[Callable[[], None]]:
    """``block()`` (a context manager) entered on another thread, open while
    the caller's block runs; the function given ends it (and joins the thread)."""
    import threading

    began, end = threading.Event(), threading.Event()

    def other() -> None:
        with block():
            began.set()
            end.wait(10)

    t = threading.Thread(target=other)
    t.start()
    began.wait(10)

    def finish() -> None:
        end.set()
        t.join(10)

    try:
        yield finish
    finally:
        finish()


def test_collector_pauses_of_two_threads_nest() -> None:
    """The union's thread and a commit (or an async call) each pause the
    collector: whichever ends first leaves it off for the other, and the
    last one turns it on again (bytecp/tree/bulk.py)."""
    import gc

    from bytecp.tree.bulk import gc_paused, pause_gc, resume_gc

    assert gc.isenabled()
    with _open_in_another_thread(gc_paused) as end_other:
        pause_gc()  # (this thread's, begun while the other's is open)
        end_other()
    assert not gc.isenabled()  # the other ended first: still paused for this one
    resume_gc()
    assert gc.isenabled()
    pause_gc()
    with gc_paused():
        pass
    assert not gc.isenabled()
    resume_gc()
    assert gc.isenabled()
    resume_gc()  # (one more end than pauses: harmless)
    assert gc.isenabled()


def test_the_background_of_an_async_save_runs_with_the_heap_frozen(tmp_path: Path, monkeypatch) -> None:
    """An async save's background part runs with every object that existed
    when it began frozen (its collections of the oldest generation then
    traverse only what was made since, not the training process's whole
    heap); the heap is unfrozen once it ends, after a failure too; a heap the
    process froze itself stays frozen, and blocks of several threads nest."""
    import gc

    from bytecp.saving import schedule
    from bytecp.tree.bulk import heap_frozen

    m = nn.Linear(4, 4)
    seen: list[int] = []
    real = schedule.eager

    def eager(p, handle):  # the background part records the freeze it runs in
        background = real(p, handle)
        return lambda: (seen.append(gc.get_freeze_count()), background())[1]

    monkeypatch.setattr(schedule, "eager", eager)
    gc.unfreeze()  # (the session froze what its imports made: tests/conftest.py; frozen again below)
    try:
        bytecp.async_save(str(tmp_path / "a"), {"model": m}).wait()
        assert len(seen) == 1 and seen[0] > 0 and gc.get_freeze_count() == 0
        with pytest.raises(bytecp.CheckpointExistsError):  # the background part fails
            bytecp.async_save(str(tmp_path / "a"), {"model": m}).wait()
        assert len(seen) == 2 and seen[1] > 0 and gc.get_freeze_count() == 0

        with _open_in_another_thread(heap_frozen) as end_other, heap_frozen():
            assert gc.get_freeze_count() > 0
            end_other()
            assert gc.get_freeze_count() > 0  # the other ended first: still frozen for this one
        assert gc.get_freeze_count() == 0
        with heap_frozen():
            made = [[] for _ in range(1000)]  # (objects the collector tracks)
            gc.freeze()  # a freeze of the process's own while the block is open ...
        assert gc.get_freeze_count() > 0 and made  # ... is kept
        gc.unfreeze()
    finally:
        gc.freeze()  # the process's own freeze (here the session's) ...
    frozen = gc.get_freeze_count()
    bytecp.async_save(str(tmp_path / "b"), {"model": m}).wait()
    with heap_frozen():
        pass
    assert frozen > 0 and gc.get_freeze_count() > 0  # ... is kept (unfrozen, it would be 0)


def test_saves_run_on_one_kept_thread_each_in_a_fresh_context(tmp_path: Path) -> None:
    """The background thread is started once (an async call never waits for a
    new thread to be scheduled) and kept for the next save of the same nice
    level; each save sees contextvars as a new thread would."""
    import threading

    from bytecp.dist_raw import DEADLINE
    from bytecp.saving.handles import _worker

    m = nn.Linear(4, 4)
    h1 = bytecp.async_save(str(tmp_path / "a"), {"model": m})
    h1.wait()
    h2 = bytecp.async_save(str(tmp_path / "b"), {"model": m}, lazy=True)
    h2.wait()
    assert h1.thread is h2.thread and h2.thread is not None and h2.thread.is_alive()
    h3 = bytecp.async_save(str(tmp_path / "c"), {"model": m}, background_nice=3)
    h3.wait()
    assert h3.thread is not h1.thread and h3.thread is not None and h3.thread.is_alive()
    seen: list[object] = []
    done = threading.Event()

    def job() -> None:
        seen.append(DEADLINE.get())
        DEADLINE.set(1.0)  # left set: the next job must not see it
        done.set()

    for _ in range(2):
        done.clear()
        _worker(0).submit(job)
        assert done.wait(30)
    assert seen == [None, None]
