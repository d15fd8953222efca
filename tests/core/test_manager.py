"""CheckpointManager: save every N steps, keep the last K committed, resume
from the latest committed checkpoint (never an interrupted one)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import bytecp
from bytecp.cli import main as cli
from bytecp.format import metadata as fmt
from bytecp.format.metadata import FORMAT_VERSION
from bytecp.manager import CheckpointManager, list_checkpoints


def test_every_n_steps_retention_and_resume(tmp_path: Path, capsys) -> None:
    run = str(tmp_path / "run")
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    mgr = CheckpointManager(run, every_n_steps=2, keep_last=2)
    saved = []
    for step in range(1, 8):
        with torch.no_grad():
            model.weight.add_(1.0)
        if mgr.maybe_save(step, {"model": model, "extra": {"step": step}}):
            saved.append(step)
    assert saved == [2, 4, 6]
    assert [c.step for c in list_checkpoints(run)] == [4, 6]
    # step-4 references step-2's unchanged bias (incremental saves): step-2 is
    # retired, its metadata moved to base.json, only that data file kept
    assert sorted(p.name for p in Path(run).iterdir()) == ["step-2", "step-4", "step-6"]
    assert sorted(p.name for p in (Path(run) / "step-2").iterdir()) == ["base.json", "data"]
    # an interrupted later save (no metadata.json) is ignored
    bytecp.save(f"{run}/step-8", {"model": model, "extra": {"step": 8}})
    (Path(run) / "step-8" / "metadata.json").unlink()
    fresh = nn.Linear(3, 2)
    extra = {"step": 0}
    assert mgr.restore({"model": fresh, "extra": extra}) == 6 and extra["step"] == 6
    assert torch.equal(fresh.weight, model.weight - 1.0)
    assert cli(["ls", run]) == 0
    out = capsys.readouterr().out
    assert "step-6\tstep=6" in out and "<- resume" in out.splitlines()[1] and "step-8\tstep=" not in out
    assert "step-8\t(no checkpoint: a bytecp save that never committed" in out


def test_nothing_to_resume_and_bad_settings(tmp_path: Path) -> None:
    assert CheckpointManager(str(tmp_path / "empty")).restore({"model": nn.Linear(1, 1)}) is None
    with pytest.raises(bytecp.ConfigError, match="every_n_steps"):
        CheckpointManager(str(tmp_path), every_n_steps=0)
    with pytest.raises(bytecp.ConfigError, match="keep_last"):
        CheckpointManager(str(tmp_path), keep_last=0)


def test_newer_format_stops_resume_instead_of_skipping_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    mgr = CheckpointManager(str(run), every_n_steps=1, keep_last=None)
    mgr.save(1, {"x": torch.zeros(1)})
    mgr.save(2, {"x": torch.ones(1)})
    md = json.loads((run / "step-2" / "metadata.json").read_text())
    md["format_version"] = FORMAT_VERSION + 1
    (run / "step-2" / "metadata.json").write_text(json.dumps(md))
    with pytest.raises(bytecp.FormatVersionError):
        mgr.restore({"x": torch.zeros(1)})


def test_export_safetensors_and_torch(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(7, 3), nn.Linear(3, 5)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters())
    url = str(tmp_path / "ck")
    bytecp.save(url, {"model": model, "optimizer": opt})
    out = str(tmp_path / "model.safetensors")
    assert cli(["export", url, out]) == 0
    st = load_file(out)
    assert set(st) == set(model.state_dict())
    for k, v in model.state_dict().items():
        assert torch.equal(st[k], v) and st[k].dtype == torch.bfloat16
    pt = str(tmp_path / "model.pt")
    assert cli(["export", url, pt, "--format", "torch"]) == 0
    sd = torch.load(pt, weights_only=True)
    fresh = nn.Sequential(nn.Embedding(7, 3), nn.Linear(3, 5)).to(torch.bfloat16)
    fresh.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True))
    assert cli(["export", url, out, "--prefix", "nope."]) == 2


def test_gc_removes_only_leftovers_of_older_saves(tmp_path: Path, capsys) -> None:
    import os
    import shutil

    ck = tmp_path / "ck"
    bytecp.save(str(ck), {"w": torch.ones(3)})
    first = next((ck / "data").iterdir()).name
    # a crashed earlier save left its files behind (simulated: copy the committed ones)
    old = "20000101T000000-deadbeef"
    shutil.copytree(ck / "data" / first, ck / "data" / old)
    shutil.copytree(ck / "index" / first, ck / "index" / old)
    # a save that started later may still be running: never touched
    new = "29990101T000000-cafecafe"
    os.makedirs(ck / "data" / new)
    (ck / "data" / new / "0-0.bin").write_bytes(b"x")
    assert cli(["gc", str(ck), "--dry-run"]) == 0
    assert (ck / "data" / old).exists()
    assert cli(["gc", str(ck)]) == 0
    out = capsys.readouterr().out
    assert f"data/{old}/0-0.bin" in out and "kept 1 file" in out
    assert not (ck / "data" / old).exists() and not (ck / "index" / old).exists()
    assert (ck / "data" / new / "0-0.bin").exists()
    assert cli(["verify", str(ck)]) == 0


# -- asynchronous saves: the same retention rules, deletion off the training thread


def committed_steps(run: str) -> list[int | None]:
    return [c.step for c in list_checkpoints(run)]


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_async_manager_retention(tmp_path: Path, monkeypatch, lazy: bool) -> None:
    """keep_last=2 with saves slowed down (BYTECP_FAULT_DELAY) so each is still
    in flight when the test looks: the in-flight save is never counted, the
    newest committed one survives until a newer one commits, and every
    deletion happens on the save's background thread."""
    import threading

    run = str(tmp_path / "run")
    monkeypatch.setenv("BYTECP_FAULT_DELAY", "commit:0:0.4")
    deleted_on: list[str] = []
    real_retain = CheckpointManager._retain

    def retain(self: CheckpointManager) -> None:
        before = set(committed_steps(run))
        real_retain(self)
        if before - set(committed_steps(run)):
            deleted_on.append(threading.current_thread().name)

    monkeypatch.setattr(CheckpointManager, "_retain", retain)
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr = CheckpointManager(run, every_n_steps=1, keep_last=2, async_save=True, lazy=lazy)
    expected = {}
    for step in range(1, 6):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()  # a lazy save still staging blocks here, before the weights change
        opt.zero_grad()
        before = committed_steps(run)
        handle = mgr.save(step, {"model": model, "optimizer": opt, "extra": {"step": step}})
        assert handle is not None and not handle.done()  # in flight: commit is 0.4 s away
        while not handle.staged():  # lazy: staging runs in the background
            time.sleep(0.01)
        expected[step] = {k: v.clone() for k, v in model.state_dict().items()}
        if not handle.done():
            # the in-flight checkpoint is not counted and nothing was deleted for it
            assert committed_steps(run) == before
        mgr.wait(30)
        now = committed_steps(run)
        assert now == sorted(set(before) | {step})[-2:], (step, before, now)
    assert committed_steps(run) == [4, 5]
    assert deleted_on and all(name != threading.main_thread().name for name in deleted_on), deleted_on
    # the latest loads bitwise
    fresh = nn.Linear(4, 3)
    extra = {"step": 0}
    state = {"model": fresh, "optimizer": torch.optim.SGD(fresh.parameters(), lr=0.1), "extra": extra}
    assert mgr.restore(state) == 5 and extra["step"] == 5
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, expected[5][k]), k


