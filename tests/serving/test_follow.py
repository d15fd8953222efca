"""bytecp.follow: a follower keeps its state at the run's newest checkpoint,
reads only what changed, keeps the previous weights whole when an update
fails, skips to the newest when behind, and pins what it reads."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import bytecp
from bytecp.loading.opened import open_checkpoint
from bytecp.serving import staging as staging_mod

pytestmark = pytest.mark.timeout(300)


def _model(seed: int = 0, frozen: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    if frozen:
        model[0].requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
    return model, opt


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 64)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype for k in sa)


def _clone(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


def test_follower_holds_each_step_bitwise_and_reads_only_what_changed(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    model, opt = _model(frozen=True)
    mgr = bytecp.CheckpointManager(run, every_n_steps=1, keep_last=2)
    served, _ = _model(seed=7)
    gen = bytecp.follow(run, {"model": served}, poll_s=0.01)
    frozen_bytes = sum(t.nbytes for t in model[0].parameters())
    for step in range(1, 6):
        _step(model, opt)
        mgr.save(step, {"model": model, "optimizer": opt})
        up = next(gen)
        assert up.ok and up.step == step and up.held == f"{run}/step-{step}" and up.skipped == 0, up
        assert _same(served, model), step
        if step == 1:
            assert up.tensors_read == 4 and up.tensors_unchanged == 0
        else:  # the frozen layer is referenced: never read again
            assert up.tensors_read == 2 and up.tensors_unchanged == 2 and up.unchanged_by_reference == 2, up
            assert up.bytes_read == sum(t.nbytes for t in model[2].parameters()) < frozen_bytes
    gen.close()
    assert not list(Path(run).glob("*/pins/*"))  # unpinned
    assert not list(Path(run).glob(".followers/leases/*"))  # its lease ended with it


def test_follower_in_a_thread_sees_every_update_bitwise(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    model, opt = _model()
    mgr = bytecp.CheckpointManager(run, every_n_steps=1, keep_last=3)
    want: dict[int, dict[str, torch.Tensor]] = {}
    got: dict[int, bool] = {}
    served, _ = _model(seed=3)
    stop = threading.Event()
    taken = threading.Semaphore(0)

    def serve() -> None:
        for up in bytecp.follow(run, {"model": served}, poll_s=0.01, stop=stop):
            assert up.ok, up
            got[up.step] = all(torch.equal(served.state_dict()[k], v) for k, v in want[up.step].items())
            taken.release()

    t = threading.Thread(target=serve)
    t.start()
    for step in range(1, 5):
        _step(model, opt)
        want[step] = _clone(model)
        mgr.save(step, {"model": model, "optimizer": opt})
        assert taken.acquire(timeout=60)
    stop.set()
    t.join(60)
    assert got == {1: True, 2: True, 3: True, 4: True}


def test_a_follower_behind_skips_to_the_newest(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    model, opt = _model()
    mgr = bytecp.CheckpointManager(run, every_n_steps=1, keep_last=10)
    served, _ = _model(seed=5)
    gen = bytecp.follow(run, {"model": served}, poll_s=0.01)
    _step(model, opt)
    mgr.save(1, {"model": model})
    assert next(gen).step == 1
    for step in (2, 3, 4):
        _step(model, opt)
        mgr.save(step, {"model": model})
    up = next(gen)
    assert up.ok and up.step == 4 and up.skipped == 2 and up.lag_steps == 0
    assert _same(served, model)
    gen.close()


def _model_row(url: str) -> Any:
    """A row of a model tensor in the checkpoint's own data files."""
    rows = open_checkpoint(url).all_rows()
    return next(r for r in rows if r.fqn.startswith("model.") and not r.file.startswith("../"))


