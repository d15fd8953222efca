"""``bytecp export CK OUT --format dcp``: a checkpoint saved by FSDP2 on 2
gloo ranks (model + Adam + plain values) exported with the CLI loads with
``torch.distributed.checkpoint.load`` in one process with no process group
and under FSDP2 on 3 ranks, every tensor bitwise; the export's keys,
planner data and dtypes are those ``dcp.save`` writes for the same state;
``--prefix``; refusals in one line; peak memory of about one tensor."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from spawning import spawns
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import bytecp
from bytecp.cli import main as cli
from bytecp.interop import dcp_export
from bytecp.interop.dcp_export import export_dcp

from . import dcp_cases

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dist.pool import WorkerPool  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested state as ``{dotted key: leaf}`` (tuples and lists of plain values are leaves)."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, list) and any(isinstance(v, dict | torch.Tensor) for v in value):
        return {k: v for i, x in enumerate(value) for k, v in flat(x, f"{prefix}.{i}").items()}
    return {prefix: value}


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    g, w = flat(got), flat(want)
    assert set(g) == set(w), set(g) ^ set(w)
    for k, v in w.items():
        if isinstance(v, torch.Tensor):
            assert g[k].dtype == v.dtype and torch.equal(g[k], v), k
        else:
            assert g[k] == v, (k, g[k], v)


@pytest.fixture(scope="module")
@spawns
def exported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Any]]]:
    """An FSDP2 x2 checkpoint exported with the CLI; the full state rank 0 saw."""
    base = tmp_path_factory.mktemp("dcp")
    pool = WorkerPool(2)
    try:
        ref = pool.run(dcp_cases.train_and_save, str(base / "ck"), timeout=300)[0]
    finally:
        pool.close(kill=True)
    assert cli(["export", str(base / "ck"), str(base / "out"), "--format", "dcp"]) == 0
    yield base / "out", ref


def test_loads_in_one_process_without_a_process_group(exported: tuple[Path, dict[str, Any]]) -> None:
    out, ref = exported
    torch.manual_seed(1)
    model = dcp_cases.Tiny()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, opt)
    state: dict[str, Any] = {"model": msd, "optim": osd, "train": {"step": 0, "tokens": 0}, "lrs": (0.0, 0.0)}
    dcp.load(state, checkpoint_id=str(out))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    msd, osd = get_state_dict(model, opt)
    assert_same({"model": msd, "optim": osd, "train": state["train"], "lrs": state["lrs"]}, ref)
    assert state["train"] == {"step": 2, "tokens": 1234} and state["lrs"] == (0.5, 0.25)


def test_loads_under_fsdp2_on_three_ranks(exported: tuple[Path, dict[str, Any]]) -> None:
    out, ref = exported
    pool = WorkerPool(3)
    try:
        got = pool.run(dcp_cases.load_exported, str(out), timeout=300)[0]
    finally:
        pool.close(kill=True)
    assert_same(got, ref)


def _plain_state(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    torch.manual_seed(seed)
    model = dcp_cases.Tiny()
    model.layers[1].weight = model.layers[0].weight  # tied: written under both names, once
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.8, 0.9))
    model(torch.randint(0, 37, (2, 4))).sum().backward()
    opt.step()
    extra = {"train": {"step": 3, "names": ["a", "b"]}, "rng": torch.get_rng_state(), "lrs": (0.5, 0.25),
             "hist": [torch.arange(3.0), torch.ones(2, dtype=torch.bfloat16)]}
    return model, opt, extra


def test_keys_and_planner_data_are_those_dcp_save_writes(tmp_path: Path) -> None:
    model, opt, extra = _plain_state()
    bytecp.save(str(tmp_path / "ck"), {"model": model, "optim": opt, **extra})
    export_dcp(str(tmp_path / "ck"), str(tmp_path / "ours"), max_file_size=4096)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, **extra}, checkpoint_id=str(tmp_path / "theirs"))
    ours = pickle.loads((tmp_path / "ours" / ".metadata").read_bytes())
    theirs = pickle.loads((tmp_path / "theirs" / ".metadata").read_bytes())
    assert set(ours.state_dict_metadata) == set(theirs.state_dict_metadata)
    for k, want in theirs.state_dict_metadata.items():
        got = ours.state_dict_metadata[k]
        assert type(got) is type(want), k
        if isinstance(want, TensorStorageMetadata):
            assert (got.size, got.properties.dtype) == (want.size, want.properties.dtype), k
    assert ours.planner_data == theirs.planner_data
    assert (ours.version, type(ours.storage_meta)) == (theirs.version, type(theirs.storage_meta))
    assert len(list((tmp_path / "ours").glob("*.distcp"))) > 2  # cut at max_file_size
    assert sum(isinstance(m, BytesStorageMetadata) for m in ours.state_dict_metadata.values()) > 5
    # planner_data rebuilds the nested state without a target (dcp_to_torch_save)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(tmp_path / "ours"), str(tmp_path / "full.pt"))
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    assert_same(full, {"model": msd, "optim": osd, **extra})


def test_prefix_selects_and_strips(tmp_path: Path, capsys: Any) -> None:
    model, opt, extra = _plain_state()
    bytecp.save(str(tmp_path / "ck"), {"model": model, "optim": opt, **extra})
    assert cli(["export", str(tmp_path / "ck"), str(tmp_path / "m"), "--format", "dcp", "--prefix", "model"]) == 0
    assert "torch.distributed.checkpoint" in capsys.readouterr().out
    target = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(target, checkpoint_id=str(tmp_path / "m"))
    assert_same(target, model.state_dict())
    md = pickle.loads((tmp_path / "m" / ".metadata").read_bytes())
    assert set(md.state_dict_metadata) == set(model.state_dict())
    assert cli(["export", str(tmp_path / "ck"), str(tmp_path / "k"), "--format", "dcp", "--prefix", "train",
                "--keep-prefix", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["format"] == "dcp" and res["tensors"] == 0
    md = pickle.loads((tmp_path / "k" / ".metadata").read_bytes())
    assert set(md.state_dict_metadata) == {"train.step", "train.names"}


def test_refusals_are_one_line(tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, extra = _plain_state()
    ck, out = str(tmp_path / "ck"), tmp_path / "out"
    bytecp.save(ck, {"model": model, "optim": opt})
    assert cli(["export", ck, str(out), "--format", "dcp"]) == 0
    before = (out / ".metadata").read_bytes()
    capsys.readouterr()
    assert cli(["export", ck, str(out), "--format", "dcp"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "already exists" in err and "--overwrite" in err, err
    assert (out / ".metadata").read_bytes() == before
    assert cli(["export", ck, str(out), "--format", "dcp", "--prefix", "model", "--overwrite"]) == 0
    assert not any(k.startswith("optim") for k in pickle.loads((out / ".metadata").read_bytes()).state_dict_metadata)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "out"]  # no staging directory left
    capsys.readouterr()
    assert cli(["export", ck, str(tmp_path / "x"), "--format", "dcp", "--prefix", "nothing"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'model'" in err, err
    monkeypatch.setattr(dcp_export, "SUPPORTED_DTYPES",
                        {k: v for k, v in dcp_export.SUPPORTED_DTYPES.items() if k != "float32"})
    assert cli(["export", ck, str(tmp_path / "y"), "--format", "dcp"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "float32" in err and "cannot save" in err, err
    assert not (tmp_path / "y").exists()


MEM_SCRIPT = """
import json, sys, time, torch
import bytecp
from bytecp.interop.dcp_export import export_dcp
mode, ck, out = sys.argv[1:4]
if mode == "save":
    g = torch.Generator().manual_seed(0)
    bytecp.save(ck, {"model": {f"l{i}": torch.randn(8 << 20, generator=g) for i in range(8)}})