def test_async_manager_never_deletes_the_last_committed_while_the_next_is_in_flight(tmp_path: Path, monkeypatch) -> None:
    run = str(tmp_path / "run")
    mgr = CheckpointManager(run, every_n_steps=1, keep_last=1, async_save=True)
    mgr.save(1, {"x": torch.ones(3)})
    mgr.wait(30)
    assert committed_steps(run) == [1]
    monkeypatch.setenv("BYTECP_FAULT_DELAY", "commit:0:0.5")
    handle = mgr.save(2, {"x": torch.full((3,), 2.0)})
    assert handle is not None
    seen = []
    while not handle.done():
        seen.append(committed_steps(run))
        time.sleep(0.05)
    # step 1 stays until step 2 has committed (both are listed between the
    # commit and the end of the handle, when retention runs); the last look
    # may land after retention (done() was read just before the handle ended)
    assert seen and seen[0] == [1] and all(s in ([1], [1, 2]) for s in seen[:-1]), [s for s in seen if s != [1]]
    assert seen[-1] in ([1], [1, 2], [2]), seen[-1]
    mgr.wait(30)
    assert committed_steps(run) == [2]
    assert torch.equal(bytecp.load_state_dict(f"{run}/step-2")["x"], torch.full((3,), 2.0))


def test_async_manager_failed_save_deletes_nothing_and_reports(tmp_path: Path, monkeypatch) -> None:
    run = str(tmp_path / "run")
    mgr = CheckpointManager(run, every_n_steps=1, keep_last=1, async_save=True)
    mgr.save(1, {"x": torch.ones(3)})
    mgr.wait(30)
    monkeypatch.setenv("BYTECP_FAULT_ERROR", "commit:0")
    mgr.save(2, {"x": torch.zeros(3)})
    with pytest.raises(RuntimeError, match="injected failure"):
        mgr.wait(30)
    monkeypatch.delenv("BYTECP_FAULT_ERROR")
    assert committed_steps(run) == [1]
    assert not list((Path(run) / "step-2").rglob("*.bin"))  # the failed save's data was removed
    mgr.save(3, {"x": torch.full((3,), 3.0)})  # the error was seen through wait(): not raised again
    mgr.wait(30)
    assert committed_steps(run) == [3]


