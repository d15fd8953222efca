"""Golden checkpoints of every released format version keep loading, bitwise.

Each ``v<N>/<case>/`` holds a checkpoint written by the bytecp of that format
version and an ``expected.json`` written without bytecp (see make_golden.py).
The tests load every case with ``bytecp.load_state_dict`` and ``bytecp.load``,
run ``bytecp verify`` and ``bytecp inspect --json`` on it, and read it a
second time with the small reader below, which follows docs/FORMAT.md using
only json, pyarrow, crc32c, numpy and torch -- so the spec alone is enough to
read a checkpoint. The golden files are only ever read (a checksum test
notices any change); anything that must be altered is copied first.
"""

from __future__ import annotations

import fractions
import hashlib
import io
import json
import math
import random
import shutil
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
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
    md = json.loads((case / "checkpoint" / "metadata.json").read_text())
    names = {info["dtype"] for info in md["tensors"].values()}
    lacking = sorted(n for n in names if not isinstance(getattr(torch, n, None), torch.dtype))
    if lacking:
        pytest.xfail(f"torch {torch.__version__} lacks dtypes {lacking}")


# ----------------------------------------------------------------- expected values
def make_tensor(d: dict[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, d["dtype"])
    raw = bytes.fromhex(d["hex"])
    if not raw:
        return torch.empty(d["shape"], dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(d["shape"])


def decode(v: Any) -> Any:
    """The inverse of make_golden.encode."""
    if isinstance(v, list):
        return [decode(x) for x in v]
    if isinstance(v, dict):
        ((tag, body),) = v.items()
        if tag == "__tensor__":
            return make_tensor(body)
        if tag == "__dict__":
            return {k: decode(x) for k, x in body}
        if tag == "__tuple__":
            return tuple(decode(x) for x in body)
        if tag == "__float__":
            return float(body)
        if tag == "__fraction__":
            return fractions.Fraction(*body)
        raise AssertionError(f"unknown tag {tag!r} in expected.json")
    return v


def raw_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    return b"" if t.numel() == 0 else t.reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(got: Any, want: Any, where: str = "state") -> None:
    """Exact equality: types, dict keys, tensor dtype, shape and bits."""
    assert type(got) is type(want) or (
        isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)
    ), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), (
            f"{where}: {got.dtype} {tuple(got.shape)} != {want.dtype} {tuple(want.shape)}"
        )
        assert raw_bytes(got) == raw_bytes(want), f"{where}: bits differ"
    elif isinstance(want, dict):
        assert list(got) == list(want) or set(got) == set(want), (
            f"{where}: keys {list(got)} != {list(want)}"
        )
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{where}.{i}")
    elif isinstance(want, float) and math.isnan(want):
        assert math.isnan(got), where
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


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


