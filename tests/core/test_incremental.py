"""Incremental checkpoints (format version 3): unchanged boxes are referenced
in the base checkpoint of the same run, never written twice; every reader
follows the references; hostile references are refused with one error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import bytecp
from bytecp.cli import main as cli
from bytecp.errors import ConfigError, CorruptCheckpointError
from bytecp.interop.export import export_safetensors


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))
    model[0].requires_grad_(False)  # the frozen part: written once
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
    return model, opt


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 64)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _own_bytes(url: Path) -> int:
    md = json.loads((url / "metadata.json").read_text())
    return sum(n for f, n in md["data_files"].items() if not f.startswith("../"))


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, nn.Module, torch.optim.Optimizer]:
    model, opt = _model()
    _step(model, opt)
    bytecp.save(str(tmp_path / "step-1"), {"model": model, "optim": opt}, step=1)
    _step(model, opt)
    bytecp.save(str(tmp_path / "step-2"), {"model": model, "optim": opt}, step=2, base=str(tmp_path / "step-1"))
    return tmp_path, model, opt


def test_incremental_writes_only_what_changed_and_loads_bitwise(run: Any) -> None:
    root, model, opt = run
    md = json.loads((root / "step-2" / "metadata.json").read_text())
    assert md["format_version"] == 5 and list(md["references"]) == ["step-1"]
    assert _own_bytes(root / "step-2") < _own_bytes(root / "step-1") - 64 * 64 * 4  # the frozen weight is referenced
    sd = bytecp.load_state_dict(str(root / "step-2"))
    for k, v in model.state_dict().items():
        assert torch.equal(sd["model"][k], v), k
    fresh, fresh_opt = _model()
    bytecp.load(str(root / "step-2"), {"model": fresh, "optim": fresh_opt})
    for (k, v), w in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(v, w), k
    for p, q in zip(opt.state.values(), fresh_opt.state.values(), strict=True):
        for k in p:
            assert torch.equal(p[k], q[k]), k


def test_chains_stay_one_hop_and_tools_follow_references(run: Any, capsys: pytest.CaptureFixture[str]) -> None:
    root, model, opt = run
    _step(model, opt)
    md = bytecp.save(str(root / "step-3"), {"model": model, "optim": opt}, base=str(root / "step-2"))
    # the frozen layer still names step-1's file: references are flat, never chains
    assert set(md.references) == {"step-1"}, md.references
    assert cli(["verify", str(root / "step-3")]) == 0
    capsys.readouterr()
    assert cli(["inspect", "--json", str(root / "step-3")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert set(info["references"]) == {"step-1"} and info["totals"]["referenced_bytes"] > 0
    out = root / "model.safetensors"
    export_safetensors(str(root / "step-3"), str(out))
    from safetensors.torch import load_file

    got = load_file(str(out))
    for k, v in model.state_dict().items():
        assert torch.equal(got[k], v), k


def test_changed_in_place_is_written_again(run: Any) -> None:
    root, model, opt = run
    with torch.no_grad():
        model[0].weight.add_(1.0)  # frozen, but changed: its version moved
    md = bytecp.save(str(root / "step-3"), {"model": model, "optim": opt}, base=str(root / "step-2"))
    assert md.references  # the unchanged boxes are still referenced
    from bytecp.loading.opened import open_checkpoint

    rows = [c for c in open_checkpoint(str(root / "step-3")).all_rows() if c.fqn == "model.0.weight"]
    assert rows and all(not c.file.startswith("../") for c in rows), rows  # written again, not referenced
    sd = bytecp.load_state_dict(str(root / "step-3"))
    assert torch.equal(sd["model"]["0.weight"], model[0].weight)


def test_base_must_be_a_sibling(tmp_path: Path) -> None:
    model, opt = _model()
    bytecp.save(str(tmp_path / "a" / "step-1"), {"model": model})
    with pytest.raises(ConfigError, match="same run"):
        bytecp.save(str(tmp_path / "b" / "step-2"), {"model": model}, base=str(tmp_path / "a" / "step-1"))


@pytest.mark.parametrize("lazy", [False, True])
def test_async_save_references_too(run: Any, lazy: bool) -> None:
    """Async saves reference alike; from the second (the plan cached) the
    snapshot copies only what it writes."""
    root, model, opt = run
    base = str(root / "step-2")
    for step in (3, 4, 5):
        _step(model, opt)
        handle = bytecp.async_save(str(root / f"step-{step}"), {"model": model, "optim": opt}, base=base, lazy=lazy)
        md = handle.wait()
        assert "step-1" in md.references, md.references
        _assert_loads(str(root / f"step-{step}"), model, opt)
        base = str(root / f"step-{step}")
    report = json.loads((root / "step-5" / "reports" / "0.json").read_text())
    copied = next(sp["nbytes"] for sp in report["spans"] if sp["phase"] == "stage")
    assert copied < 64 * 64 * 4, copied  # the frozen weight was neither copied nor written


# ----------------------------------------------------------------- hostile references
def _edit(path: Path, fn: Any) -> None:
    md = json.loads(path.read_text())
    fn(md)
    path.write_text(json.dumps(md))


def _rename_ref(md: dict[str, Any], old: str, new: str) -> None:
    md["data_files"] = {f.replace(f"../{old}/", f"../{new}/"): n for f, n in md["data_files"].items()}
    md["references"] = {new if k == old else k: v for k, v in md["references"].items()}


@pytest.mark.parametrize(
    "case, match",
    [
        ("outside", "refusing data file"),
        ("dotdot", "references must map checkpoint names"),
        ("missing", "is not a committed checkpoint"),
        ("uncommitted", "is not a committed checkpoint"),
        ("self", "reference to itself"),
        ("cycle", "form a cycle"),
        ("replaced", "not the referenced save"),
    ],
)
def test_hostile_references_are_refused(run: Any, case: str, match: str) -> None:
    root = run[0]
    md2 = root / "step-2" / "metadata.json"
    ref = next(f for f in json.loads(md2.read_text())["data_files"] if f.startswith("../"))
    if case == "outside":
        _edit(md2, lambda md: md["data_files"].update({"../elsewhere/data/x/0-0.bin": 4096}))
    elif case == "dotdot":
        _edit(md2, lambda md: md["references"].update({"..": "x"}))
    elif case == "missing":
        shutil.rmtree(root / "step-1")
    elif case == "uncommitted":
        (root / "step-1" / "metadata.json").unlink()
    elif case == "self":
        _edit(md2, lambda md: _rename_ref(md, "step-1", "step-2"))
    elif case == "cycle":  # step-1 claims the file lies in step-2, which points back
        own = ref.split("/", 2)[2]

        def back(md: dict[str, Any]) -> None:
            md["data_files"] = {("../step-2/" + f if f == own else f): n for f, n in md["data_files"].items()}
            md["references"] = {"step-2": json.loads(md2.read_text())["save_id"]}  # (in the header: written always)
            md["format_version"] = 4

        _edit(root / "step-1" / "metadata.json", back)
    elif case == "replaced":
        _edit(root / "step-1" / "metadata.json", lambda md: md.update(save_id="20990101T000000-deadbeef"))
    with pytest.raises(CorruptCheckpointError, match=match) as e:
        bytecp.load_state_dict(str(root / "step-2"))
    assert "\n" not in str(e.value)
    assert cli(["verify", str(root / "step-2")]) != 0


# ----------------------------------------------------------------- manager, retention, materialize
def _assert_loads(url: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    sd = bytecp.load_state_dict(url)
    for k, v in model.state_dict().items():
        assert torch.equal(sd["model"][k], v), k
    for i, st in enumerate(opt.state.values()):
        for k, v in st.items():
            got = sd["optim"]["state"][f"1.{'weight' if i == 0 else 'bias'}"][k]
            assert torch.equal(got, v), k


def test_manager_is_incremental_with_a_full_save_every_k(tmp_path: Path) -> None:
    from bytecp.catalog import list_bases

    model, opt = _model()
    mgr = bytecp.CheckpointManager(str(tmp_path), every_n_steps=1, keep_last=2, full_every=3)
    refs = {}
    for step in range(1, 8):
        _step(model, opt)
        mgr.save(step, {"model": model, "optim": opt})
        refs[step] = set(json.loads((tmp_path / f"step-{step}" / "metadata.json").read_text()).get("references", {}))
        _assert_loads(str(tmp_path / f"step-{step}"), model, opt)  # the newest, whatever retention did
    # full saves at 1, 4, 7; the others reference the frozen layer in the last full one
    assert refs == {1: set(), 2: {"step-1"}, 3: {"step-1"}, 4: set(), 5: {"step-4"}, 6: {"step-4"}, 7: set()}
    assert [c.name for c in mgr_list(tmp_path)] == ["step-6", "step-7"]
    assert list_bases(str(tmp_path)) == ["step-4"]  # step-6 reads its frozen layer
    with pytest.raises(bytecp.CheckpointNotFoundError, match="retired by retention"):
        bytecp.load_state_dict(str(tmp_path / "step-4"))
    assert not any((tmp_path / f"step-{s}").exists() for s in (1, 2, 3, 5))
    assert not list((tmp_path / "step-4" / "index").glob("*/*"))  # a retired base keeps only referenced data
    assert cli(["verify", str(tmp_path / "step-6")]) == 0
    # gc of the run never takes a retired base for a save that did not commit
    assert cli(["gc", str(tmp_path), "--no-progress"]) == 0
    assert cli(["verify", str(tmp_path / "step-6")]) == 0
    _step(model, opt)
    mgr.save(8, {"model": model, "optim": opt})  # references step-7 only: the bases go
    assert list_bases(str(tmp_path)) == [] and not (tmp_path / "step-4").exists()


def mgr_list(root: Path) -> list[Any]:
    from bytecp.catalog import list_checkpoints

    return list_checkpoints(str(root))


def test_retention_keeps_a_base_a_save_in_flight_pinned(run: Any) -> None:
    from bytecp.storage_api import open_storage
    from bytecp.tools.retention import retain

    root = run[0]
    (root / "step-1" / "pins").mkdir()
    (root / "step-1" / "pins" / "step-9.x").write_text("{}")
    res = retain(open_storage(str(root)), ["step-2"], ["step-1"], lambda: ["step-2"])
    assert res.retired == ["step-1"]
    md = json.loads((root / "step-1" / "base.json").read_text())
    assert set(md["retained"]) == {f for f in md["data_files"] if not f.startswith("../")}  # everything stays
    assert not (root / "step-1" / "metadata.json").exists()
    _assert_loads(str(root / "step-2"), run[1], run[2])


def test_materialize_writes_a_self_contained_copy(run: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    root, model, opt = run
    out = tmp_path_factory.mktemp("elsewhere") / "ck"
    assert cli(["materialize", str(root / "step-2"), str(out), "--no-progress"]) == 0
    shutil.rmtree(root)
    md = json.loads((out / "metadata.json").read_text())
    assert not md.get("references") and not any(f.startswith("../") for f in md["data_files"])
    assert cli(["verify", str(out)]) == 0
    _assert_loads(str(out), model, opt)


def test_a_save_into_a_retired_base_is_refused(run: Any) -> None:
    """A retired base holds files kept checkpoints reference: a save there
    would replace the save they reference and its sweep delete their data."""
    from bytecp.storage_api import open_storage
    from bytecp.tools.retention import retain

    root, model, opt = run
    retain(open_storage(str(root)), ["step-2"], ["step-1"], lambda: ["step-2"])
    assert (root / "step-1" / "base.json").exists()
    with pytest.raises(bytecp.errors.CheckpointExistsError, match="retired"):
        bytecp.save(str(root / "step-1"), {"model": model, "optim": opt}, step=1, overwrite=True)
    fresh, fresh_opt = _model()
    bytecp.load(str(root / "step-2"), {"model": fresh, "optim": fresh_opt})
    assert torch.equal(fresh[0].weight, model[0].weight)


def test_a_load_in_place_ends_reuse_of_the_last_save(run: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A load reads into the tensors' memory without moving their version
    counters: the next save must not reference the rows of the save before it."""
    root, model, opt = run
    other = tmp_path_factory.mktemp("other")
    donor, donor_opt = _model()
    with torch.no_grad():
        donor[0].weight.add_(1.0)
    bytecp.save(str(other / "step-9"), {"model": donor, "optim": donor_opt}, step=9)
    bytecp.load(str(other / "step-9"), {"model": model, "optim": opt})
    assert torch.equal(model[0].weight, donor[0].weight)
    bytecp.save(str(root / "step-3"), {"model": model, "optim": opt}, step=3, base=str(root / "step-2"))
    sd = bytecp.load_state_dict(str(root / "step-3"))
    assert torch.equal(sd["model"]["0.weight"], donor[0].weight)