def test_lazy_needs_async(tmp_path: Path) -> None:
    with pytest.raises(bytecp.ConfigError, match="lazy=True needs async_save=True"):
        CheckpointManager(str(tmp_path), lazy=True)


# -- resume: the documented loop, and falling back past a checkpoint that does not load


def flip_a_data_byte(ck: Path) -> None:
    f = next(p for p in (ck / "data").rglob("*.bin"))
    b = bytearray(f.read_bytes())
    b[0] ^= 0xFF
    f.write_bytes(bytes(b))


def test_the_documented_resume_loop_runs_each_step_once(tmp_path: Path) -> None:
    """README's loop (README.md, "Quick start"), run as written, killed after step 4 and started again."""
    run = str(tmp_path / "run")
    done: list[int] = []

    def job(total_steps: int) -> None:
        model = nn.Linear(2, 2)
        nn.init.zeros_(model.weight)  # integers from here on: every sum is exact
        state = {"model": model, "extra": {"done": []}}
        mgr = CheckpointManager(run, every_n_steps=2, keep_last=3)
        restored = mgr.restore(state)  # the step saved last, None on a fresh start
        start = 0 if restored is None else restored + 1
        for step in range(start, total_steps):
            with torch.no_grad():
                model.weight.add_(1.0)
            state["extra"]["done"].append(step)
            done.append(step)
            mgr.maybe_save(step, state)

    job(5)  # steps 0..4, saves 0, 2, 4
    job(8)  # resumes after step 4: steps 5..7, saves 6
    assert done == list(range(8))
    assert committed_steps(run) == [2, 4, 6]
    sd = bytecp.load_state_dict(f"{run}/step-6")
    assert sd["extra"]["done"] == list(range(7))
    assert torch.equal(sd["model"]["weight"], torch.full((2, 2), 7.0))  # steps 0..6, each once


