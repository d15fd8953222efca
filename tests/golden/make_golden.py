"""Write the golden checkpoints of the current format version (run once per version).

    python tests/golden/make_golden.py                # every case not yet written
    python tests/golden/make_golden.py --only dtypes  # one case

Each case is a directory ``tests/golden/v<N>/<case>/`` holding

- ``checkpoint/``: a checkpoint exactly as ``bytecp.save`` wrote it;
- ``expected.json``: what loading it must give, written without bytecp
  (tensors as dtype name, shape and the hex of their little-endian row-major
  bytes), the fields ``bytecp inspect --json`` must report, and the sha256 of
  every checkpoint file (so a regenerated golden file is noticed).

Golden files of a released format version are never regenerated: this script
refuses to touch a case directory that exists. A new format version gets a
new ``v<N>/`` directory next to the old ones, which keep loading.
"""

from __future__ import annotations

import argparse
import fractions
import hashlib
import json
import math
import os
import random
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from golden_dist import _framework_case, case_parts, case_two_ranks
from golden_encoding import canonical, encode, pattern
from spec_reader import read_segment as spec_segment
from spec_reader import spec_metadata
from torch import nn

import bytecp
from bytecp.format.metadata import FORMAT_VERSION
from bytecp.tree.dtypes import SUPPORTED_DTYPES
from bytecp.tree.regions import Region
from bytecp.tree.state import Shard, TensorLeaf

HERE = Path(__file__).resolve().parent


# ----------------------------------------------------------------- cases
def case_plain(url: str) -> tuple[Any, dict[str, Any]]:
    """A model, its AdamW optimizer after one step, and extra values."""
    torch.manual_seed(1234)
    np.random.seed(1234)
    random.seed(1234)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    x = torch.linspace(-1.0, 1.0, 8).reshape(2, 4)
    model(x).square().mean().backward()
    opt.step()
    torch.manual_seed(99)  # the RNG states saved below
    np.random.seed(99)
    random.seed(99)
    extra = {
        "step": 7,
        "epoch": 1.5,
        "name": "golden",
        "flags": [True, False, None],
        "nested": {"a": [1, 2.5, "x"], "empty": {}, "none": []},
        "pair": (3, "b", 0.25),
        "by_id": {1: "one", 2: "two"},
        "inf": float("inf"),  # not JSON: stored as a safe torch.save blob
        "counts": torch.arange(5, dtype=torch.int32),
        "rng": bytecp.RNGState(),
    }
    state = {"model": model, "optimizer": opt, "extra": extra}
    rng_now = bytecp.RNGState().state_dict()
    bytecp.save(url, state, step=7, metadata={"run": "golden", "format": FORMAT_VERSION})

    expected, _ = _plain_expected(model, opt)
    expected = {
        **expected,
        "extra": {**{k: v for k, v in extra.items() if k != "rng"}, "rng": rng_now},
    }
    return expected, {
        "framework": "plain",
        "world_size": 1,
        "step": 7,
        "user_metadata": {"run": "golden", "format": FORMAT_VERSION},
    }


def case_dtypes(url: str) -> tuple[Any, dict[str, Any]]:
    """One tensor of every supported dtype, a 0-dim and empty tensors, and views."""
    state: dict[str, Any] = {
        name: pattern((2, 3), dt, i) for i, (name, dt) in enumerate(SUPPORTED_DTYPES.items())
    }
    state["scalar_float64"] = torch.tensor(-0.0, dtype=torch.float64)
    state["scalar_bfloat16"] = pattern((), torch.bfloat16, 5)
    state["scalar_bool"] = torch.tensor(True)
    state["empty_float32"] = torch.empty(0, 3, dtype=torch.float32)
    state["empty_int8"] = torch.empty(4, 0, 2, dtype=torch.int8)
    base = pattern((3, 4), torch.float32, 7)
    state["transposed_float32"] = base.t()  # non-contiguous view
    state["strided_int16"] = pattern((20,), torch.int16, 3)[::3]
    state["narrow_complex64"] = pattern((3, 4), torch.complex64, 9)[1:, 1:3]
    for k in ("transposed_float32", "strided_int16", "narrow_complex64"):
        assert not state[k].is_contiguous(), k
    bytecp.save(url, state, step=0)
    expected = {k: v.clone() for k, v in state.items()}
    return expected, {"framework": "plain", "world_size": 1, "step": 0, "user_metadata": {}}


def _flat_leaf(t: torch.Tensor, cuts: list[int]) -> TensorLeaf:
    """``t`` held as the flat ranges between ``cuts``, as FSDP1/ZeRO shards are."""
    flat = t.reshape(-1)
    bounds = [0, *cuts, flat.numel()]
    shards: list[Shard] = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        shards += TensorLeaf.from_flat(tuple(t.shape), t.dtype, a, flat[a:b]).shards
    return TensorLeaf(tuple(t.shape), t.dtype, shards)


