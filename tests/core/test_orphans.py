"""What a killed save leaves (files of a save that never committed) is removed
by the next successful save to the same URL and by ``bytecp gc``, never while
the save may still be running (its lease is live, or it started less than a
lease term ago)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import bytecp
from bytecp.cli import main as cli
from bytecp.format.metadata import new_save_id
from bytecp.manager import CheckpointManager

KILLED = """
import sys, torch, bytecp
bytecp.save(sys.argv[1], {"w": torch.arange(1000.0), "extra": {"step": 6}}, step=6)
"""


def killed_save(url: Path) -> str:
    """A real process dies in the commit phase (data written, no metadata.json)."""
    env = dict(os.environ, BYTECP_FAULT_EXIT="commit:0", BYTECP_LEASE_SECONDS="0.5")
    p = subprocess.run([sys.executable, "-c", KILLED, str(url)], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 17, p.stderr[-2000:]
    assert not (url / "metadata.json").exists()
    (sid,) = os.listdir(url / "data")
    assert (url / "leases" / f"{sid}.json").exists()  # it died holding its lease
    return sid


def files(url: Path) -> list[str]:
    return sorted(str(p.relative_to(url)) for p in url.rglob("*") if p.is_file())


def live_lease(url: Path, seconds: float = 3600) -> str:
    """Files of a save in flight elsewhere: its lease is live."""
    sid = "1" + new_save_id()[1:]  # started long ago (year 1xxx): only the lease protects it
    (url / "data" / sid).mkdir(parents=True)
    (url / "data" / sid / "0-0.bin").write_bytes(b"in flight")
    (url / "leases").mkdir(exist_ok=True)
    now = time.time()
    (url / "leases" / f"{sid}.json").write_text(json.dumps({"save_id": sid, "renewed": now, "expires": now + seconds}))
    return sid


@pytest.mark.spawn
def test_the_next_save_removes_a_killed_saves_files_but_not_a_live_one(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    ck = run / "step-6"
    dead = killed_save(ck)
    running = live_lease(ck)
    assert cli(["inspect", str(ck)]) == 2
    assert f"The next save to {ck} removes these files, or `bytecp gc {ck}`" in capsys.readouterr().err
    time.sleep(0.6)  # the killed save's lease expires
    mgr = CheckpointManager(str(run), every_n_steps=1)
    mgr.save(6, {"w": torch.ones(3)})  # the restarted job saves step-6 again
    left = files(ck)
    assert not any(dead in f for f in left), left
    assert f"data/{running}/0-0.bin" in left and f"leases/{running}.json" in left  # untouched
    (committed,) = {f.split("/")[1] for f in left if f.startswith("index/")}
    assert not any(f.startswith("leases/") and running not in f for f in left), left  # its own lease given up
    assert set(left) - {f"data/{running}/0-0.bin", f"leases/{running}.json"} == {
        f for f in left if committed in f or f == "metadata.json" or f.startswith("reports/")}
    assert cli(["verify", str(ck)]) == 0


@pytest.mark.spawn
def test_the_sweep_after_a_commit_lists_no_file_of_the_committed_save(tmp_path: Path, monkeypatch) -> None:
    """A W-rank save writes 2 x W files; the sweep after its commit finds other
    saves' folders by name and lists only theirs (an S3 listing is 1,000 keys a request)."""
    from bytecp.storage.local import LocalStorage

    ck = tmp_path / "ck"
    dead = killed_save(ck)
    time.sleep(0.6)  # its lease expires
    listed: list[str] = []
    real = LocalStorage.list_files

    def spy(self: LocalStorage, prefix: str = "") -> list[str]:
        listed.append(prefix)
        return real(self, prefix)

    monkeypatch.setattr(LocalStorage, "list_files", spy)
    bytecp.save(str(ck), {"w": torch.ones(3)})
    committed = json.loads((ck / "metadata.json").read_text())["save_id"]
    assert not any(p.startswith((f"data/{committed}", f"index/{committed}")) for p in listed), listed
    assert f"data/{dead}" in listed and not any(dead in f for f in files(ck)), (listed, files(ck))
    assert cli(["verify", str(ck)]) == 0


@pytest.mark.spawn
def test_gc_on_an_uncommitted_directory_and_on_a_run(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    CheckpointManager(str(run), every_n_steps=1).save(4, {"w": torch.ones(3)})
    dead = killed_save(run / "step-6")
    capsys.readouterr()
    # its lease still live: kept
    (run / "step-6" / "leases" / f"{dead}.json").write_text(json.dumps({"expires": time.time() + 3600}))
    assert cli(["gc", str(run / "step-6")]) == 0
    assert "kept 3 file(s)" in capsys.readouterr().out and (run / "step-6" / "data" / dead).exists()
    (run / "step-6" / "leases" / f"{dead}.json").write_text(json.dumps({"expires": time.time() - 1}))
    assert cli(["gc", str(run), "--dry-run"]) == 0
    assert f"would remove step-6/data/{dead}/" in capsys.readouterr().out
    assert cli(["gc", str(run / "step-6")]) == 0
    assert "removed 3 file(s) of saves that never committed" in capsys.readouterr().out
    assert files(run / "step-6") == []
    assert cli(["ls", str(run)]) == 0 and "step-4" in capsys.readouterr().out
    assert cli(["gc", str(tmp_path / "nothing")]) == 2


def test_a_failed_save_gives_up_its_lease(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("BYTECP_FAULT_ERROR", "commit:0")
    with pytest.raises(RuntimeError, match="injected"):
        bytecp.save(str(tmp_path / "ck"), {"w": torch.ones(3)})
    assert files(tmp_path / "ck") == []


@pytest.mark.spawn
def test_retention_removes_a_killed_step_the_run_never_saves_again(tmp_path: Path) -> None:
    run = tmp_path / "run"
    mgr = CheckpointManager(str(run), every_n_steps=1, keep_last=3)
    mgr.save(4, {"w": torch.ones(3)})
    killed_save(run / "step-6")  # the restarted job resumes from step-4, saves every 5 steps now
    time.sleep(0.6)  # its lease expires
    running = live_lease(run / "step-7")  # a save still running elsewhere: never touched
    mgr.save(10, {"w": torch.ones(3)})
    assert not (run / "step-6").exists() or files(run / "step-6") == []
    assert f"data/{running}/0-0.bin" in files(run / "step-7")
    assert [c.step for c in bytecp.manager.list_checkpoints(str(run))] == [4, 10]
