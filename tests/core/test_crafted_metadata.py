"""Checkpoints edited by hand or crafted: each is refused with a bytecp
error naming what is wrong (a command exits 2, no traceback), never a raw
Python error, a crash of the tools or a silent wrong load."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import bytecp
from bytecp.cli import main as cli
from bytecp.errors import CorruptCheckpointError
from bytecp.format.checksum import crc32c


def saved(tmp_path: Path, state: dict[str, Any] | None = None) -> Path:
    ck = tmp_path / "run" / "step-1"
    torch.manual_seed(0)
    bytecp.save(str(ck), state or {"model": torch.nn.Linear(8, 8), "extra": {"step": 1}})
    return ck


def edit(ck: Path, change: Any) -> None:
    d = json.loads((ck / "metadata.json").read_text())
    change(d)
    (ck / "metadata.json").write_text(json.dumps(d))


def test_a_part_rank_or_size_beyond_int64_is_refused(tmp_path: Path, capsys: Any) -> None:
    ck = saved(tmp_path)
    edit(ck, lambda d: d["index"]["parts"].update(rank=[2**63]))
    with pytest.raises(CorruptCheckpointError, match=r"index \(layout parts\) lists a part's rank or size beyond"):
        bytecp.load_state_dict(str(ck))  # (a raw OverflowError from numpy before)
    assert cli(["verify", str(ck)]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_a_huge_created_time_is_refused_by_ls_too(tmp_path: Path, capsys: Any) -> None:
    ck = saved(tmp_path)
    text = (ck / "metadata.json").read_text()
    d = json.loads(text)
    (ck / "metadata.json").write_text(text.replace(json.dumps(d["created"]), "1" + "0" * 400, 1))
    assert cli(["ls", str(ck.parent)]) == 0  # (an OverflowError, exit 70, before)
    out, err = capsys.readouterr()
    assert "step-1\tstep=1\t-\t(resume skips it:" in out and "metadata.json is malformed" in out, out
    assert "Traceback" not in err, err


def test_a_tensor_made_empty_in_metadata_is_refused_by_the_tools(tmp_path: Path, capsys: Any) -> None:
    ck = saved(tmp_path)
    edit(ck, lambda d: d["tensors"].update(dims=[0, *d["tensors"]["dims"][1:]]))
    for cmd in (["verify", str(ck)], ["inspect", str(ck), "--tensors"]):
        assert cli(cmd) == 2, cmd  # (a ZeroDivisionError, exit 70, before)
        err = capsys.readouterr().err
        assert "does not belong in it" in err and "Traceback" not in err, err


@pytest.mark.parametrize("groups", [[{"lr": 0.1}], {"a": 1}])
def test_param_groups_of_another_shape_are_refused_naming_the_optimizer(tmp_path: Path, groups: Any) -> None:
    m = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    ck = saved(tmp_path, {"model": m, "optim": opt})
    buf = io.BytesIO()
    torch.save(groups, buf)  # (a blob that loads with weights_only=True, its crc right)
    blob = buf.getvalue()

    def swap(d: dict[str, Any]) -> None:
        rec = d["objects"]["optim.param_groups"]
        f = ck / rec["file"]
        data = f.read_bytes()
        pad = -len(blob) % 4096
        f.write_bytes(data + blob + bytes(pad))
        d["data_files"][rec["file"]] = len(data) + len(blob) + pad
        rec.update(byte_offset=len(data), nbytes=len(blob), crc32c=crc32c(blob))

    edit(ck, swap)
    m2 = torch.nn.Linear(4, 4)
    with pytest.raises(CorruptCheckpointError, match=r"optimizer 'optim': the checkpoint's param groups are not"):
        bytecp.load(str(ck), {"model": m2, "optim": torch.optim.Adam(m2.parameters())})  # (KeyError before)


@pytest.mark.parametrize("files", [{"tok\x00en.json": "{}"}, {"a.json": "\ud800"}, {"t" * 300 + ".json": "{}"}])
def test_tokenizer_files_no_file_system_can_hold_are_refused_by_export(tmp_path: Path, files: dict[str, str],
                                                                       capsys: Any) -> None:
    """A NUL in a name, a lone surrogate in the text, a name over 255 bytes:
    exit 2 naming the metadata key (exit 70 on a ValueError, or 3 as a storage error, before)."""
    ck = tmp_path / "run" / "step-1"
    bytecp.save(str(ck), {"model": torch.nn.Linear(4, 4)}, metadata={"hf_tokenizer_files": {"ok.json": "{}"}})
    edit(ck, lambda d: d["user_metadata"].update(hf_tokenizer_files=files))
    assert cli(["export", str(ck), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "'hf_tokenizer_files'" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