def case_irregular(url: str) -> tuple[Any, dict[str, Any]]:
    """Tensors stored as several boxes: flat ranges cut into row-major boxes, and a 2-d grid."""
    a = pattern((3, 4, 5), torch.float32, 11)
    b = pattern((4, 6), torch.int64, 13)
    grid = [Shard(Region((r, c), (2, 3)), b[r : r + 2, c : c + 3]) for r in (0, 2) for c in (0, 3)]
    state = {
        "flat": _flat_leaf(a, [7, 53]),  # boxes: 1x1x5+1x1x2 | 1x2x5+1x4x5+... | ...
        "grid": TensorLeaf((4, 6), torch.int64, grid),
        "bf16": _flat_leaf(pattern((5, 3), torch.bfloat16, 17), [4, 11]),
    }
    bytecp.save(url, state, step=3)
    expected = {"flat": a.clone(), "grid": b.clone(), "bf16": pattern((5, 3), torch.bfloat16, 17)}
    return expected, {"framework": "plain", "world_size": 1, "step": 3, "user_metadata": {}}


def case_banded(url: str) -> tuple[Any, dict[str, Any]]:
    """Version 2's index at work: 600 row boxes over two bands, column
    boxes banded along dimension 1, a box meeting every band (listed in each
    band segment) and a 0-dim tensor (a wide segment)."""
    rows = pattern((600, 3), torch.float32, 37)
    cols = pattern((4, 600), torch.int16, 41)
    tall = pattern((40, 2), torch.float64, 43)
    state = {
        "rows": TensorLeaf((600, 3), torch.float32,
                           [Shard(Region((i, 0), (1, 3)), rows[i : i + 1]) for i in range(600)]),
        "cols": TensorLeaf((4, 600), torch.int16,
                           [Shard(Region((0, j), (4, 50)), cols[:, j : j + 50]) for j in range(0, 600, 50)]),
        "tall": TensorLeaf((40, 2), torch.float64,
                           [Shard(Region((0, 0), (39, 2)), tall[:39]), Shard(Region((39, 0), (1, 2)), tall[39:])]),
        "scalar": torch.tensor(3.5),
    }
    bytecp.save(url, state, step=5)
    md = json.loads(Path(url, "metadata.json").read_text())
    assert md["index"]["buckets"] > 1 and md["index"]["wide"]["first"] == ["scalar"]
    assert md["tensors"]["cols"]["band_dim"] == 1
    expected = {"rows": rows.clone(), "cols": cols.clone(), "tall": tall.clone(), "scalar": torch.tensor(3.5)}
    return expected, {"framework": "plain", "world_size": 1, "step": 5, "user_metadata": {}}