@pytest.mark.parametrize("damage", ["deleted", "flipped"])
def test_a_failed_update_keeps_the_previous_weights_whole(tmp_path: Path, damage: str) -> None:
    run = str(tmp_path / "run")
    model, opt = _model()
    mgr = bytecp.CheckpointManager(run, every_n_steps=1, keep_last=5)
    served, _ = _model(seed=9)
    gen = bytecp.follow(run, {"model": served}, poll_s=0.01)
    _step(model, opt)
    mgr.save(1, {"model": model, "optimizer": opt})
    assert next(gen).ok
    at_1 = _clone(model)
    _step(model, opt)
    mgr.save(2, {"model": model, "optimizer": opt})
    row = _model_row(f"{run}/step-2")
    path = Path(run) / "step-2" / row.file
    if damage == "deleted":
        path.unlink()
    else:
        with path.open("r+b") as f:
            f.seek(row.byte_offset + row.nbytes // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
    up = next(gen)
    assert not up.ok and up.step == 2 and up.held == f"{run}/step-1", up
    assert ("Corrupt" in up.error or "NotFound" in up.error or "crc" in up.error.lower()), up.error
    assert all(torch.equal(served.state_dict()[k], v) for k, v in at_1.items())  # step 1, whole
    _step(model, opt)
    mgr.save(3, {"model": model, "optimizer": opt})  # the run goes on: the follower takes the next one
    up = next(gen)
    assert up.ok and up.step == 3 and _same(served, model)
    gen.close()


def test_on_error_raise_leaves_the_state_and_raises(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    model, _ = _model()
    bytecp.save(f"{run}/step-1", {"model": model}, step=1)
    served, _ = _model(seed=2)
    before = _clone(served)
    for f in (Path(run) / "step-1" / "data").rglob("*.bin"):
        f.write_bytes(b"\0" * f.stat().st_size)
    with pytest.raises(bytecp.CorruptCheckpointError):
        next(bytecp.follow(run, {"model": served}, poll_s=0.01, on_error="raise"))
    assert all(torch.equal(served.state_dict()[k], v) for k, v in before.items())


@pytest.mark.parametrize("pin", [True, False])
def test_what_is_read_is_pinned_and_retention_keeps_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       pin: bool) -> None:
    run = str(tmp_path / "run")
    model, opt = _model(frozen=True)
    mgr = bytecp.CheckpointManager(run, every_n_steps=1, keep_last=1, full_every=100)
    for step in (1, 2):
        _step(model, opt)
        mgr.save(step, {"model": model, "optimizer": opt})
    seen: list[list[str]] = []
    real = staging_mod.execute_reads

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(sorted(str(p.relative_to(run)) for p in Path(run).glob("*/pins/*")))
        # a retention of another process runs now: step-2 doomed (its base step-1 with it)
        from bytecp.storage_api import open_storage
        from bytecp.tools.retention import retain
        retain(open_storage(run), [], ["step-2"], lambda: [])
        return real(*args, **kwargs)

    monkeypatch.setattr(staging_mod, "execute_reads", spy)
    served, _ = _model(seed=4)
    up = next(bytecp.follow(run, {"model": served}, poll_s=0.01, pin=pin))
    if not pin:  # the retention deleted what was being read: the update fails, the state untouched
        assert not up.ok and not list(Path(run).glob("*/pins/*"))
        return
    assert up.ok and up.step == 2 and _same(served, model), up
    pins = seen[0]
    assert len(pins) == 2 and {p.split("/")[0] for p in pins} == {"step-1", "step-2"}
    assert all("/pins/.followers." in p for p in pins)
    assert json.loads((Path(run) / "step-2" / "base.json").read_text())  # retired, files kept for the reader


def test_follower_lag_and_bytes_reach_prometheus(tmp_path: Path) -> None:
    from bytecp.monitoring.prometheus import PrometheusRecorder
    from prometheus_client import CollectorRegistry

    from bytecp import recorder

    reg = CollectorRegistry()
    rec = recorder.add_recorder(PrometheusRecorder(reg, job="eval", rank=0))
    try:
        run = str(tmp_path / "run")
        model, opt = _model(frozen=True)
        mgr = bytecp.CheckpointManager(run, every_n_steps=1, keep_last=3)
        served, _ = _model(seed=1)
        gen = bytecp.follow(run, {"model": served}, poll_s=0.01)
        for step in (1, 2):
            _step(model, opt)
            mgr.save(step, {"model": model, "optimizer": opt})
            up = next(gen)
        gen.close()
        lab = {"job": "eval", "rank": "0"}
        assert reg.get_sample_value("bytecp_follower_update_bytes", lab) == up.bytes_read > 0
        assert reg.get_sample_value("bytecp_follower_lag_steps", lab) == 0
        assert 0 <= (reg.get_sample_value("bytecp_follower_lag_seconds", lab) or -1) < 60
    finally:
        recorder.remove_recorder(rec)


@pytest.mark.parametrize("swap", ["auto", "copy"])
def test_staged_storages_are_swapped_in_where_the_state_owns_them(tmp_path: Path, swap: str) -> None:
    """A parameter that alone holds its storage takes the staged storage (no
    copy; its old one stages the next update); a tensor something else views
    is copied into, so the view sees the new values too; ``swap="copy"`` copies all."""
    run = str(tmp_path / "run")
    model, opt = _model()
    mgr = bytecp.CheckpointManager(run, every_n_steps=1, keep_last=3)
    served, _ = _model(seed=6)
    view = served[2].weight.detach()[:2]  # a view held outside: its weight must be copied into
    ptrs = {n: p.data_ptr() for n, p in served.named_parameters()}
    gen = bytecp.follow(run, {"model": served}, poll_s=0.01, swap=swap)
    seen: list[dict[str, int]] = []
    for step in (1, 2, 3):
        _step(model, opt)
        mgr.save(step, {"model": model})
        assert next(gen).ok
        assert _same(served, model)
        assert torch.equal(view, model[2].weight[:2])
        seen.append({n: p.data_ptr() for n, p in served.named_parameters()})
    gen.close()
    assert seen[-1]["2.weight"] == ptrs["2.weight"]  # viewed: copied in place
    if swap == "copy":
        assert all(s == ptrs for s in seen)
    else:  # two storages alternate: each update's staging buffer is the previous one's
        assert seen[0]["0.weight"] != ptrs["0.weight"] and seen[1]["0.weight"] == ptrs["0.weight"]
        assert seen[2]["0.weight"] == seen[0]["0.weight"]


def test_a_follower_start_collects_garbage_only_when_a_target_looks_viewed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full collection costs tenths of a second to seconds in a large
    serving process: a follower whose targets each own their storage starts
    without one, as does one that copies (``swap="copy"``); one that swaps,
    whose target something else views, collects once (a cycle of the state
    walk might hold the view), then copies into that target."""
    from bytecp.serving import staging

    calls: list[int] = []
    real = staging.gc.collect
    monkeypatch.setattr(staging.gc, "collect", lambda *a, **k: calls.append(1) or real(*a, **k))
    run = str(tmp_path / "run")
    model, opt = _model()
    bytecp.CheckpointManager(run, every_n_steps=1).save(1, {"model": model})
    served, _ = _model(seed=6)
    gen = bytecp.follow(run, {"model": served}, poll_s=0.01)
    assert next(gen).ok and _same(served, model)
    gen.close()
    assert calls == []
    view = served[0].weight.detach()[:1]
    with torch.no_grad():
        served[0].weight.zero_()  # the values the second follower must bring back
    ptr = served[0].weight.data_ptr()
    gen = bytecp.follow(run, {"model": served}, poll_s=0.01, swap="copy")
    assert next(gen).ok
    gen.close()
    assert calls == []  # nothing is swapped: no view matters
    with torch.no_grad():
        served[0].weight.zero_()
    gen = bytecp.follow(run, {"model": served}, poll_s=0.01)
    assert next(gen).ok and _same(served, model)
    gen.close()
    assert calls == [1]
    assert served[0].weight.data_ptr() == ptr and torch.equal(view, model[0].weight[:1])  # copied into


_KILLED_CHILD = """
import pathlib, sys, time
import torch
from torch import nn
import bytecp
from bytecp.serving import staging
run, marker = sys.argv[1:3]
torch.manual_seed(1)
m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
def hang(*args, **kwargs):
    pathlib.Path(marker).write_text("reading")
    time.sleep(600)
staging.execute_reads = hang
next(bytecp.follow(run, {"model": m}, poll_s=0.01))
"""


@pytest.mark.spawn
def test_a_follower_killed_mid_update_leaves_nothing_that_blocks_the_run(tmp_path: Path) -> None:
    """SIGKILL mid-read: its pin stays, a new follower starts clean and takes
    the newest checkpoint, and once the dead one's lease lapses retention
    prunes the checkpoint it had pinned."""
    import os
    import signal
    import subprocess
    import sys
    import time

    run = str(tmp_path / "run")
    model, opt = _model()
    mgr = bytecp.CheckpointManager(run, every_n_steps=1, keep_last=1, full_every=1)
    _step(model, opt)
    mgr.save(1, {"model": model})
    marker = tmp_path / "reading"
    env = {**os.environ, "BYTECP_LEASE_SECONDS": "1", "PYTHONPATH": str(Path(bytecp.__file__).parents[1])}
    child = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD, run, str(marker)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert child.poll() is None and time.monotonic() < deadline, "the follower never started reading"
            time.sleep(0.05)
        assert list(Path(run).glob("step-1/pins/.followers.*"))  # pinned mid-read
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    assert list(Path(run).glob("step-1/pins/.followers.*"))  # a killed process removes nothing
    served, _ = _model(seed=8)  # a new follower: starts clean, takes the newest
    gen = bytecp.follow(run, {"model": served}, poll_s=0.01)
    up = next(gen)
    assert up.ok and up.step == 1 and _same(served, model), up
    gen.close()
    time.sleep(1.5)  # the dead follower's lease lapses
    for step in (2, 3):
        _step(model, opt)
        mgr.save(step, {"model": model})
    mgr.wait(60)
    deadline = time.monotonic() + 30
    while (Path(run) / "step-1").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not (Path(run) / "step-1").exists(), sorted(p.name for p in Path(run).iterdir())
    assert sorted(p.name for p in Path(run).glob("step-*")) == ["step-3"]


def _corrupt(ck: Path) -> None:
    """Every data file zeroed: the checksums fail."""
    for f in (ck / "data").rglob("*.bin"):
        f.write_bytes(b"\0" * f.stat().st_size)


def test_lag_counts_the_committed_steps_behind_and_an_error_names_one_exception(tmp_path: Path) -> None:
    """``lag_steps`` (and the ``bytecp_follower_lag_steps`` gauge) is the newest
    committed step minus the one held: 0 when it holds the newest, the steps
    behind when the newest failed; the failed update names its exception once."""
    from bytecp.monitoring.prometheus import PrometheusRecorder
    from prometheus_client import CollectorRegistry

    from bytecp import recorder

    reg = CollectorRegistry()
    rec = recorder.add_recorder(PrometheusRecorder(reg, job="eval", rank=0))
    lab = {"job": "eval", "rank": "0"}
    try:
        run = tmp_path / "run"
        model, opt = _model()
        mgr = bytecp.CheckpointManager(str(run), every_n_steps=1, keep_last=10, incremental=False)
        served, _ = _model(seed=3)
        gen = bytecp.follow(str(run), {"model": served}, poll_s=0.01)
        _step(model, opt)
        mgr.save(1, {"model": model})
        up = next(gen)
        assert up.ok and up.lag_steps == 0 and reg.get_sample_value("bytecp_follower_lag_steps", lab) == 0
        for step in (2, 5):  # two commits, the newest of them damaged
            _step(model, opt)
            mgr.save(step, {"model": model})
        _corrupt(run / "step-5")
        up = next(gen)
        assert not up.ok and up.step == 5 and up.held == f"{run}/step-1" and up.lag_steps == 4, up
        assert up.error is not None and up.error.startswith("CorruptCheckpointError: ")
        assert "CorruptCheckpointError" not in up.error.split(": ", 1)[1], up.error  # one name
        assert reg.get_sample_value("bytecp_follower_lag_steps", lab) == 4
        _step(model, opt)
        mgr.save(6, {"model": model})
        up = next(gen)
        assert up.ok and up.step == 6 and up.lag_steps == 0 and _same(served, model), up
        assert reg.get_sample_value("bytecp_follower_lag_steps", lab) == 0
        gen.close()
    finally:
        recorder.remove_recorder(rec)


@pytest.mark.parametrize("full_every", [1, 100], ids=["deleted", "retired"])
def test_a_retention_never_fails_a_healthy_follower(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    full_every: int) -> None:
    """``keep_last=1``: the checkpoint a follower chose is pruned before it
    pins it (the trainer committed a newer one meanwhile): the follower takes
    the newer one, reporting no error -- whether the pruned one was deleted
    or, referenced by the newer one (``full_every=100``), retired to its
    ``base.json``; then a trainer saving while the follower polls, every
    update ok and each the step it names."""
    from bytecp.serving.sources import Sources

    run = tmp_path / "run"
    model, opt = _model(frozen=True)
    mgr = bytecp.CheckpointManager(str(run), every_n_steps=1, keep_last=1, full_every=full_every)
    _step(model, opt)
    mgr.save(1, {"model": model, "optimizer": opt})
    real = Sources.newest
    raced: list[int] = []

    def newest_then_a_commit(self: Sources, *args: Any, **kwargs: Any) -> Any:
        found = real(self, *args, **kwargs)
        if found is not None and not raced:  # the trainer commits step 2 and prunes step 1 now
            raced.append(found.info.step)
            _step(model, opt)
            mgr.save(2, {"model": model, "optimizer": opt})
        return found

    monkeypatch.setattr(Sources, "newest", newest_then_a_commit)
    served, _ = _model(seed=5)
    gen = bytecp.follow(str(run), {"model": served}, poll_s=0.01, idle_timeout_s=60)
    up = next(gen)
    assert raced == [1] and not (run / "step-1" / "metadata.json").exists()
    assert (run / "step-1" / "base.json").exists() == (full_every > 1)
    assert up.ok and up.step == 2 and _same(served, model), up
    monkeypatch.setattr(Sources, "newest", real)

    stop = threading.Event()
    errors: list[BaseException] = []

    def trainer() -> None:
        try:
            for step in range(3, 15):
                _step(model, opt)
                mgr.save(step, {"model": model, "optimizer": opt})
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
        finally:
            stop.set()

    t = threading.Thread(target=trainer)
    t.start()
    seen = []
    for up in gen:  # (ends after 60 s without a newer checkpoint, should the trainer fail)
        assert up.ok, up
        seen.append(up.step)
        if up.step == 14:
            break
    t.join()
    gen.close()
    assert not errors and seen == sorted(seen) and seen[-1] == 14, (errors, seen)
    assert _same(served, model)


@pytest.mark.parametrize("full_every", [1, 100], ids=["deleted", "retired"])
@pytest.mark.parametrize("when", ["before-open", "after-open", "unpinned"])
def test_a_checkpoint_retired_after_its_pin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture, full_every: int, when: str) -> None:
    """``keep_last=1``: the follower pinned the newest checkpoint (step 1), and the trainer
    commits step 2, whose retention retires step 1 (its ``metadata.json`` moved aside; its pin
    keeps its data and index files). ``before-open``: between the pin and the coordinator's
    open, which finds it gone and takes step 2. ``after-open``: after the open, before the
    update reads: the update takes step 1 whole (every rank has the opened checkpoint from the
    coordinator, none reads ``metadata.json`` again), and the next one step 2. ``unpinned``
    (``pin=False``, as a pin the retention takes for dead, its follower's lease lapsed): after
    the open, and step 1's index files go with its ``metadata.json``: the update fails, the
    coordinator finds step 1 retired for a newer one, and the follower takes step 2. No error
    reported, nothing marked failed."""
    from bytecp.serving import follow as follow_mod

    run = tmp_path / "run"
    model, opt = _model(frozen=True)
    mgr = bytecp.CheckpointManager(str(run), every_n_steps=1, keep_last=1, full_every=full_every)
    _step(model, opt)
    mgr.save(1, {"model": model, "optimizer": opt})
    at_one = _clone(model)
    raced: list[int] = []

    def commit() -> None:
        raced.append(1)
        _step(model, opt)
        mgr.save(2, {"model": model, "optimizer": opt})

    name = "opened_for_ranks" if when == "before-open" else "update"
    real = getattr(follow_mod._Follower, name)

    def a_commit_first(self: Any, *args: Any) -> Any:
        if not raced:
            commit()
        return real(self, *args)

    monkeypatch.setattr(follow_mod._Follower, name, a_commit_first)
    served, _ = _model(seed=5)
    gen = bytecp.follow(str(run), {"model": served}, poll_s=0.01, idle_timeout_s=60, pin=when != "unpinned")
    with caplog.at_level("INFO", logger="bytecp"):
        ups = [next(gen)]
        if when == "after-open":
            assert ups[0].ok and ups[0].step == 1, ups[0]
            assert all(torch.equal(v, at_one[k]) for k, v in served.state_dict().items())
            ups.append(next(gen))
    gen.close()
    assert raced == [1] and not (run / "step-1" / "metadata.json").exists()
    assert ups[-1].ok and ups[-1].step == 2 and _same(served, model), ups[-1]
    assert "could not take" not in caplog.text
    assert ("retired by a retention" in caplog.text) == (when == "unpinned")
