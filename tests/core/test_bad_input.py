"""Bad input and safety: typed errors that name what is at fault; nothing is lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import bytecp
from bytecp.cli import main as cli
from bytecp.format.metadata import FORMAT_VERSION

from .helpers import same_bits


def small_state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    return {"model": nn.Linear(4, 3), "extra": {"step": seed}}


def data_files(ck: Path) -> list[Path]:
    return sorted((ck / "data").rglob("*.bin"))


def test_no_checkpoint_and_interrupted_save(tmp_path: Path) -> None:
    with pytest.raises(bytecp.CheckpointNotFoundError, match="no checkpoint at"):
        bytecp.load(str(tmp_path / "nothing"), small_state())
    ck = tmp_path / "ck"
    bytecp.save(str(ck), small_state())
    (ck / "metadata.json").unlink()
    with pytest.raises(bytecp.IncompleteCheckpointError, match="interrupted or failed save"):
        bytecp.load(str(ck), small_state())
    with pytest.raises(bytecp.IncompleteCheckpointError):
        bytecp.load_state_dict(str(ck))


def test_corrupted_data_fails_load_and_verify_naming_file_tensor_region(tmp_path: Path, capsys) -> None:
    ck = tmp_path / "ck"
    state = {"w": torch.arange(2000, dtype=torch.float32).reshape(40, 50)}
    bytecp.save(str(ck), state)
    (f,) = data_files(ck)
    raw = bytearray(f.read_bytes())
    raw[100] ^= 0xFF
    f.write_bytes(bytes(raw))
    target = {"w": torch.zeros(40, 50)}
    with pytest.raises(bytecp.CorruptCheckpointError) as ei:
        bytecp.load(str(ck), target)
    msg = str(ei.value)
    assert f.name in msg and "'w'" in msg and "[0:40, 0:50]" in msg and "checksum" in msg
    # verify names the same; exit code non-zero
    assert cli(["verify", str(ck)]) == 1
    err = capsys.readouterr().err
    assert f.name in err and "w" in err and "[0:40, 0:50]" in err and "crc32c mismatch" in err
    # checksums can be turned off for speed
    bytecp.load(str(ck), target, verify=False)


def test_truncated_data_file(tmp_path: Path, capsys) -> None:
    ck = tmp_path / "ck"
    bytecp.save(str(ck), {"w": torch.randn(3000)})
    (f,) = data_files(ck)
    f.write_bytes(f.read_bytes()[:5000])
    with pytest.raises(bytecp.CorruptCheckpointError) as ei:
        bytecp.load(str(ck), {"w": torch.zeros(3000)})
    assert "truncated" in str(ei.value) and f.name in str(ei.value) and "'w'" in str(ei.value)
    assert "load an earlier one (`bytecp ls RUN_DIR`" in str(ei.value)  # what to do
    from bytecp.format.limits import damaged

    assert "a keeper lost or evicted it" in damaged("keeper://job/run/step-1")  # not "copy it again" there
    assert cli(["verify", str(ck)]) == 1
    assert "truncated" in capsys.readouterr().err


def test_missing_data_file_named(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    bytecp.save(str(ck), {"w": torch.randn(30)})
    (f,) = data_files(ck)
    f.unlink()
    with pytest.raises(bytecp.CorruptCheckpointError, match=f"{f.name}.*missing|missing.*{f.name}"):
        bytecp.load(str(ck), {"w": torch.zeros(30)})


def test_shape_and_dtype_mismatch(tmp_path: Path) -> None:
    ck = str(tmp_path / "ck")
    bytecp.save(ck, {"model": nn.Linear(4, 3)})
    with pytest.raises(bytecp.StateMismatchError) as ei:
        bytecp.load(ck, {"model": nn.Linear(5, 3)})
    assert "model.weight" in str(ei.value) and "[3, 4]" in str(ei.value) and "[3, 5]" in str(ei.value)
    with pytest.raises(bytecp.StateMismatchError, match="float64") as ei:
        bytecp.load(ck, {"model": nn.Linear(4, 3).double()})
    assert "loads in its own dtypes" in str(ei.value) and "model.to(dtype)" in str(ei.value)  # what to do


def test_missing_and_unexpected_keys(tmp_path: Path) -> None:
    ck = str(tmp_path / "ck")
    bytecp.save(ck, {"model": nn.Linear(4, 3), "extra": {"a": 1}})
    other = nn.Sequential(nn.Linear(4, 3))
    with pytest.raises(bytecp.StateMismatchError) as ei:
        bytecp.load(ck, {"model": other, "extra": {"a": 0, "b": 2}})
    msg = str(ei.value)
    assert "'model.0.weight'" in msg and "'extra.b'" in msg  # missing
    assert "'model.weight'" in msg and "'model.bias'" in msg  # unexpected
    extra = {"a": 0, "b": 2}
    res = bytecp.load(ck, {"model": other, "extra": extra}, strict=False)
    assert set(res.missing_keys) == {"model.0.weight", "model.0.bias", "extra.b"}
    assert set(res.unexpected_keys) == {"model.weight", "model.bias"}
    assert extra == {"a": 1, "b": 2}


def test_an_optimizer_over_other_parameters_is_refused_saying_which_and_what_to_do(tmp_path: Path) -> None:
    """Saved with a tied output layer (one parameter), loaded into the untied
    model's optimizer (two): one line naming the parameter on the optimizer's
    side only, and the two ways out; refused before anything is read, the
    model untouched."""
    class LM(nn.Module):
        def __init__(self, tied: bool) -> None:
            super().__init__()
            self.embed, self.head = nn.Embedding(16, 8), nn.Linear(8, 16, bias=False)
            if tied:
                self.head.weight = self.embed.weight

    tied = LM(tied=True)
    opt = torch.optim.AdamW(tied.parameters())
    tied.embed.weight.sum().backward()
    opt.step()
    bytecp.save(str(tmp_path / "ck"), {"model": tied, "optimizer": opt})
    untied = LM(tied=False)
    before = {k: v.clone() for k, v in untied.state_dict().items()}
    with pytest.raises(bytecp.StateMismatchError) as e:
        bytecp.load(str(tmp_path / "ck"), {"model": untied, "optimizer": torch.optim.AdamW(untied.parameters())})
    assert all(torch.equal(v, before[k]) for k, v in untied.state_dict().items())  # nothing was read into it
    msg = str(e.value)
    assert "\n" not in msg and "the optimizer's holds head.weight, the checkpoint's does not" in msg, msg
    assert "the checkpoint's holds" not in msg and "exclude=['optimizer']" in msg, msg


def test_a_plain_data_loader_in_the_state_points_to_the_stateful_one(tmp_path: Path) -> None:
    """A torch DataLoader keeps no position: the advice was allow_pickle=True,
    which loads a new loader that starts the epoch over (samples repeated
    without a word); it names torchdata's StatefulDataLoader now."""
    loader = torch.utils.data.DataLoader(list(range(16)), batch_size=4, collate_fn=lambda b: b)  # (unpicklable)
    with pytest.raises(bytecp.ConfigError) as e:
        bytecp.save(str(tmp_path / "ck"), {"extra": {"dataloader": loader}})
    msg = str(e.value)
    assert "\n" not in msg and "'extra.dataloader' is a torch DataLoader" in msg, msg
    assert "StatefulDataLoader" in msg and "starts the epoch over" in msg, msg