class TiedLM(nn.Module):
    """An embedding tied to the output head, and one block registered twice."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.block = nn.Linear(4, 4)
        self.again = self.block
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.again(torch.relu(self.block(self.embed(x)))))


def _plain_expected(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[Any, dict[str, Any]]:
    """What a one-process save of ``model`` and ``opt`` at step 2 loads back:
    the module's state dict and the optimizer's, keyed by parameter name."""
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in opt.param_groups for p in g["params"]]
    osd = opt.state_dict()
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(params[i])] for i in g["params"]]}
              for g in osd["param_groups"]]
    expected = {
        "model": dict(model.state_dict()),
        "optimizer": {"state": {names[id(params[i])]: dict(st) for i, st in osd["state"].items()},
                      "param_groups": groups},
    }
    return expected, {"framework": "plain", "world_size": 1, "step": 2, "user_metadata": {}}


def case_tied(url: str) -> tuple[Any, dict[str, Any]]:
    """Tensors sharing memory (a tied embedding and head, a block used twice)
    stored once, the other names as aliases; AdamW state after one step."""
    torch.manual_seed(21)
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.arange(6).reshape(2, 3)).square().mean().backward()
    opt.step()
    bytecp.save(url, {"model": model, "optimizer": opt}, step=2)
    md = json.loads(Path(url, "metadata.json").read_text())
    assert md["aliases"] == {"model.again.bias": "model.block.bias", "model.again.weight": "model.block.weight",
                             "model.head.weight": "model.embed.weight"}, md["aliases"]
    return _plain_expected(model, opt)


def case_pickle(url: str) -> tuple[Any, dict[str, Any]]:
    """A value only a full unpickling restores (saved with allow_pickle=True)."""
    state = {
        "frac": fractions.Fraction(1, 3),
        "w": pattern((2, 2), torch.float16, 19),
        "note": "needs allow_pickle",
    }
    bytecp.save(url, state, step=1, allow_pickle=True)
    return dict(state), {"framework": "plain", "world_size": 1, "step": 1, "user_metadata": {}}

def case_incremental(url: str) -> tuple[Any, dict[str, Any]]:
    """Format version 3: a checkpoint whose frozen layer is a reference into
    the earlier checkpoint ``step-1`` of the same run (the case directory)."""
    torch.manual_seed(31)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 2))
    model[0].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)

    def step() -> None:
        model(torch.linspace(-1.0, 1.0, 12).reshape(2, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    bytecp.save("step-1", {"model": model, "optimizer": opt}, step=1)
    step()
    md = bytecp.save(url, {"model": model, "optimizer": opt}, step=2, base="step-1")
    assert set(md.references) == {"step-1"}, md.references
    return _plain_expected(model, opt)


def case_blocks(url: str) -> tuple[Any, dict[str, Any]]:
    """Format version 5's block checksums, written at 4 KiB blocks (``index.block_bytes`` 4096; the
    reference writer's default is 1 MiB): a whole tensor of three blocks (the last one shorter), one
    of exactly one block (none recorded), row slabs and flat ranges over a block and under, a 0-dim
    tensor, and a frozen weight referenced from the run's earlier checkpoint ``step-1`` (its row
    carries the block checksums that checkpoint recorded)."""
    from bytecp.format import checksum

    saved_block = checksum.BLOCK_BYTES
    checksum.BLOCK_BYTES = 4096
    try:
        frozen = pattern((40, 100), torch.float32, 51)  # 16,000 bytes: 4 blocks
        whole = pattern((3000,), torch.float32, 53)  # 12,000 bytes: 3 blocks (4096, 4096, 3808)
        exact = pattern((2048,), torch.int16, 55)  # 4,096 bytes: one block, none recorded
        rows = pattern((40, 100), torch.float32, 57)  # slabs [0:25] 10,000 bytes (3 blocks), [25:40] 6,000 (2)
        flat = pattern((30, 70), torch.float64, 59)  # flat ranges [0, 1000) and [1000, 2100)
        bytecp.save("step-1", {"frozen": frozen}, step=1)
        state = {
            "frozen": frozen,
            "whole": whole,
            "exact": exact,
            "rows": TensorLeaf((40, 100), torch.float32, [Shard(Region((0, 0), (25, 100)), rows[:25]),
                                                           Shard(Region((25, 0), (15, 100)), rows[25:])]),
            "flat": _flat_leaf(flat, [1000]),
            "step": torch.tensor(3, dtype=torch.int64),
        }
        md = bytecp.save(url, state, step=2, base="step-1")
    finally:
        checksum.BLOCK_BYTES = saved_block
    assert set(md.references) == {"step-1"} and md.index.block_bytes == 4096, md.references
    expected = {"frozen": frozen.clone(), "whole": whole.clone(), "exact": exact.clone(), "rows": rows.clone(),
                "flat": flat.clone(), "step": torch.tensor(3, dtype=torch.int64)}
    return expected, {"framework": "plain", "world_size": 1, "step": 2, "user_metadata": {}}


#: keyword arguments loading each case needs
LOAD_OPTIONS: dict[str, dict[str, Any]] = {"pickle": {"allow_pickle": True}}

CASES: dict[str, Callable[[str], tuple[Any, dict[str, Any]]]] = {
    "plain": case_plain,
    "dtypes": case_dtypes,
    "irregular": case_irregular,
    "pickle": case_pickle,
    "banded": case_banded,
    "tied": case_tied,
    "two_ranks": case_two_ranks,
    "ddp": _framework_case("ddp"),
    "fsdp1": _framework_case("fsdp1"),
    "fsdp2": _framework_case("fsdp2"),
    "incremental": case_incremental,
    "parts": case_parts,
    "blocks": case_blocks,
}


# ----------------------------------------------------------------- writing
def inspect_fields(ckpt: Path, fields: dict[str, Any]) -> dict[str, Any]:
    """What ``bytecp inspect --json`` must report, computed from the files themselves."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    md = spec_metadata((ckpt / "metadata.json").read_bytes())
    chunks: dict[str, int] = {}
    n_chunks = 0
    if md["format_version"] == 1:
        rows = [row for f in md["index_files"] for row in pq.ParquetFile(ckpt / f).read(use_threads=False).to_pylist()]
    elif md["format_version"] >= 4:  # every segment of every part, found through the directory's pages
        d = md["index"]
        raw = (ckpt / d["directory"]["file"]).read_bytes()
        def page_rows(col: dict[str, Any]) -> list[dict[str, Any]]:
            return [e for off, n in zip(col["offset"], col["nbytes"], strict=True)
                    for e in pq.ParquetFile(pa.BufferReader(raw[off : off + n])).read(use_threads=False).to_pylist()]

        # a wide segment has an entry per tensor it holds rows of: each segment once
        segments = {(e["rank"], e["offset"]): e for e in page_rows(d["band_pages"]) + page_rows(d["wide_pages"])}
        parts = {r: (ckpt / "index" / md["save_id"] / f"{r}.bin").read_bytes() for r in d["parts"]["rank"]}
        rows = [row for e in segments.values()  # segments in the encoding of FORMAT.md §5.6
                for row in spec_segment(parts[e["rank"]], e["offset"], e["nbytes"], e["crc32c"], e["rows"],
                                        md["save_id"], d.get("block_bytes"))]
        rows += page_rows(d["scalar_pages"])  # 0-dim chunks: in the directory, in no part
    else:  # every segment; a chunk meeting several bands is listed in each
        raw = (ckpt / md["index"]["file"]).read_bytes()
        found = {json.dumps(row, sort_keys=True): row for col in (md["index"]["band"], md["index"]["wide"])
                 for off, n in zip(col["offset"], col["nbytes"], strict=True)
                 for row in pq.ParquetFile(pa.BufferReader(raw[off : off + n])).read(use_threads=False).to_pylist()}
        rows = list(found.values())
    for row in rows:
        chunks[row["fqn"]] = chunks.get(row["fqn"], 0) + 1
        n_chunks += 1
    tensors = {}
    for fqn, info in md["tensors"].items():
        size = torch.empty((), dtype=getattr(torch, info["dtype"])).element_size()
        tensors[fqn] = {
            "dtype": info["dtype"],
            "shape": info["shape"],
            "nbytes": math.prod(info["shape"]) * size,
            "chunks": chunks.get(fqn, 0),
        }
    return {
        "format_version": FORMAT_VERSION,
        **fields,
        "save_id": md["save_id"],
        "tensors": tensors,
        "totals": {
            "tensors": len(tensors),
            "tensor_bytes": sum(t["nbytes"] for t in tensors.values()),
            "chunks": n_chunks,
            "data_files": len([f for f in md["data_files"] if not f.startswith("../")]),
            "data_file_bytes": sum(n for f, n in md["data_files"].items() if not f.startswith("../")),
            "referenced_bytes": sum(n for f, n in md["data_files"].items() if f.startswith("../")),
        },
    }