def test_gc_of_a_run_whose_base_is_gone(run: Any) -> None:
    """gc reads which save committed without following references: a
    checkpoint whose base is gone does not stop the collection of the run."""
    from bytecp.storage_api import open_storage
    from bytecp.tools.gc import collect_garbage

    root = run[0]
    (root / "step-2" / "data" / "20000101T000000-dead").mkdir()
    (root / "step-2" / "data" / "20000101T000000-dead" / "0.bin").write_bytes(b"x")
    shutil.rmtree(root / "step-1")
    res = collect_garbage(open_storage(str(root)))
    assert res.removed == ["step-2/data/20000101T000000-dead/0.bin"]


def test_ls_never_sends_gc_to_a_retired_base(run: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """A run left with only a retired base (its referencing checkpoint
    removed by hand): ls does not say gc removes it (gc never does)."""
    from bytecp.storage_api import open_storage
    from bytecp.tools.retention import retain

    root = run[0]
    retain(open_storage(str(root)), ["step-2"], ["step-1"], lambda: ["step-2"])
    shutil.rmtree(root / "step-2")
    assert cli(["ls", str(root)]) != 0
    out = capsys.readouterr()
    assert "no committed checkpoint" in out.err and "bytecp gc" not in out.err, out.err


def test_overwriting_a_base_that_a_checkpoint_references_is_refused(run: Any) -> None:
    """The overwrite would remove the files the newer checkpoint reads."""
    root, model, opt = run
    with pytest.raises(bytecp.errors.CheckpointExistsError, match="step-2"):
        bytecp.save(str(root / "step-1"), {"model": model, "optim": opt}, step=1, overwrite=True)
    _assert_loads(str(root / "step-2"), model, opt)
    bytecp.save(str(root / "step-2"), {"model": model, "optim": opt}, step=2, overwrite=True)  # nobody reads it
    _assert_loads(str(root / "step-2"), model, opt)


def test_the_pin_of_a_killed_save_keeps_nothing(run: Any) -> None:
    """A save killed between pin and unpin: once it cannot be running, its
    pin no longer keeps the whole base (only what kept checkpoints read)."""
    from bytecp.storage_api import open_storage
    from bytecp.tools.retention import retain

    root = run[0]
    (root / "step-1" / "pins").mkdir()
    (root / "step-1" / "pins" / "step-9.20000101T000000-dead").write_text("{}")
    res = retain(open_storage(str(root)), ["step-2"], ["step-1"], lambda: ["step-2"])
    assert res.retired == ["step-1"]
    md = json.loads((root / "step-1" / "base.json").read_text())
    read = {f[len("../step-1/"):] for f in json.loads((root / "step-2" / "metadata.json").read_text())["data_files"]
            if f.startswith("../step-1/")}
    assert set(md["retained"]) == read
    left = {str(p.relative_to(root / "step-1")) for p in (root / "step-1").rglob("*") if p.is_file()}
    assert left - {"base.json", "pins/step-9.20000101T000000-dead"} == read  # its index went
    _assert_loads(str(root / "step-2"), run[1], run[2])
