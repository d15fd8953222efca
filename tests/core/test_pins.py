"""The protocol between saves that reference checkpoints and retention
(:mod:`bytecp.saving.pins`), one piece at a time: a doomed file fails the
save cleanly (a file doomed that it does not reference does not), a base file gone fails it, a lapsed lease refuses the commit,
a pin whose process is gone keeps nothing, retention leaves no marker of
its own and never removes another's, gc reads a retired base's save."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import bytecp
from bytecp.errors import CorruptCheckpointError
from bytecp.format.metadata import new_save_id
from bytecp.saving import leases
from bytecp.storage_api import Buffer, open_storage
from bytecp.tools.retention import retain


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 4))
    model[0].requires_grad_(False)
    return model


def _touch(model: nn.Module) -> None:
    with torch.no_grad():
        model[1].weight.add_(1.0)


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, nn.Module]:
    model = _model()
    bytecp.save(str(tmp_path / "step-1"), {"model": model}, step=1)
    _touch(model)
    bytecp.save(str(tmp_path / "step-2"), {"model": model}, step=2, base=str(tmp_path / "step-1"))
    return tmp_path, model


def _files(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()}


def _mark(ck: Path, token: str, files: Any) -> None:
    (ck / "doomed").mkdir(exist_ok=True)
    (ck / "doomed" / f"{token}.json").write_text(json.dumps({"files": files} if files is not None else {}))


def test_a_save_fails_cleanly_only_when_a_file_it_references_is_doomed(run: Any) -> None:
    root, model = run
    _mark(root / "step-1", "20000101T000000-other", ["data/x/0-0.bin"])  # a file nobody references
    _touch(model)
    md = bytecp.save(str(root / "step-3"), {"model": model}, step=3, base=str(root / "step-2"))
    assert set(md.references) == {"step-1"}  # the frozen layer: step-1's file, not doomed
    (ref,) = {f.split("/", 2)[2] for f in md.data_files if f.startswith("../step-1/")}
    _mark(root / "step-1", "20000101T000000-other", [ref])
    _touch(model)
    with pytest.raises(CorruptCheckpointError, match=rf"step-1 is being pruned .*names {ref}"):
        bytecp.save(str(root / "step-4"), {"model": model}, step=4, base=str(root / "step-3"))
    assert not _files(root / "step-4") and not (root / "step-1" / "pins").exists()  # nothing left behind
    assert (root / "step-1" / "doomed" / "20000101T000000-other.json").exists()  # not its to remove
    _mark(root / "step-1", "20000101T000000-other", None)  # a marker without a list dooms every file
    with pytest.raises(CorruptCheckpointError, match="step-1 is being pruned"):
        bytecp.save(str(root / "step-4"), {"model": model}, step=4, base=str(root / "step-3"))
    bytecp.save(str(root / "step-4"), {"model": model}, step=4)  # written whole, it commits
    assert not json.loads((root / "step-4" / "metadata.json").read_text()).get("references")


def test_a_save_whose_base_lost_a_file_fails_cleanly(run: Any) -> None:
    """base.json still lists the file (another retention rewrote it), the file is gone."""
    root, model = run
    (victim,) = (root / "step-1" / "data").rglob("*.bin")
    victim.unlink()
    _touch(model)
    with pytest.raises(CorruptCheckpointError, match="step-1 is gone"):
        bytecp.save(str(root / "step-3"), {"model": model}, step=3, base=str(root / "step-2"))
    assert not _files(root / "step-3")


class _Stalls:
    """A storage whose writes stall after the first (a slow store, a paused process)."""

    def __init__(self, url: str) -> None:
        self.url, self.writes = url, 0

    def write_file(self, path: str, buffers: Sequence[Buffer]) -> None:
        self.writes += 1
        if self.writes > 1:
            raise OSError("stalled")

    def delete(self, paths: Any) -> None:
        pass


def test_a_save_whose_lease_lapsed_does_not_commit() -> None:
    lease = leases.Lease(_Stalls("mem://ck"), new_save_id(), seconds=0.4)  # type: ignore[arg-type]
    lease.start()
    try:
        lease.check_held()  # fresh: held
        time.sleep(0.25)  # renewals fail: less than half the term left
        with pytest.raises(CorruptCheckpointError, match="not renewed in time"):
            lease.check_held()
    finally:
        lease.stop()
    with pytest.raises(CorruptCheckpointError):
        lease.check_held()  # and never once it ended


def _lease(ck: Path, sid: str, pid: int) -> None:
    (ck / "leases").mkdir(parents=True, exist_ok=True)
    now = time.time()
    body = {"save_id": sid, "renewed": now, "expires": now + 3600, "host": leases.this_host(), "pid": pid}
    (ck / "leases" / f"{sid}.json").write_text(json.dumps(body))


@pytest.mark.skipif(leases.this_host() is None, reason="no /proc: a pid cannot be told gone")
@pytest.mark.spawn
def test_a_pin_keeps_its_base_until_its_process_is_gone(run: Any) -> None:
    """A live lease whose process still runs keeps the whole base; the same
    lease of a process that is gone (same host) keeps nothing, unexpired."""
    root, model = run
    sid = new_save_id()
    (root / "step-1" / "pins").mkdir()
    (root / "step-1" / "pins" / f"step-9.{sid}").write_text("{}")
    _lease(root / "step-9", sid, pid=os.getpid())
    retain(open_storage(str(root)), ["step-2"], ["step-1"], lambda: ["step-2"])
    md = json.loads((root / "step-1" / "base.json").read_text())
    assert set(md["retained"]) == {f for f in md["data_files"] if not f.startswith("../")}  # all of it
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _lease(root / "step-9", sid, pid=int(gone.stdout))
    retain(open_storage(str(root)), ["step-2"], [], lambda: ["step-2"])  # the retired base, again
    read = {f[len("../step-1/"):] for f in json.loads((root / "step-2" / "metadata.json").read_text())["data_files"]
            if f.startswith("../step-1/")}
    assert set(json.loads((root / "step-1" / "base.json").read_text())["retained"]) == read
    assert _files(root / "step-1") == read | {"base.json"}  # the dead pin went too; no marker left
    sd = bytecp.load_state_dict(str(root / "step-2"))
    assert all(torch.equal(sd["model"][k], v) for k, v in model.state_dict().items())


def test_retention_never_removes_another_deleters_marker(run: Any) -> None:
    root = run[0]
    _mark(root / "step-1", "20000101T000000-other", None)
    res = retain(open_storage(str(root)), [], ["step-1", "step-2"], lambda: [])
    assert res.deleted == ["step-1", "step-2"] and not (root / "step-2").exists()
    assert _files(root / "step-1") == {"doomed/20000101T000000-other.json"}  # only the other's marker


@pytest.mark.spawn
def test_retention_lifts_the_markers_of_deleters_no_longer_running(run: Any) -> None:
    """A killed retention's marker would fail every save referencing its
    files for good: the next retention removes markers whose process is gone
    (this host) or that are older than STALE_MARKER_SECONDS; a live one stays."""
    from bytecp.saving.pins import STALE_MARKER_SECONDS

    root = run[0]
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    here, now = leases.this_host(), time.time()
    markers = {"dead": {"host": here, "pid": int(gone.stdout), "written": now},
               "old": {"host": "elsewhere", "pid": 1, "written": now - STALE_MARKER_SECONDS - 60},
               "live": {"host": here, "pid": os.getpid(), "written": now}}
    for token, body in markers.items():
        _mark(root / "step-1", token, None)
        (root / "step-1" / "doomed" / f"{token}.json").write_text(json.dumps({**body, "files": []}))
    retain(open_storage(str(root)), ["step-2"], ["step-1"], lambda: ["step-2"])
    assert {p for p in _files(root / "step-1") if p.startswith("doomed/")} == {"doomed/live.json"}


def test_half_written_markers_and_pins_are_neither(run: Any) -> None:
    """A marker or pin a writer is still making (or was killed making) is a
    ``.tmp-`` file: it dooms nothing and keeps nothing."""
    from bytecp.saving.pins import doomed_files, live_pins

    root = run[0]
    (root / "step-1" / "doomed").mkdir()
    (root / "step-1" / "doomed" / "retention-x.json.tmp-1a2b3c4d").write_text('{"files": [')
    (root / "step-1" / "pins").mkdir(exist_ok=True)
    (root / "step-1" / "pins" / "step-9.20990101T000000-deadbeef.tmp-1a2b3c4d").write_text("")
    ck = open_storage(str(root / "step-1"))
    assert doomed_files(ck) == frozenset()
    assert live_pins(open_storage(str(root)), ck) == ([], [])
    _touch(run[1])
    bytecp.save(str(root / "step-3"), {"model": run[1]}, step=3, base=str(root / "step-1"))  # not failed


def test_a_retention_whose_marker_was_lifted_deletes_nothing_there(run: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A retention stalled past STALE_MARKER_SECONDS finds its marker lifted by
    another: a save may have pinned that checkpoint since, so it deletes nothing there."""
    from bytecp.saving import pins

    root = run[0]
    before = _files(root / "step-1")
    real = pins.Doom.lift_dead

    def lifted_ours_too(self: Any, ck: Any, now: float | None = None) -> list[str]:
        ck.delete([self.path])  # another retention took this one for dead
        return real(self, ck, now)

    monkeypatch.setattr(pins.Doom, "lift_dead", lifted_ours_too)
    res = retain(open_storage(str(root)), ["step-2"], ["step-1"], lambda: ["step-2"])
    assert res.deleted == [] and res.retired == []
    after = _files(root / "step-1")  # retired as a checkpoint (base.json), every file of it kept
    assert after - {"base.json"} == before - {"metadata.json"} and "base.json" in after