def test_restore_falls_back_past_checkpoints_that_do_not_load(tmp_path: Path, caplog) -> None:
    run = tmp_path / "run"
    mgr = CheckpointManager(str(run), every_n_steps=1, keep_last=None)
    for step in (1, 2, 3):
        mgr.save(step, {"x": torch.full((4,), float(step)), "extra": {"step": step}})
    flip_a_data_byte(run / "step-3")  # checksum mismatch
    (run / "step-2" / "metadata.json").write_text("{not json")  # unreadable: tried, skipped
    state = {"x": torch.zeros(4), "extra": {"step": 0}}
    with caplog.at_level("WARNING", logger="bytecp"):
        assert mgr.restore(state) == 1
    assert torch.equal(state["x"], torch.full((4,), 1.0)) and state["extra"]["step"] == 1
    text = caplog.text
    assert f"resume skips {run}/step-3" in text and "checksum mismatch" in text
    assert f"resume skips {run}/step-2" in text and "not valid JSON" in text  # named as skipped
    assert [u for u, _ in mgr.skipped] == [f"{run}/step-3", f"{run}/step-2"]
    # nothing was deleted
    assert sorted(p.name for p in run.iterdir()) == ["step-1", "step-2", "step-3"]
    assert (run / "step-3" / "metadata.json").exists()
    # strict: the newest committed checkpoint or its error
    with pytest.raises(bytecp.CorruptCheckpointError, match="checksum mismatch"):
        mgr.restore({"x": torch.zeros(4), "extra": {"step": 0}}, fallback=False)
    # none loads: one error naming each
    flip_a_data_byte(run / "step-1")
    with pytest.raises(bytecp.CorruptCheckpointError, match="no committed checkpoint of .* loads: .*step-3.*step-2.*step-1"):
        mgr.restore({"x": torch.zeros(4), "extra": {"step": 0}})


@pytest.mark.parametrize("async_save", [False, True])
def test_training_on_past_a_skipped_checkpoint_saves_its_step_again(tmp_path: Path, async_save: bool) -> None:
    """The documented resume loop: restore skips a damaged step-3 and loads
    step 2; training goes on and saves step 3 again, over the skipped one
    (which stayed until then), and every later step as usual."""
    run = tmp_path / "run"
    mgr = CheckpointManager(str(run), every_n_steps=1, keep_last=None)
    for step in (1, 2, 3):
        mgr.save(step, {"x": torch.full((4,), float(step))})
    flip_a_data_byte(run / "step-3")
    again = CheckpointManager(str(run), every_n_steps=1, keep_last=None, async_save=async_save)
    state = {"x": torch.zeros(4)}
    assert again.restore(state) == 2
    for step in (3, 4):
        state["x"] += 1
        assert again.maybe_save(step, state)
        again.wait()
    assert not again.failed
    for step in (3, 4):
        assert torch.equal(bytecp.load_state_dict(f"{run}/step-{step}")["x"], torch.full((4,), float(step)))
    # a checkpoint restore did not skip is still never saved over
    with pytest.raises(bytecp.CheckpointExistsError, match="overwrite=True"):
        again.save(4, state)
        again.wait()


@pytest.mark.parametrize("async_save", [False, True])
def test_a_skipped_checkpoint_that_a_skipped_incremental_one_references_is_saved_over(
        tmp_path: Path, async_save: bool) -> None:
    """Incremental saves: step-4 references step-3's bias, whose data file is
    damaged, so restore skips both and loads step 2. Training saves step 3
    again over the skipped step-3 (the skipped step-4's reference does not
    refuse it: it crashed the loop, 'referenced by checkpoint(s) step-4'),
    then step 4; a checkpoint that loads still keeps what it references."""
    run = tmp_path / "run"
    mgr = CheckpointManager(str(run), every_n_steps=1, keep_last=None, incremental=True)
    state = {"w": torch.zeros(1024), "b": torch.zeros(1024)}
    for step in (1, 2, 3, 4):
        state["b" if step == 3 else "w"] += 1  # step 4 references step-3's b
        mgr.save(step, state)
    assert "step-3" in fmt.Metadata.from_bytes((run / "step-4" / fmt.METADATA_FILE).read_bytes(), "4").references
    flip_a_data_byte(run / "step-3")
    again = CheckpointManager(str(run), every_n_steps=1, keep_last=None, incremental=True, async_save=async_save)
    got = {"w": torch.zeros(1024), "b": torch.zeros(1024)}
    assert again.restore(got) == 2 and [u.rsplit("/", 1)[-1] for u, _ in again.skipped] == ["step-4", "step-3"]
    want = {k: v.clone() for k, v in got.items()}
    for step in (3, 4, 5):
        want["b" if step == 3 else "w"] += 1
        got["b" if step == 3 else "w"] += 1
        assert again.maybe_save(step, got)
        again.wait()
        assert not again.failed
        loaded = bytecp.load_state_dict(f"{run}/step-{step}")
        assert all(torch.equal(loaded[k], want[k]) for k in want), step
    # the new step-4 and step-5 reference the new step-3's b: replacing it is refused as ever
    with pytest.raises(bytecp.CheckpointExistsError, match=r"referenced by checkpoint\(s\) step-4, step-5"):
        bytecp.save(f"{run}/step-3", got, overwrite=True)
    # replaced, they are no longer checkpoints restore skipped: the manager never saves over them again
    assert again.skipped == []
    with pytest.raises(bytecp.CheckpointExistsError, match="overwrite=True"):
        again.save(3, got)
        again.wait()


