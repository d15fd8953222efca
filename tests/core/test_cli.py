"""The command line's contract: ``--json`` on every command, the exit codes
(0 ok, 1 problems found, 2 usage or checkpoint error, 3 storage error), one
line per error. Progress bars: tests/export/test_cli_progress.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import bytecp
from bytecp.cli import EXIT_INTERNAL, EXIT_STORAGE, exit_code
from bytecp.cli import main as cli
from bytecp.errors import CorruptCheckpointError, StoragePermissionError


@pytest.fixture
def run(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    bytecp.save(str(tmp_path / "run" / "step-1"), {"model": model, "extra": {"step": 1}}, step=1)
    bytecp.save(str(tmp_path / "run" / "step-2"), {"model": model, "extra": {"step": 2}}, step=2)
    return tmp_path / "run"


def leftover(ck: Path) -> str:
    """Files of an older crashed save beside the committed one (what gc removes)."""
    first = next((ck / "data").iterdir()).name
    old = "20000101T000000-deadbeef"
    shutil.copytree(ck / "data" / first, ck / "data" / old)
    return old


def json_out(capsys: Any) -> Any:
    return json.loads(capsys.readouterr().out)


def test_json_on_every_command(run: Path, tmp_path: Path, capsys: Any) -> None:
    ck = run / "step-2"
    assert cli(["ls", str(run), "--json"]) == 0
    assert [(c["name"], c["step"]) for c in json_out(capsys)] == [("step-1", 1), ("step-2", 2)]
    assert cli(["inspect", str(ck), "--json"]) == 0
    assert json_out(capsys)["step"] == 2
    assert cli(["verify", str(ck), "--json"]) == 0
    res = json_out(capsys)
    assert res["ok"] is True and res["problems"] == [] and res["bytes_checked"] > 64 * 64 * 4
    old = leftover(ck)
    assert cli(["gc", str(ck), "--dry-run", "--json"]) == 0
    res = json_out(capsys)
    assert res["dry_run"] is True and any(old in p for p in res["removed"]) and res["kept_newer"] == []
    assert cli(["gc", str(ck), "--json"]) == 0
    assert json_out(capsys)["removed"] and not (ck / "data" / old).exists()
    assert cli(["export", str(ck), str(tmp_path / "hf"), "--json"]) == 0
    res = json_out(capsys)
    assert res["format"] == "hf" and res["files"] == {"model.safetensors": (tmp_path / "hf" / "model.safetensors").stat().st_size}
    assert res["tensors"] == 4 and res["config"] is None
    assert cli(["export", str(ck), str(tmp_path / "m.safetensors"), "--json"]) == 0
    assert json_out(capsys)["format"] == "safetensors"


def test_gc_of_a_run_leaves_a_checkpoint_it_cannot_read_and_collects_the_rest(run: Path, capsys: Any) -> None:
    """step-1's metadata.json garbage: which save committed there cannot be
    told, so gc leaves step-1 untouched and names it; step-2's orphan goes."""
    old = leftover(run / "step-2")
    first = leftover(run / "step-1")
    (run / "step-1" / "metadata.json").write_text("garbage")
    assert cli(["gc", str(run), "--json"]) == 0
    res = json_out(capsys)
    assert [p for p in res["removed"] if old in p] and not [p for p in res["removed"] if p.startswith("step-1/")], res
    assert [w for w, _ in res["skipped"]] == ["step-1/"] and "not valid JSON" in res["skipped"][0][1], res
    assert (run / "step-1" / "data" / first).exists() and not (run / "step-2" / "data" / old).exists()
    leftover(run / "step-2")
    assert cli(["gc", str(run)]) == 0
    err = capsys.readouterr().err
    assert "left step-1/ untouched" in err and "not valid JSON" in err and "bytecp verify" in err, err