def write_case(root: Path, name: str) -> None:
    case_dir = root / name
    if case_dir.exists():
        print(f"{case_dir} exists; golden files are never regenerated (skipped)")
        return
    tmp = root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cwd = os.getcwd()
    os.chdir(tmp)  # a relative URL keeps machine paths out of the stored reports
    try:
        expected, fields = CASES[name]("checkpoint")
    finally:
        os.chdir(cwd)
    per_rank = fields.pop("per_rank", {})
    ckpt = tmp / "checkpoint"
    # the expected values must be what bytecp reads back (checked once, here)
    got = bytecp.load_state_dict(str(ckpt), **LOAD_OPTIONS.get(name, {}))
    if canonical(encode(got)) != canonical(encode(expected)):
        raise SystemExit(
            f"{name}: load_state_dict does not give back what was saved; not writing it"
        )
    files = {
        p.relative_to(ckpt).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(ckpt.rglob("*"))
        if p.is_file()
    }
    doc = {
        "case": name,
        "description": (CASES[name].__doc__ or "").strip(),
        "format_version": FORMAT_VERSION,
        "written_by": {"bytecp": bytecp.__version__, "torch": torch.__version__},
        "load_options": LOAD_OPTIONS.get(name, {}),
        "inspect": inspect_fields(ckpt, fields),
        "files": files,
        # the checkpoints a version-3 case references, beside it in the case directory
        "base_files": {
            p.relative_to(tmp).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(tmp.rglob("*"))
            if p.is_file() and p.relative_to(tmp).parts[0] not in ("checkpoint", "expected.json")
        },
        "state": encode(expected),
        "per_rank": per_rank,
    }
    (tmp / "expected.json").write_text(json.dumps(doc, indent=1) + "\n")
    tmp.rename(case_dir)
    print(
        f"wrote {case_dir} ({sum(p.stat().st_size for p in case_dir.rglob('*') if p.is_file())} bytes)"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=sorted(CASES), action="append", help="write only this case")
    p.add_argument(
        "--root", type=Path, default=HERE / f"v{FORMAT_VERSION}", help="version directory"
    )
    args = p.parse_args(argv)
    os.environ.setdefault("BYTECP_JOB", "golden")
    args.root.mkdir(parents=True, exist_ok=True)
    for name in args.only or list(CASES):
        write_case(args.root, name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