class Tiny(nn.Module):
    """The model of the framework goldens (make_golden.Tiny)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(5, 3)
        self.norm = nn.LayerNorm(3)
        self.l2 = nn.Linear(3, 2)


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


def _load_worker(rank: int, world: int, init_file: str, case_dirs: list[str]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for case_dir in case_dirs:
            case = Path(case_dir)
            _load_as_plain(case, rank)
            if expected(case)["inspect"]["framework"] in ("ddp", "fsdp1", "fsdp2"):
                _load_as_fsdp2(case, world)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_multi_rank_goldens_load_on_3_ranks(tmp_path: Path) -> None:
    """Every multi-rank golden loads on 3 gloo ranks: into full tensors (per-rank
    values from saved rank r % W) and, for DDP/FSDP1/FSDP2 goldens, resharded
    into an FSDP2 model and optimizer."""
    import torch.multiprocessing as mp

    cases = [str(c) for c in CASES if expected(c)["inspect"]["world_size"] > 1]
    assert cases
    mp.spawn(_load_worker, args=(3, str(tmp_path / "init"), cases), nprocs=3, join=True)


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


# ----------------------------------------------------------------- a reader from the spec alone
INDEX_TYPES = {
    "fqn": pa.string(),
    "offsets": pa.list_(pa.int64()),
    "lengths": pa.list_(pa.int64()),
    "file": pa.string(),
    "byte_offset": pa.int64(),
    "nbytes": pa.int64(),
    "crc32c": pa.uint32(),
}
V1_TYPES = {"dtype": pa.string(), "global_shape": pa.list_(pa.int64())}


def spec_index_rows(root: Path, md: dict[str, Any]) -> list[dict[str, Any]]:
    """Every chunk row, each once: version 1's index files (§5.5) or version
    2's segments found through the directory (§5.3, §5.4)."""
    if md["format_version"] == 1:
        tables = [pq.ParquetFile(root / f).read(use_threads=False) for f in md["index_files"]]
        types = INDEX_TYPES | V1_TYPES
    else:
        assert md["index_files"] == []
        d = md["index"]
        raw = (root / d["file"]).read_bytes()
        assert len(raw) == d["nbytes"]
        tables, spans = [], []
        for col in (d["band"], d["wide"]):
            for off, n, rows, crc in zip(col["offset"], col["nbytes"], col["rows"], col["crc32c"], strict=True):
                seg = raw[off : off + n]
                assert seg[:4] == seg[-4:] == b"PAR1" and crc32c.crc32c(seg) == crc
                tables.append(pq.ParquetFile(io.BytesIO(seg)).read(use_threads=False))
                assert tables[-1].num_rows == rows
                spans.append((off, n))
        spans.sort()
        assert [o for o, _ in spans] == [0, *[o + n for o, n in spans[:-1]]] and sum(n for _, n in spans) == len(raw)
        assert d["band"]["bucket"] == sorted(set(d["band"]["bucket"]))
        types = INDEX_TYPES
    rows, seen = [], set()
    for table in tables:
        # version 3 keeps version 2's index: its segments say "2"
        assert table.schema.metadata[b"bytecp.format_version"] == str(min(md["format_version"], 2)).encode()
        for name, typ in types.items():
            got = table.schema.field(name).type
            assert (got.value_type if pa.types.is_dictionary(got) else got) == typ, name
        for row in table.to_pylist():
            key = json.dumps(row, sort_keys=True)
            if key not in seen:  # version 2 lists a chunk in each band it meets
                seen.add(key)
                rows.append(row)
    if md["format_version"] >= 2:  # each chunk is in the segments its box names (§5.4)
        d = md["index"]
        for row in rows:
            info = md["tensors"][row["fqn"]]
            assert math.prod(row["lengths"]) > 0
            if "band_dim" in info:
                k, size = info["band_dim"], info["shape"][info["band_dim"]]
                o, n = row["offsets"][k], row["lengths"][k]
                for b in range(o * d["buckets"] // size, (o + n - 1) * d["buckets"] // size + 1):
                    assert b in d["band"]["bucket"], (row["fqn"], b)
            else:
                assert any(f <= row["fqn"] <= la for f, la in zip(d["wide"]["first"], d["wide"]["last"], strict=True))
    return rows


def spec_read(root: Path, *, allow_pickle: bool = False) -> Any:
    """Read a format-v1, v2 or v3 checkpoint following docs/FORMAT.md, without bytecp.
    Version 3's references (``../<checkpoint>/data/...``) are read from the
    sibling checkpoint, which must be committed and hold that save."""
    md = json.loads((root / "metadata.json").read_bytes())
    assert md["format"] == "bytecp" and md["format_version"] in (1, 2, 3)
    for name, save_id in md.get("references", {}).items():
        assert md["format_version"] >= 3 and "/" not in name and name not in (".", "..")
        base = root.parent / name
        meta = base / "metadata.json" if (base / "metadata.json").exists() else base / "base.json"
        assert json.loads(meta.read_bytes())["save_id"] == save_id
    for f, size in md["data_files"].items():
        if f.startswith("../"):
            assert f.split("/")[1] in md["references"] and f.split("/")[3] == md["references"][f.split("/")[1]]
        assert (root / f).stat().st_size == size, f
        assert size % ALIGNMENT == 0, f"{f}: the writer pads every chunk, the last one too"
    data = {f: (root / f).read_bytes() for f in md["data_files"]}

    def itemsize(name: str) -> int:
        return torch.empty((), dtype=getattr(torch, name)).element_size()

    out: dict[str, bytearray] = {}
    seen: dict[str, np.ndarray] = {}
    for fqn, info in md["tensors"].items():
        out[fqn] = bytearray(math.prod(info["shape"]) * itemsize(info["dtype"]))
        seen[fqn] = np.zeros(info["shape"], dtype=np.int8)
    used: dict[str, list[tuple[int, int]]] = {f: [] for f in data}
    for row in spec_index_rows(root, md):
        info = md["tensors"][row["fqn"]]
        if md["format_version"] == 1:
            assert row["dtype"] == info["dtype"] and row["global_shape"] == info["shape"]
        offs, lens = row["offsets"], row["lengths"]
        assert len(offs) == len(lens) == len(info["shape"])
        size = itemsize(info["dtype"])
        assert row["nbytes"] == math.prod(lens) * size
        assert row["byte_offset"] % ALIGNMENT == 0
        blob = data[row["file"]][row["byte_offset"] : row["byte_offset"] + row["nbytes"]]
        assert len(blob) == row["nbytes"] and crc32c.crc32c(blob) == row["crc32c"]
        used[row["file"]].append((row["byte_offset"], row["nbytes"]))
        box = tuple(slice(o, o + n) for o, n in zip(offs, lens, strict=True))
        whole = np.frombuffer(out[row["fqn"]], dtype=np.uint8).reshape(*info["shape"], size)
        whole[box] = np.frombuffer(blob, dtype=np.uint8).reshape(*lens, size)
        seen[row["fqn"]][box] += 1
    for fqn, s in seen.items():
        assert (s == 1).all(), f"{fqn}: chunks do not cover it exactly once"

    def read_object(rec: dict[str, Any]) -> Any:
        if "json" in rec:
            return rec["json"]
        blob = data[rec["file"]][rec["byte_offset"] : rec["byte_offset"] + rec["nbytes"]]
        assert rec["byte_offset"] % ALIGNMENT == 0 and crc32c.crc32c(blob) == rec["crc32c"]
        used[rec["file"]].append((rec["byte_offset"], rec["nbytes"]))
        if rec["pickle"] and not allow_pickle:
            raise PermissionError("needs allow_pickle")
        return torch.load(io.BytesIO(blob), weights_only=not rec["pickle"])

    objects = {k: read_object(r) for k, r in md["objects"].items()}
    per_rank = {
        k: {int(r): read_object(rec) for r, rec in v.items()} for k, v in md["per_rank"].items()
    }
    # everything between the stored items is zero padding
    for f, spans in used.items():
        if f.startswith("../"):
            continue  # a referenced file holds boxes of the base that this checkpoint does not read
        buf = data[f]
        spans.sort()
        pos = 0
        for off, n in spans:
            assert off >= pos and not any(buf[pos:off]), f"{f}: non-zero bytes at {pos}..{off}"
            pos = off + n
        assert not any(buf[pos:]), f"{f}: non-zero bytes after the last item"

    def tensor(fqn: str) -> torch.Tensor:
        info = md["tensors"][fqn]
        dtype = getattr(torch, info["dtype"])
        if not out[fqn]:
            return torch.empty(info["shape"], dtype=dtype)
        return torch.frombuffer(out[fqn], dtype=torch.uint8).view(dtype).reshape(info["shape"])

    def build(node: dict[str, Any]) -> Any:
        ((kind, body),) = node.items()
        if kind == "d":
            return {k: build(child) for k, child in body}
        if kind == "l":
            return [build(child) for child in body]
        if kind == "t":
            return tuple(build(child) for child in body)
        if kind == "tensor":  # an alias reads the tensor it names (FORMAT.md §6.6)
            return tensor(md.get("aliases", {}).get(body, body))
        if kind == "obj":
            return objects[body]
        if kind == "rank":
            return per_rank[body][0]
        raise AssertionError(f"unknown skeleton node {node!r}")

    return build(md["skeleton"]), per_rank


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


# ----------------------------------------------------------------- every write path follows the spec
def _fresh_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    state: dict[str, Any] = {
        "a": torch.randn(300, 7, generator=g),  # larger than one batch of the small budget below
        "b": torch.randint(0, 9, (5, 0), generator=g),
        "c": torch.randn(4, 6, generator=g).t(),
        "c_tied": None,  # the same tensor as "c": stored once, as an alias
        "s": torch.tensor(2.5, dtype=torch.bfloat16),
        "extra": {"step": 3, "pair": (1, "x"), "inf": float("-inf")},
    }
    state["c_tied"] = state["c"]
    return state


@pytest.mark.parametrize(
    "how",
    ["save", "async_save", "async_save_batched", "async_save_lazy"],
)
def test_fresh_checkpoints_follow_the_spec(tmp_path: Path, how: str) -> None:
    """What today's writers produce, read with the spec reader, equals the state saved."""
    state = _fresh_state()
    url = str(tmp_path / "ck")
    if how == "save":
        bytecp.save(url, state)
    else:
        budget = 4096 if how == "async_save_batched" else None
        handle = bytecp.async_save(
            url, state, lazy=how.endswith("lazy"), memory_budget_bytes=budget
        )
        handle.wait()
    got, per_rank = spec_read(tmp_path / "ck")
    assert per_rank == {}
    assert_same(got, state)
    assert json.loads((tmp_path / "ck" / "metadata.json").read_text())["aliases"] == {"c_tied": "c"}
