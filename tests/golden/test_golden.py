"""Golden checkpoints of every released format version keep loading, bitwise.

Each ``v<N>/<case>/`` holds a checkpoint written by the bytecp of that format
version and an ``expected.json`` written without bytecp (see make_golden.py).
The tests load every case with ``bytecp.load_state_dict`` and ``bytecp.load``,
run ``bytecp verify`` and ``bytecp inspect --json`` on it, and read it a
second time with the reader of spec_reader.py, which follows docs/FORMAT.md using
only json, pyarrow, crc32c, numpy and torch -- so the spec alone is enough to
read a checkpoint. The golden files are only ever read (a checksum test
notices any change); anything that must be altered is copied first.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from golden_dist import Tiny  # the model of the framework goldens
from golden_encoding import assert_same, decode, raw_bytes
from spec_reader import spec_metadata, spec_read
from torch import nn

import bytecp
from bytecp.cli import main as cli
from bytecp.format.metadata import FORMAT_VERSION

HERE = Path(__file__).resolve().parent
CASES = sorted(p.parent for p in HERE.glob("v*/*/expected.json"))
IDS = [c.relative_to(HERE).as_posix() for c in CASES]
ALIGNMENT = 4096
pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")


def cases_where(pred: Any) -> Any:
    """``parametrize`` over the cases for which ``pred(case)`` holds."""
    chosen = [c for c in CASES if pred(c)]
    return pytest.mark.parametrize(
        "case", chosen, ids=[c.relative_to(HERE).as_posix() for c in chosen]
    )


def expected(case: Path) -> dict[str, Any]:
    return json.loads((case / "expected.json").read_text())


def ckpt(case: Path) -> str:
    return str(case / "checkpoint")


def needs_dtypes(case: Path) -> None:
    """A golden file needing a dtype this torch lacks is a real gap, said out loud."""
    md = spec_metadata((case / "checkpoint" / "metadata.json").read_bytes())
    names = {info["dtype"] for info in md["tensors"].values()}
    lacking = sorted(n for n in names if not isinstance(getattr(torch, n, None), torch.dtype))
    if lacking:
        pytest.xfail(f"torch {torch.__version__} lacks dtypes {lacking}")


@pytest.fixture
def keep_rng():
    """Loading an RNGState sets this process's generators; put them back."""
    states = torch.get_rng_state(), np.random.get_state(), random.getstate()
    yield
    torch.set_rng_state(states[0])
    np.random.set_state(states[1])
    random.setstate(states[2])


# ----------------------------------------------------------------- the goldens exist
def test_golden_cases_present() -> None:
    want = {"plain", "dtypes", "irregular", "pickle", "two_ranks", "ddp", "fsdp1", "fsdp2"}
    assert {f"v1/{c}" for c in want} <= set(IDS)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_golden_files_unchanged(case: Path) -> None:
    """Golden files are never rewritten: every file matches its recorded sha256."""
    root = case / "checkpoint"
    got = {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }
    assert got == expected(case)["files"]
    base = {  # version 3: the checkpoints it references, beside it
        p.relative_to(case).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(case.rglob("*"))
        if p.is_file() and p.relative_to(case).parts[0] not in ("checkpoint", "expected.json")
    }
    assert base == expected(case).get("base_files", {})


# ----------------------------------------------------------------- bytecp reads them
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_load_state_dict_bitwise(case: Path) -> None:
    needs_dtypes(case)
    exp = expected(case)
    if _saved_per_rank(case) and exp["inspect"]["world_size"] != 1:
        with pytest.warns(UserWarning, match="rank 0 restores the per-rank state of saved rank 0"):
            sd = bytecp.load_state_dict(ckpt(case), **exp["load_options"])
    else:
        sd = bytecp.load_state_dict(ckpt(case), **exp["load_options"])
    assert_same(sd, decode(exp["state"]))