def test_a_generator_in_the_state_is_refused_saying_to_store_its_state(tmp_path: Path) -> None:
    """A torch.Generator unpickles only with allow_pickle, and loaded so it
    would be a new object (the DataLoader holding the user's keeps its old
    state): the error says to store ``get_state()`` and ``set_state()`` it back."""
    g = torch.Generator().manual_seed(7)
    with pytest.raises(bytecp.ConfigError, match=r"'extra.gen' is a Generator.*gen.get_state\(\).*set_state\(\)"):
        bytecp.save(str(tmp_path / "ck"), {"extra": {"gen": g}})
    state = {"extra": {"gen": g.get_state()}}
    bytecp.save(str(tmp_path / "ck"), state)
    torch.randn(3, generator=g)
    again = {"extra": {"gen": torch.zeros_like(state["extra"]["gen"])}}
    bytecp.load(str(tmp_path / "ck"), again)
    g.set_state(again["extra"]["gen"])
    assert torch.equal(torch.randn(3, generator=g), torch.randn(3, generator=torch.Generator().manual_seed(7)))


def test_an_exclude_name_that_matches_nothing_is_warned_of(tmp_path: Path) -> None:
    m = nn.Linear(4, 4)
    opt = torch.optim.AdamW(m.parameters())
    bytecp.save(str(tmp_path / "ck"), {"model": m, "optimizer": opt})
    with pytest.warns(UserWarning, match=r"exclude='optimzer' names nothing .*did you mean 'optimizer'\?"):
        bytecp.load(str(tmp_path / "ck"), {"model": m, "optimizer": opt}, exclude=["optimzer"])
    import warnings

    bytecp.save(str(tmp_path / "model-only"), {"model": m})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # names that match, or name what this load has none of: silent
        bytecp.load(str(tmp_path / "ck"), {"model": m, "optimizer": opt}, exclude=["optimizer"])
        bytecp.load(str(tmp_path / "ck"), {"model": m}, exclude=["model.bias"], strict=False)
        bytecp.load(str(tmp_path / "model-only"), {"model": m, "optimizer": opt}, exclude=["optimizer"])
        bytecp.load(str(tmp_path / "model-only"), {"model": m}, exclude=["rng_state", "optimizer"])


