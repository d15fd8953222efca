"""A DCP checkpoint of FSDP2 x 2 (model and Adam state through
``get_state_dict``, written by ``torch.distributed.checkpoint.save`` on gloo)
loaded by bytecp with no conversion: into one process without
torch.distributed, into FSDP2 x 3 and into DDP x 2; every tensor, model and
optimizer, bitwise equal to the state that was saved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import bytecp

from . import dcp_cases as cases

pytestmark = pytest.mark.timeout(600)


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Model tensors and per-parameter optimizer state bitwise equal; hyperparameters equal."""
    assert set(got["model"]) == set(want["model"])
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert set(got["optim"]["state"]) == set(want["optim"]["state"])
    for fqn, st in want["optim"]["state"].items():
        assert set(got["optim"]["state"][fqn]) == set(st), fqn
        for k, v in st.items():
            assert torch.equal(got["optim"]["state"][fqn][k], v), (fqn, k)
    assert [g["lr"] for g in got["optim"]["param_groups"]] == [0.01]


@pytest.fixture(scope="module")
def saved(pools, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    path = tmp_path_factory.mktemp("dcp") / "step-2"
    full = pools(2).run(cases.save_fsdp2, str(path), timeout=300)[0]
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    return path, full


def test_one_process_no_torch_distributed(saved: tuple[Path, dict[str, Any]]) -> None:
    path, full = saved
    sd = bytecp.load_state_dict(str(path))
    assert sd["extra"] == cases.EXTRA
    got_groups = sd["optim"]["param_groups"]
    assert got_groups[0]["params"] == list(full["optim"]["state"]) and got_groups[0]["betas"] == (0.9, 0.999)
    _same(sd, full)
    # into a plain model and optimizer (no torch.distributed): bytecp's names are DCP's
    model = cases.build(1)
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    state = {"model": model, "optim": opt, "extra": {"step": 0, "note": "", "betas": ()}}
    res = bytecp.load(str(path), state)
    assert res.missing_keys == res.unexpected_keys == [] and state["extra"] == cases.EXTRA
    names = [n for n, _ in model.named_parameters()]
    osd = opt.state_dict()
    _same({"model": model.state_dict(), "optim": {
        "state": {names[i]: st for i, st in osd["state"].items()}, "param_groups": osd["param_groups"]}}, full)


def test_fsdp2_at_world_size_3(pools, saved: tuple[Path, dict[str, Any]]) -> None:
    path, full = saved
    got = pools(3).run(cases.load_fsdp2, str(path), timeout=300)[0]
    assert got["keys"] == ([], []) and got["extra"] == cases.EXTRA
    _same(got, full)


def test_ddp_at_world_size_2(pools, saved: tuple[Path, dict[str, Any]]) -> None:
    path, full = saved
    for got in pools(2).run(cases.load_ddp, str(path), timeout=300)[:1]:
        assert got["keys"] == ([], [])
        _same(got, full)