def test_a_signal_at_a_skipped_checkpoints_step_saves_over_it(tmp_path: Path) -> None:
    """The pre-emption save lands on the step of a checkpoint restore
    skipped: it replaces it (it used to see a metadata.json there, save
    nothing and say it had saved)."""
    import signal

    run = tmp_path / "run"
    mgr = CheckpointManager(str(run), every_n_steps=1, keep_last=None)
    for step in (1, 2):
        mgr.save(step, {"x": torch.full((4,), float(step))})
    flip_a_data_byte(run / "step-2")
    again = CheckpointManager(str(run), every_n_steps=100, keep_last=None, save_on_signal=True)
    state = {"x": torch.zeros(4)}
    assert again.restore(state) == 1
    state["x"] += 1
    signal.raise_signal(signal.SIGTERM)  # the handler only notes it
    with pytest.raises(SystemExit):
        again.maybe_save(2, state)
    assert torch.equal(bytecp.load_state_dict(f"{run}/step-2")["x"], torch.full((4,), 2.0))


def test_restore_does_not_fall_back_when_the_state_does_not_fit(tmp_path: Path) -> None:
    run = tmp_path / "run"
    mgr = CheckpointManager(str(run), every_n_steps=1, keep_last=None)
    mgr.save(1, {"x": torch.zeros(4)})
    mgr.save(2, {"x": torch.zeros(4)})
    with pytest.raises(bytecp.StateMismatchError):
        mgr.restore({"x": torch.zeros(5)})
    assert mgr.skipped == []


def test_a_failure_on_any_rank_blames_the_files_only_if_every_rank_says_so() -> None:
    from bytecp.catalog import checkpoint_is_bad
    from bytecp.errors import TransientStorageError

    bad = "load/read: CorruptCheckpointError: data/x/0-0.bin: checksum mismatch"
    assert checkpoint_is_bad(bytecp.DistributedCheckpointError("load", {0: bad, 1: bad}))
    assert not checkpoint_is_bad(bytecp.DistributedCheckpointError(
        "load", {0: bad, 1: "load/match: StateMismatchError: missing key x"}))
    assert not checkpoint_is_bad(bytecp.DistributedCheckpointError("load", {1: "collective failed: timeout"}))
    assert not checkpoint_is_bad(bytecp.FormatVersionError("newer"))
    assert not checkpoint_is_bad(TransientStorageError("503"))


def test_save_on_signal_in_one_process_even_after_a_failed_async_save(tmp_path: Path, monkeypatch) -> None:
    import signal

    run = tmp_path / "run"
    before = signal.getsignal(signal.SIGTERM)
    mgr = CheckpointManager(str(run), every_n_steps=100, async_save=True, save_on_signal=True)
    monkeypatch.setenv("BYTECP_FAULT_ERROR", "write:0")
    handle = mgr.save(1, {"x": torch.ones(3)})  # fails in the background
    assert handle is not None
    while not handle.done():
        time.sleep(0.01)
    monkeypatch.delenv("BYTECP_FAULT_ERROR")
    assert not mgr.maybe_save(2, {"x": torch.full((3,), 2.0)})  # not due, no signal yet
    signal.raise_signal(signal.SIGTERM)  # the handler only notes it
    with pytest.raises(SystemExit) as e:
        mgr.maybe_save(3, {"x": torch.full((3,), 3.0)})
    assert e.value.code == 0
    assert committed_steps(str(run)) == [3]
    assert torch.equal(bytecp.load_state_dict(f"{run}/step-3")["x"], torch.full((3,), 3.0))
    assert signal.getsignal(signal.SIGTERM) == before  # handlers put back