def test_gc_of_a_step_left_without_metadata_leaves_no_reports_to_block_a_resume(
        run: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint whose metadata.json went first (a retention or a copy cut
    short): gc removed its data and index but left reports/, and a step
    directory holding only them stopped `bytecp ls` (exit 2) and restore
    (no format reads it); now gc removes them too, and ls marks step-2."""
    monkeypatch.setenv("BYTECP_LEASE_SECONDS", "0")
    shutil.copytree(run / "step-2", run / "step-3")
    (run / "step-3" / "metadata.json").unlink()
    for top in ("data", "index"):  # a save of long ago: dead by its id's start time whatever this host's clock does
        (sid,) = (run / "step-3" / top).iterdir()
        sid.rename(sid.with_name("20000101T000000-deadbeef"))
    assert (run / "step-3" / "reports").is_dir()
    assert cli(["gc", str(run), "--json"]) == 0
    removed = json_out(capsys)["removed"]
    assert "step-3/reports/0.json" in removed and not [p for p in (run / "step-3").rglob("*") if p.is_file()], removed
    assert cli(["ls", str(run), "--json"]) == 0
    assert [c["name"] for c in json_out(capsys) if c.get("resume")] == ["step-2"]
    state = {"model": nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)), "extra": {"step": 0}}
    assert bytecp.CheckpointManager(str(run), every_n_steps=1).restore(state) == 2
    # the usual leftover: a retention cut short after its data and index went (reports/ sorts last)
    (run / "step-4" / "reports").mkdir(parents=True)
    (run / "step-4" / "reports" / "0.json").write_text("{}")
    (run / "step-4" / "doomed").mkdir()
    (run / "step-4" / "doomed" / "x.json").write_text("{}")
    assert cli(["gc", str(run / "step-4"), "--json"]) == 0
    assert sorted(json_out(capsys)["removed"]) == ["doomed/x.json", "reports/0.json"]
    (run / "step-5" / "reports").mkdir(parents=True)
    (run / "step-5" / "reports" / "1.json").write_text("{}")
    assert cli(["gc", str(run), "--json"]) == 0  # (found below the run too)
    assert json_out(capsys)["removed"] == ["step-5/reports/1.json"]
    assert cli(["ls", str(run)]) == 0


def test_exit_codes_and_one_line_errors(run: Path, tmp_path: Path, capsys: Any) -> None:
    ck = run / "step-2"
    # 1: verify found a problem (and says so in JSON too)
    data = next((ck / "data").rglob("*.bin"))
    raw = bytearray(data.read_bytes())
    raw[10] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert cli(["verify", str(ck), "--json"]) == 1
    out = capsys.readouterr()
    res = json.loads(out.out)
    assert res["ok"] is False and "crc32c mismatch" in res["problems"][0]["message"]
    assert "1 problem(s) found" in out.err
    # 2: not a checkpoint, a bad option, a usage error; JSON callers get the error as JSON
    for args in (["inspect", str(run), "--json"], ["verify", str(tmp_path / "nothing"), "--json"],
                 ["ls", str(run), "--storage-options", "{bad", "--json"]):
        assert cli(args) == 2, args
        out = capsys.readouterr()
        assert json.loads(out.out)["exit_code"] == 2 and len(out.err.strip().splitlines()) == 1, out.err
    with pytest.raises(SystemExit) as e:
        cli(["verify"])
    assert e.value.code == 2
    capsys.readouterr()
    # 3: the storage failed (the output's parent is a file)
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert cli(["export", str(run / "step-1"), str(afile / "out"), "--json"]) == 3
    out = capsys.readouterr()
    assert json.loads(out.out)["exit_code"] == 3 and len(out.err.strip().splitlines()) == 1
    assert exit_code(StoragePermissionError("x")) == EXIT_STORAGE and exit_code(CorruptCheckpointError("x")) == 2
    assert exit_code(KeyboardInterrupt()) == 130 and exit_code(TypeError("bug")) == EXIT_INTERNAL


def test_ls_inspect_verify_say_why_a_path_is_not_a_checkpoint(run: Path, tmp_path: Path, capsys: Any) -> None:
    typo = tmp_path / "rnu"
    interrupted = tmp_path / "run2" / "step-6"
    (interrupted / "data" / "x").mkdir(parents=True)
    (interrupted / "data" / "x" / "0-0.bin").write_bytes(b"partial")
    # an unrelated tree: only its top level is looked at
    tree = tmp_path / "tree"
    for i in range(30):
        (tree / f"d{i}" / "sub").mkdir(parents=True)
        (tree / f"d{i}" / "sub" / "f").write_bytes(b"x")
    cases = [
        (["ls", str(typo)], f"nothing at {typo}"),
        (["ls", str(run / "step-1")], "is a checkpoint, not a run directory"),
        (["ls", str(interrupted.parent)], "step-6 hold(s) files of saves that never committed"),
        (["ls", str(tree)], f"no committed checkpoint below {tree}"),
        (["inspect", str(typo)], f"no checkpoint at {typo}"),
        (["verify", str(typo)], f"no checkpoint at {typo}"),
        (["inspect", str(tree)], "no metadata.json among its 30 entries (d0, d1, d10, d11, d12, ...)"),
        (["inspect", str(interrupted)], f"The next save to {interrupted} removes these files, or `bytecp gc "
                                        f"{interrupted}`"),
    ]
    for args, words in cases:
        assert cli(args) == 2, args
        out = capsys.readouterr()
        assert out.out == "" and len(out.err.strip().splitlines()) == 1 and words in out.err, (args, out.err)


def test_inspect_summarises_and_lists_tensors_on_request(run: Path, capsys: Any) -> None:
    ck = str(run / "step-2")
    assert cli(["inspect", ck]) == 0
    out = capsys.readouterr().out
    assert "group" in out and "model" in out and "model.0.weight" not in out and "--tensors" in out
    assert cli(["inspect", ck, "--tensors"]) == 0
    out = capsys.readouterr().out
    assert all(f"model.{i}.{w}" in out for i in (0, 1) for w in ("weight", "bias"))


@pytest.mark.spawn
def test_a_closed_pipe_ends_quietly_and_light_commands_skip_torch(run: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    many = tmp_path / "many"
    bytecp.save(str(many), {f"t{i}": torch.zeros(1) for i in range(3000)})
    cmd = [sys.executable, "-m", "bytecp.cli", "inspect", str(many), "--tensors"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline().startswith(b"checkpoint")
    p.stdout.close()  # the reader goes away, as `| head -1` does
    err = p.stderr.read().decode() if p.stderr else ""
    assert p.wait(timeout=120) == 141 and err == "", err
    # ls and the wrong-path answers read metadata only: no torch import
    probe = ("import sys; from bytecp.cli import main; "
             f"codes = [main(['ls', {str(run)!r}]), main(['inspect', {str(tmp_path / 'nope')!r}])]; "
             "print(codes, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120).stdout
    assert out.strip().endswith("[0, 2] False"), out