elif mode == "export":
    t0 = time.perf_counter()
    export_dcp(ck, out, max_file_size=100 << 20)
else:
    import torch.distributed.checkpoint
    from bytecp.interop.export import open_export
    open_export(ck)
# VmHWM: this process's own peak (ru_maxrss keeps the forking parent's across exec)
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"maxrss_kib": hwm}))
"""


@pytest.mark.slow
@pytest.mark.spawn
def test_export_holds_about_one_tensor(tmp_path: Path) -> None:
    def run(mode: str) -> float:
        p = subprocess.run([sys.executable, "-c", MEM_SCRIPT, mode, str(tmp_path / "ck"), str(tmp_path / "out")],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        return float(json.loads(p.stdout.strip().splitlines()[-1])["maxrss_kib"]) / 1024

    run("save")  # 8 tensors of 32 MiB
    got, base = run("export"), run("baseline")
    extra = got - base
    print(f"DCP export of 256 MiB: peak RSS {got:.0f} MiB, baseline {base:.0f} MiB: +{extra:.0f} MiB")
    assert extra < 128, extra  # a 64 MiB read group plus slack; the state is 256 MiB
    target = {"model": {f"l{i}": torch.empty(8 << 20) for i in range(8)}}
    dcp.load(target, checkpoint_id=str(tmp_path / "out"))
    g = torch.Generator().manual_seed(0)
    for i in range(8):
        assert torch.equal(target["model"][f"l{i}"], torch.randn(8 << 20, generator=g)), i
    assert len(list((tmp_path / "out").glob("*.distcp"))) == 3