class _Holder:
    """A ``Stateful`` that keeps what it is loaded with."""

    value: Any = None

    def state_dict(self) -> Any:
        return self.value

    def load_state_dict(self, sd: Any) -> None:
        self.value = sd


def _blank(v: Any, fqn: str, per_rank: set[str]) -> Any:
    """A load target shaped like ``v``: tensors filled with 0xA5 bytes, per-rank
    values as a ``PerRankState``, other values None (replaced by the load)."""
    if fqn in per_rank:
        return bytecp.PerRankState(_Holder())
    if isinstance(v, torch.Tensor):
        t = torch.empty(v.shape, dtype=v.dtype)
        if t.numel():
            t.reshape(-1).view(torch.uint8).fill_(0xA5)
        return t
    if type(v) is dict:
        return {k: _blank(x, f"{fqn}.{k}" if fqn else str(k), per_rank) for k, x in v.items()}
    return None


def _unwrap(v: Any) -> Any:
    if isinstance(v, bytecp.PerRankState):
        return v.obj.value
    if type(v) is dict:
        return {k: _unwrap(x) for k, x in v.items()}
    return v


def _saved_per_rank(case: Path) -> dict[str, Any]:
    return json.loads((case / "checkpoint" / "metadata.json").read_text()).get("per_rank", {})


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_load_in_place_bitwise(case: Path) -> None:
    """Every tensor is filled where it lives; every value is replaced from the checkpoint."""
    needs_dtypes(case)
    exp = expected(case)
    want = decode(exp["state"])
    target = _blank(want, "", set(_saved_per_rank(case)))
    tensors = {k: v for k, v in target.items() if isinstance(v, torch.Tensor)}
    if _saved_per_rank(case) and exp["inspect"]["world_size"] != 1:
        with pytest.warns(UserWarning, match="saved by"):
            res = bytecp.load(ckpt(case), target, **exp["load_options"])
    else:
        res = bytecp.load(ckpt(case), target, **exp["load_options"])
    assert res.missing_keys == [] and res.unexpected_keys == []
    for k, t in tensors.items():
        assert target[k] is t, f"{k}: not filled in place"
    assert_same(_unwrap(target), want)


def _with_rank_values(v: Any, fqn: str, values: dict[str, Any]) -> Any:
    """``v`` with each per-rank position replaced by ``values[fqn]``."""
    if fqn in values:
        return values[fqn]
    if type(v) is dict:
        return {
            k: _with_rank_values(x, f"{fqn}.{k}" if fqn else str(k), values) for k, x in v.items()
        }
    return v


def _load_as_plain(case: Path, rank: int) -> None:
    """Into full tensors on every rank; per-rank values come from saved rank r % W."""
    exp = expected(case)
    want = decode(exp["state"])
    target = _blank(want, "", set(_saved_per_rank(case)))
    if exp["per_rank"]:
        with pytest.warns(UserWarning, match=f"rank {rank} restores the per-rank state"):
            bytecp.load(ckpt(case), target, **exp["load_options"])
    else:
        bytecp.load(ckpt(case), target, **exp["load_options"])
    saved = exp["inspect"]["world_size"]
    mine = {fqn: decode(v[str(rank % saved)]) for fqn, v in exp["per_rank"].items()}
    assert_same(_unwrap(target), _with_rank_values(want, "", mine), f"{case.name} on rank {rank}")


