"""Readers pointed at something that is not a checkpoint: one line naming the
path and what to do, never a raw OSError."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import bytecp
from bytecp.cli import main as cli
from bytecp.errors import (
    BytecpError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StorageError,
)
from bytecp.manager import CheckpointManager
from bytecp.storage_api import open_storage
from bytecp.tools.inspect import summarize, verify


def every_reader(url: str) -> list:
    return [
        lambda: bytecp.load_state_dict(url),
        lambda: bytecp.load(url, {"w": torch.zeros(3)}),
        lambda: summarize(open_storage(url)),
        lambda: verify(open_storage(url)),
    ]


def one_line_error(fn, cls: type[BaseException], *parts: str) -> str:
    with pytest.raises(cls) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg, msg
    for p in parts:
        assert p in msg, (p, msg)
    assert not isinstance(info.value, OSError) or isinstance(info.value, BytecpError)
    return msg


def test_a_file_names_its_directory(tmp_path: Path, capsys) -> None:
    ck = tmp_path / "ck"
    bytecp.save(str(ck), {"w": torch.ones(3)})
    md = ck / "metadata.json"
    for fn in every_reader(str(md)):
        one_line_error(fn, CheckpointNotFoundError, f"{md} is a file, not a checkpoint directory", f"use its directory {ck}")
    pt = tmp_path / "model.pt"
    torch.save({"w": torch.ones(3)}, pt)
    for fn in every_reader(str(pt)):
        one_line_error(fn, CheckpointNotFoundError, f"{pt} is a file", "torch.save")
    assert cli(["verify", str(pt)]) == 2 and cli(["inspect", str(pt)]) == 2
    err = capsys.readouterr().err
    assert f"{pt} is a file" in err and "Traceback" not in err


def test_a_run_directory_names_its_latest_committed_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    mgr = CheckpointManager(str(run), every_n_steps=1, keep_last=None)
    for step in (1, 2, 10):
        mgr.save(step, {"w": torch.full((3,), float(step))})
    (run / "step-11" / "data").mkdir(parents=True)  # an interrupted save is never "latest"
    (run / "step-11" / "data" / "x.bin").write_bytes(b"partial")
    for fn in every_reader(str(run)):
        one_line_error(fn, CheckpointNotFoundError, f"{run} is a run directory", f"latest committed checkpoint is {run}/step-10")


def test_a_missing_path(tmp_path: Path) -> None:
    gone = tmp_path / "no" / "such" / "ckpt"
    for fn in every_reader(str(gone)):
        one_line_error(fn, CheckpointNotFoundError, f"no checkpoint at {gone}", "nothing is stored there", "bytecp ls")


def test_an_interrupted_save(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    bytecp.save(str(ck), {"w": torch.ones(3)})
    (ck / "metadata.json").unlink()
    for fn in every_reader(str(ck)):
        one_line_error(fn, IncompleteCheckpointError, str(ck), "interrupted or failed save")


def test_an_unknown_url_scheme() -> None:
    for fn in every_reader("s4://bucket/ckpt"):
        one_line_error(fn, StorageError, "s4://bucket/ckpt", "unknown URL scheme 's4://'", "typo")


def test_foreign_checkpoint_directories_say_what_they_are(tmp_path: Path) -> None:
    """A Hugging Face model directory or a DCP checkpoint is named as such,
    with how to load it: never called an interrupted save to delete."""
    hf = tmp_path / "gpt2"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "pytorch_model.bin").write_bytes(b"x")  # model.safetensors would be loaded (tests/hf)
    (hf / "tokenizer.json").write_text("{}")
    for fn in every_reader(str(hf)):
        msg = one_line_error(fn, CheckpointNotFoundError, f"{hf} is a Hugging Face model directory", "from_pretrained")
        assert "gc" not in msg and "interrupted" not in msg
    dcp = tmp_path / "dcp"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"x")
    (dcp / "__0_0.distcp").write_bytes(b"x")
    readers = every_reader(str(dcp))
    for fn in readers[:3]:  # the loads and inspect read a DCP directory as it is: this .metadata is named as broken
        one_line_error(fn, CorruptCheckpointError, f"{dcp}/.metadata", "does not decode")
    _, problems = verify(open_storage(str(dcp)))  # verify reports it (exit 1)
    assert len(problems) == 1 and f"{dcp}/.metadata" in str(problems[0]) and "\n" not in str(problems[0])
