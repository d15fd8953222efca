"""``bytecp export --format dcp`` to S3 (moto and a real Ceph RADOS Gateway):
data files streamed as uploads, ``.metadata`` written last, an existing
output refused without ``--overwrite`` and replaced with it (the old
export's files removed), and what ``dcp.load`` reads back."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_storage_export_s3 import download  # tests/storage is on the path (not a package)
from torch.distributed.checkpoint.state_dict import get_state_dict

import bytecp
from bytecp.cli import main as cli
from bytecp.storage_api import open_storage

pytestmark = [pytest.mark.s3, pytest.mark.timeout(600)]


def test_dcp_export_to_s3_loads_back(s3: Any, tmp_path: Path, unique_prefix: str, capsys: Any) -> None:
    server, bucket = s3
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 4096), torch.nn.Linear(4096, 8))  # 8 MiB: a multipart upload
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    ck = tmp_path / "ck"
    bytecp.save(str(ck), {"model": model, "optim": opt, "train": {"step": 5}})
    options = server.options()
    out = f"s3://{bucket}/{unique_prefix}/dcp"
    opts = ["--out-storage-options", json.dumps(options)]
    assert cli(["export", str(ck), out, "--format", "dcp", *opts]) == 0
    names = download(out, options, tmp_path / "a")
    assert ".metadata" in names and "__0_0.distcp" in names
    assert open_storage(out, **options).list_incomplete_uploads() == []  # type: ignore[attr-defined]
    fresh = torch.nn.Sequential(torch.nn.Linear(512, 4096), torch.nn.Linear(4096, 8))
    fopt = torch.optim.Adam(fresh.parameters())
    msd, osd = get_state_dict(fresh, fopt)
    state: dict[str, Any] = {"model": msd, "optim": osd, "train": {"step": 0}}
    dcp.load(state, checkpoint_id=str(tmp_path / "a"))
    want_m, want_o = get_state_dict(model, opt)
    for k, v in want_m.items():
        assert torch.equal(state["model"][k], v), k
    for fqn, st in want_o["state"].items():
        for k, v in st.items():
            assert torch.equal(state["optim"]["state"][fqn][k], v), (fqn, k)
    assert state["train"] == {"step": 5}
    capsys.readouterr()

    # an existing output is refused without --overwrite, untouched
    assert cli(["export", str(ck), out, "--format", "dcp", *opts]) == 2
    err = capsys.readouterr().err
    assert out in err and "--overwrite" in err and len(err.strip().splitlines()) == 1

    # --overwrite with the model only and small files: the old files go, the new .metadata names only these
    assert cli(["export", str(ck), out, "--format", "dcp", "--prefix", "model", "--overwrite", *opts]) == 0
    names = download(out, options, tmp_path / "b")
    md = pickle.loads((tmp_path / "b" / ".metadata").read_bytes())
    assert set(md.state_dict_metadata) == set(model.state_dict())
    assert {i.relative_path for i in md.storage_data.values()} | {".metadata"} == set(names)
    target = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(target, checkpoint_id=str(tmp_path / "b"))
    assert all(torch.equal(target[k], v) for k, v in model.state_dict().items())