def test_overwrite_refused_then_allowed_and_failed_overwrite_keeps_old(tmp_path: Path, monkeypatch) -> None:
    ck = tmp_path / "ck"
    first = small_state(1)
    bytecp.save(str(ck), first)
    with pytest.raises(bytecp.CheckpointExistsError, match="overwrite=True"):
        bytecp.save(str(ck), small_state(2))
    # a save that fails half-way (after writing data) leaves the old checkpoint intact
    monkeypatch.setenv("BYTECP_FAULT_ERROR", "commit:0")
    with pytest.raises(RuntimeError, match="injected failure"):
        bytecp.save(str(ck), small_state(3), overwrite=True)
    monkeypatch.delenv("BYTECP_FAULT_ERROR")
    sd = bytecp.load_state_dict(str(ck))
    assert same_bits(sd["model"]["weight"], first["model"].weight.detach()) and sd["extra"]["step"] == 1
    assert cli(["verify", str(ck)]) == 0
    # the failed save's files were removed; only the committed save's remain
    saves = {p.name for p in (ck / "data").iterdir()}
    assert len(saves) == 1
    # a successful overwrite replaces it and removes the old files
    second = small_state(4)
    bytecp.save(str(ck), second, overwrite=True)
    sd = bytecp.load_state_dict(str(ck))
    assert same_bits(sd["model"]["weight"], second["model"].weight.detach()) and sd["extra"]["step"] == 4
    assert len(list((ck / "data").iterdir())) == 1 and {p.name for p in (ck / "data").iterdir()} != saves


def test_other_checkpoints_untouched_by_failed_save(tmp_path: Path, monkeypatch) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    bytecp.save(str(a), small_state(1))
    before = {p: p.read_bytes() for p in a.rglob("*") if p.is_file()}
    monkeypatch.setenv("BYTECP_FAULT_ERROR", "write:0")
    with pytest.raises(RuntimeError):
        bytecp.save(str(b), small_state(2))
    assert not (b / "metadata.json").exists()
    assert {p: p.read_bytes() for p in a.rglob("*") if p.is_file()} == before


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # runs on unpickling
        return (os.system, (f"touch {self.path}",))