def test_gc_reads_the_save_of_a_retired_base(run: Any) -> None:
    """A retention retiring a checkpoint while gc runs leaves its save the
    committed one: gc never takes its files for a dead save's."""
    from bytecp.tools.gc import _committed_id

    root = run[0]
    sid = json.loads((root / "step-1" / "metadata.json").read_text())["save_id"]
    retain(open_storage(str(root)), ["step-2"], ["step-1"], lambda: ["step-2"])
    assert not (root / "step-1" / "metadata.json").exists()
    assert _committed_id(open_storage(str(root / "step-1"))) == sid


def test_retention_dooms_only_what_no_kept_checkpoint_references(run: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's own retention, racing its next save (asynchronous saves),
    dooms nothing that save may reference: what the newest, kept one reads."""
    from bytecp.saving.pins import Doom

    root = run[0]
    doomed: dict[str, set[str]] = {}
    real = Doom.mark

    def mark(self: Doom, ck: Any, files: Any) -> None:
        doomed[ck.url.rpartition("/")[2]] = set(files)
        real(self, ck, files)

    monkeypatch.setattr(Doom, "mark", mark)
    own = set(json.loads((root / "step-1" / "metadata.json").read_text())["data_files"])
    read = {f[len("../step-1/"):] for f in json.loads((root / "step-2" / "metadata.json").read_text())["data_files"]
            if f.startswith("../step-1/")}
    retain(open_storage(str(root)), ["step-2"], ["step-1"], lambda: ["step-2"])
    assert read and doomed == {"step-1": own - read}


def test_a_base_removed_while_it_is_pinned_fails_the_save_cleanly(run: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The base's directory goes (a retention's last deletion) while the pin's
    directory is created: the save fails naming the base, not the storage."""
    from bytecp.errors import StorageNotFoundError
    from bytecp.saving import pins

    root, model = run
    real = pins.sibling

    def sibling(storage: Any, name: str) -> Any:
        s = real(storage, name)

        def write_file(path: str, buffers: Any) -> None:
            raise StorageNotFoundError(f"{s.url}/pins: missing (removed meanwhile)")

        s.write_file = write_file
        return s

    monkeypatch.setattr(pins, "sibling", sibling)
    _touch(model)
    with pytest.raises(CorruptCheckpointError, match="step-1 was removed .* while the save pinned it"):
        bytecp.save(str(root / "step-3"), {"model": model}, step=3, base=str(root / "step-2"))
    assert not _files(root / "step-3")


def test_an_overwrite_is_refused_while_a_save_in_flight_pins_the_checkpoint(run: Any) -> None:
    """The overwrite would delete the files the save is about to reference:
    refused, and its doom marker and lease go with it."""
    root, model = run
    (root / "step-1" / "pins").mkdir()
    (root / "step-1" / "pins" / "step-9.x").write_text("{}")  # a save elsewhere, may still run
    shutil.rmtree(root / "step-2")  # no committed checkpoint references step-1 any more
    before = _files(root / "step-1")
    with pytest.raises(bytecp.errors.CheckpointExistsError, match="referenced by checkpoint.* step-9 .*in flight"):
        bytecp.save(str(root / "step-1"), {"model": model}, step=1, overwrite=True)
    assert _files(root / "step-1") == before  # no marker, no lease, nothing of the refused save
    (root / "step-1" / "pins" / "step-9.x").unlink()
    bytecp.save(str(root / "step-1"), {"model": model}, step=1, overwrite=True)  # nobody reads it now


def test_an_overwrite_in_flight_dooms_the_files_it_replaces(tmp_path: Path) -> None:
    """From its plan until it ends, an overwrite's marker names the replaced
    save's files: a save referencing them fails; the marker goes with the lease."""
    from bytecp.saving.commit import check_target

    model = _model()
    bytecp.save(str(tmp_path / "step-1"), {"model": model}, step=1)
    lease = leases.take(open_storage(str(tmp_path / "step-1")), new_save_id())
    try:
        assert check_target(open_storage(str(tmp_path / "step-1")), True, lease) is not None
        (marker,) = (tmp_path / "step-1" / "doomed").iterdir()
        assert marker.name == f"{lease.save_id}.json"
        _touch(model)
        with pytest.raises(CorruptCheckpointError, match="step-1 is being pruned"):
            bytecp.save(str(tmp_path / "step-2"), {"model": model}, step=2, base=str(tmp_path / "step-1"))
    finally:
        lease.stop()
    assert not (tmp_path / "step-1" / "doomed").exists()
    md = bytecp.save(str(tmp_path / "step-2"), {"model": model}, step=2, base=str(tmp_path / "step-1"))
    assert set(md.references) == {"step-1"}


def test_a_killed_overwrites_marker_is_an_orphan_a_retentions_never(tmp_path: Path) -> None:
    ck = tmp_path / "step-1"
    (ck / "doomed").mkdir(parents=True)
    (ck / "doomed" / "20000101T000000-deadbeef.json").write_text('{"files": []}')  # an overwrite killed long ago
    (ck / "doomed" / "retention-20000101T000000-cafe0000.json").write_text('{"files": []}')
    dead, running = leases.orphans(open_storage(str(ck)), None)
    assert dead == ["doomed/20000101T000000-deadbeef.json"] and running == []