def _load_as_fsdp2(case: Path, world: int) -> None:
    """Into an FSDP2 model and AdamW sharded over ``world`` ranks, then compare
    the full tensors (DTensor.full_tensor) with the expected ones."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    want = decode(expected(case)["state"])
    model = Tiny()
    mesh = init_device_mesh("cpu", (world,))
    for m in (model.l1, model.l2):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    extra = {"step": 0}
    bytecp.load(ckpt(case), {"model": model, "optimizer": opt, "extra": extra})

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    names = {id(p): n for n, p in model.named_parameters()}
    assert_same(
        {n: full(p.detach()) for n, p in model.named_parameters()}, want["model"], case.name
    )
    got_state = {names[id(p)]: {k: full(v) for k, v in st.items()} for p, st in opt.state.items()}
    assert_same(got_state, want["optimizer"]["state"], f"{case.name} optimizer")
    assert opt.param_groups[0]["lr"] == want["optimizer"]["param_groups"][0]["lr"]
    assert extra == want["extra"]


def _load_cases(case_dirs: list[str]) -> None:
    """On every rank of a pool (tests/dist/pool.py): each case into full tensors, and
    resharded into FSDP2 where it was saved by DDP, FSDP1 or FSDP2."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    for case_dir in case_dirs:
        case = Path(case_dir)
        _load_as_plain(case, rank)
        if expected(case)["inspect"]["framework"] in ("ddp", "fsdp1", "fsdp2"):
            _load_as_fsdp2(case, world)


@pytest.mark.slow
@pytest.mark.spawn
def test_multi_rank_goldens_load_on_3_ranks() -> None:
    """Every multi-rank golden loads on 3 gloo ranks: into full tensors (per-rank
    values from saved rank r % W) and, for DDP/FSDP1/FSDP2 goldens, resharded
    into an FSDP2 model and optimizer. The ranks are forked from the pool's fork
    server (torch and bytecp imported once), not started as fresh interpreters."""
    from dist.pool import WorkerPool

    cases = [str(c) for c in CASES if expected(c)["inspect"]["world_size"] > 1]
    assert cases
    pool = WorkerPool(3)
    try:
        pool.run(_load_cases, cases, timeout=300)
    finally:
        pool.close()


@cases_where(lambda c: c.name == "plain")
def test_load_model_optimizer_rng_in_place(case: Path, keep_rng: None) -> None:
    want = decode(expected(case)["state"])
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    extra: dict[str, Any] = {k: None for k in want["extra"]}
    extra["counts"] = torch.zeros(5, dtype=torch.int32)
    extra["rng"] = bytecp.RNGState()
    torch.manual_seed(0)
    bytecp.load(ckpt(case), {"model": model, "optimizer": opt, "extra": extra})

    assert_same(dict(model.state_dict()), want["model"], "model")
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in opt.param_groups for p in g["params"]]
    osd = opt.state_dict()
    assert_same(
        {names[id(params[i])]: dict(st) for i, st in osd["state"].items()},
        want["optimizer"]["state"],
    )
    for got, saved in zip(osd["param_groups"], want["optimizer"]["param_groups"], strict=True):
        assert [names[id(params[i])] for i in got["params"]] == saved["params"]
        for k, v in saved.items():
            if k != "params":
                assert_same(got[k], v, f"param_groups.{k}")
    assert_same(
        {k: v for k, v in extra.items() if k != "rng"},
        {k: v for k, v in want["extra"].items() if k != "rng"},
        "extra",
    )
    rng = want["extra"]["rng"]
    assert raw_bytes(torch.get_rng_state()) == raw_bytes(rng["torch"])
    np_state = np.random.get_state()
    assert np_state[0] == rng["numpy"]["kind"] and np_state[2] == rng["numpy"]["pos"]
    assert np.array_equal(
        np.asarray(np_state[1], dtype=np.uint32).view(np.int32), rng["numpy"]["keys"].numpy()
    )
    assert list(random.getstate()[1]) == rng["python"][1]


@cases_where(lambda c: expected(c)["load_options"].get("allow_pickle"))
def test_pickle_blob_needs_allow_pickle(case: Path) -> None:
    with pytest.raises(bytecp.PickleNotAllowedError):
        bytecp.load_state_dict(ckpt(case))