@pytest.mark.spawn  # its payload runs `touch` once consent is given
def test_pickle_payload_does_not_run_without_allow_pickle(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    ck = str(tmp_path / "ck")
    with pytest.raises(bytecp.ConfigError, match="allow_pickle=True"):
        bytecp.save(ck, {"x": _Evil(str(marker))})
    bytecp.save(ck, {"x": _Evil(str(marker))}, allow_pickle=True)
    assert not marker.exists()
    with pytest.raises(bytecp.PickleNotAllowedError, match="'x'"):
        bytecp.load_state_dict(ck)
    with pytest.raises(bytecp.PickleNotAllowedError):
        bytecp.load(ck, {"x": None})
    assert not marker.exists()
    # a crafted checkpoint that claims the blob is safe is still loaded safely
    md_path = Path(ck) / "metadata.json"
    md = json.loads(md_path.read_text())
    md["objects"]["x"]["pickle"] = False
    md_path.write_text(json.dumps(md))
    with pytest.raises(bytecp.PickleNotAllowedError):
        bytecp.load_state_dict(ck)
    assert not marker.exists()
    # inspect and verify never unpickle either; verify reports the blob the safe loader refuses
    assert cli(["inspect", ck]) == 0 and cli(["verify", ck]) == 1
    assert not marker.exists()
    # with explicit consent it runs (proving the payload was live)
    md["objects"]["x"]["pickle"] = True
    md_path.write_text(json.dumps(md))
    bytecp.load_state_dict(ck, allow_pickle=True)
    assert marker.exists()


def test_unknown_future_format_version(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    bytecp.save(str(ck), small_state())
    md = json.loads((ck / "metadata.json").read_text())
    md["format_version"] = 99
    (ck / "metadata.json").write_text(json.dumps(md))
    with pytest.raises(bytecp.FormatVersionError) as ei:
        bytecp.load(str(ck), small_state())
    assert "99" in str(ei.value) and f"1..{FORMAT_VERSION}" in str(ei.value)


def test_not_a_dict_and_bad_settings(tmp_path: Path) -> None:
    with pytest.raises(bytecp.ConfigError, match="state must be a dict"):
        bytecp.save(str(tmp_path / "x"), nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(bytecp.ConfigError, match="io_threads"):
        bytecp.save(str(tmp_path / "x"), {}, io_threads=0)


@pytest.mark.spawn
def test_cli_inspect_json_and_console_script(tmp_path: Path) -> None:
    ck = str(tmp_path / "ck")
    bytecp.save(ck, {"model": nn.Linear(4, 3)}, step=7, metadata={"run": "r1"})
    out = subprocess.run(
        [sys.executable, "-m", "bytecp.cli", "inspect", ck, "--json"], capture_output=True, text=True, check=True
    )
    info = json.loads(out.stdout)
    assert info["step"] == 7 and info["framework"] == "plain" and info["world_size"] == 1
    assert info["tensors"]["model.weight"] == {"dtype": "float32", "shape": [3, 4], "nbytes": 48, "chunks": 1}
    assert info["user_metadata"] == {"run": "r1"}
    assert info["totals"]["tensor_bytes"] == 60


def test_failure_after_commit_never_removes_the_committed_checkpoint(tmp_path: Path, monkeypatch) -> None:
    ck = str(tmp_path / "ck")
    state = small_state(5)
    monkeypatch.setenv("BYTECP_FAULT_ERROR", "committed:0")
    with pytest.raises(RuntimeError, match="injected"):
        bytecp.save(ck, state)
    monkeypatch.delenv("BYTECP_FAULT_ERROR")
    sd = bytecp.load_state_dict(ck)  # committed, so intact
    assert same_bits(sd["model"]["weight"], state["model"].weight.detach())
    assert cli(["verify", ck]) == 0


def test_overlapping_or_missing_shards_are_refused() -> None:
    from bytecp.plan.planner import LocalSavePlan, WriteItem, plan_save
    from bytecp.tree.regions import Region

    def item(o: int, n: int) -> WriteItem:
        return WriteItem("w", Region((o, 0), (n, 4)), "float32", 4, (10, 4))

    ok = plan_save([LocalSavePlan(0, (item(0, 5),)), LocalSavePlan(1, (item(5, 5),))])
    assert [len(x) for x in ok] == [1, 1]
    # same element count, but rows 4..5 twice and row 9 never
    with pytest.raises(bytecp.ConfigError, match="overlap"):
        plan_save([LocalSavePlan(0, (item(0, 6),)), LocalSavePlan(1, (item(4, 5),))])
    with pytest.raises(bytecp.ConfigError, match="hold 36 of its 40"):
        plan_save([LocalSavePlan(0, (item(0, 5),)), LocalSavePlan(1, (item(6, 4),))])


def test_index_whose_chunks_overlap_is_corrupt(tmp_path: Path) -> None:
    from .index_tools import index_rows, rewrite_index

    ck = tmp_path / "ck"
    bytecp.save(str(ck), {"w": torch.arange(20.0).reshape(10, 2)}, io_threads=1)
    cols = index_rows(ck).to_pydict()
    for k in cols:  # one more row: the same chunk claimed again at rows 0..4
        cols[k].append(cols[k][0])
    cols["lengths"][-1] = [5, 2]
    cols["nbytes"][-1] = 40
    rewrite_index(ck, cols)
    with pytest.raises(bytecp.CorruptCheckpointError, match="overlap"):
        bytecp.load_state_dict(str(ck))


def test_index_rows_in_the_wrong_band_segment_are_corrupt(tmp_path: Path) -> None:
    """FORMAT.md §5.4: a band segment lists only chunks that meet its band.
    The two band segments' bytes swapped in the directory (each entry still
    names a checksummed segment) put rows in the wrong band: refused, not
    loaded from whichever segments a rank happens to read."""
    import shutil

    src = Path(__file__).parents[1] / "golden" / "v2" / "banded" / "checkpoint"
    ck = tmp_path / "ck"
    shutil.copytree(src, ck)
    assert bytecp.load_state_dict(str(ck))  # as shipped: loads
    md = json.loads((ck / "metadata.json").read_text())
    band = md["index"]["band"]
    assert band["bucket"] == [0, 1]
    for col in ("offset", "nbytes", "rows", "crc32c"):
        band[col] = band[col][::-1]
    (ck / "metadata.json").write_text(json.dumps(md))
    with pytest.raises(bytecp.CorruptCheckpointError, match=r"does not belong in band"):
        bytecp.load_state_dict(str(ck))


def test_a_timed_out_version_2_index_read_is_not_called_corrupt(monkeypatch: pytest.MonkeyPatch) -> None:
    """A version-2 index read that times out (or loses its connection) reaches
    the caller as the transient storage error it is, to be retried; a
    missing or short index file is still a corrupt one."""
    from bytecp.errors import TransientStorageError
    from bytecp.format import index_read
    from bytecp.loading.opened import open_checkpoint

    opened = open_checkpoint(str(Path(__file__).parents[1] / "golden" / "v2" / "banded" / "checkpoint"))
    st, md = opened.storage, opened.metadata
    segments = index_read.all_segments(md)

    def hung(path: str, ranges: Any) -> None:
        raise TransientStorageError(f"{path} (read_ranges): no answer within 0.3 s")

    def short(path: str, ranges: Any) -> None:
        raise FileNotFoundError(path)

    monkeypatch.setattr(st, "read_ranges", hung)
    with pytest.raises(TransientStorageError, match="no answer"):
        index_read.read_segments(st, md, segments)
    monkeypatch.setattr(st, "read_ranges", short)
    with pytest.raises(bytecp.CorruptCheckpointError, match="missing or short"):
        index_read.read_segments(st, md, segments)
