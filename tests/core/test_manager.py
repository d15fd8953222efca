"""CheckpointManager: save every N steps, keep the last K committed, resume
from the latest committed checkpoint (never an interrupted one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import bytecp
from bytecp.cli import main as cli
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
    assert sorted(p.name for p in Path(run).iterdir()) == ["step-4", "step-6"]
    # an interrupted later save (no metadata.json) is ignored
    bytecp.save(f"{run}/step-8", {"model": model, "extra": {"step": 8}})
    (Path(run) / "step-8" / "metadata.json").unlink()
    fresh = nn.Linear(3, 2)
    extra = {"step": 0}
    assert mgr.restore({"model": fresh, "extra": extra}) == 6 and extra["step"] == 6
    assert torch.equal(fresh.weight, model.weight - 1.0)
    assert cli(["ls", run]) == 0
    out = capsys.readouterr().out
    assert "step-6" in out and "step-8" not in out


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
    md["format_version"] = 2
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