# ----------------------------------------------------------------- CLI
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_verify(case: Path, capsys: pytest.CaptureFixture[str]) -> None:
    needs_dtypes(case)
    assert cli(["verify", ckpt(case)]) == 0
    assert "OK" in capsys.readouterr().out


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_inspect_json(case: Path, capsys: pytest.CaptureFixture[str]) -> None:
    needs_dtypes(case)
    assert cli(["inspect", "--json", ckpt(case)]) == 0
    info = json.loads(capsys.readouterr().out)
    want = expected(case)["inspect"]
    for key, value in want.items():
        if key == "totals":
            for k, v in value.items():
                assert info["totals"][k] == v, f"totals.{k}"
        else:
            assert info[key] == value, key
    assert set(info["totals"]["bytes_written_per_rank"]) <= {
        str(r) for r in range(want["world_size"])
    }


# ----------------------------------------------------------------- versioning
def test_newer_format_version_is_refused(tmp_path: Path) -> None:
    src = HERE / "v1" / "dtypes" / "checkpoint"
    dst = tmp_path / "ck"
    shutil.copytree(src, dst)
    md = json.loads((dst / "metadata.json").read_text())
    md["format_version"] = FORMAT_VERSION + 1
    (dst / "metadata.json").write_text(json.dumps(md))
    with pytest.raises(bytecp.FormatVersionError) as e:
        bytecp.load_state_dict(str(dst))
    assert f"version {FORMAT_VERSION + 1} " in str(e.value) and f"1..{FORMAT_VERSION}" in str(e.value)


def test_directory_without_metadata_is_not_a_checkpoint(tmp_path: Path) -> None:
    dst = tmp_path / "ck"
    shutil.copytree(HERE / "v1" / "dtypes" / "checkpoint", dst)
    (dst / "metadata.json").unlink()
    with pytest.raises(bytecp.IncompleteCheckpointError):
        bytecp.load_state_dict(str(dst))

@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_spec_reader_reads_golden(case: Path) -> None:
    needs_dtypes(case)
    exp = expected(case)
    got, per_rank = spec_read(
        case / "checkpoint", allow_pickle=bool(exp["load_options"].get("allow_pickle"))
    )
    assert_same(got, decode(exp["state"]))
    for fqn, values in exp.get("per_rank", {}).items():
        assert_same(per_rank[fqn], {int(r): decode(v) for r, v in values.items()}, fqn)
    if exp["load_options"].get("allow_pickle"):
        with pytest.raises(PermissionError):
            spec_read(case / "checkpoint")


# ----------------------------------------------------------------- known gaps (docs/FORMAT.md)
def _tampered(tmp_path: Path, edit: Any) -> Path:
    """A copy of the irregular golden whose metadata.json ``edit`` changed."""
    dst = tmp_path / "ck"
    shutil.copytree(HERE / "v1" / "irregular" / "checkpoint", dst)
    md = json.loads((dst / "metadata.json").read_text())
    edit(md)
    (dst / "metadata.json").write_text(json.dumps(md))
    return dst


def test_overwrite_never_deletes_outside_the_checkpoint(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    dst = _tampered(tmp_path, lambda md: md["data_files"].update({"../victim.txt": 7}))
    try:
        bytecp.save(str(dst), {"x": torch.zeros(2)}, overwrite=True)
    except bytecp.BytecpError:
        pass
    assert victim.exists()


def _retype_index(dst: Path, column: str, fn: Any) -> None:
    for f in (dst / "index").rglob("*.parquet"):
        table = pq.ParquetFile(f).read(use_threads=False)
        cols = table.to_pydict()
        cols[column] = [fn(v) for v in cols[column]]
        pq.write_table(pa.table(cols, schema=table.schema), f)


@pytest.mark.parametrize(
    "column, fn",
    [("dtype", lambda d: "int16" if d == "bfloat16" else d), ("nbytes", lambda n: n + 2)],
    ids=["dtype", "nbytes"],
)
def test_inconsistent_index_row_is_corrupt(tmp_path: Path, column: str, fn: Any) -> None:
    dst = _tampered(tmp_path, lambda md: None)
    _retype_index(dst, column, fn)
    with pytest.raises(bytecp.CorruptCheckpointError):
        bytecp.load_state_dict(str(dst))
