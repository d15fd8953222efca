"""A resharded load on real gloo ranks checks every byte it places: FSDP2 over
2 ranks loads a checkpoint saved by one process, each rank reading its rows
of each chunk (parts of chunks); a byte flipped in one rank's rows fails the
load on every rank, naming that rank, the file, the tensor, the chunk's
region, the block and the region that rank was loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import bytecp
from bytecp.format import checksum
from bytecp.loading.opened import open_checkpoint
from bytecp.storage_api import open_storage
from bytecp.tools.inspect import verify

from . import block_cases

pytestmark = pytest.mark.timeout(300)


def _flip(ck: Path, fqn: str, at: int) -> tuple[str, int]:
    (row,) = [r for r in open_checkpoint(str(ck)).all_rows() if r.fqn == fqn]
    raw = bytearray((ck / row.file).read_bytes())
    raw[row.byte_offset + at] ^= 0x01
    (ck / row.file).write_bytes(bytes(raw))
    return row.file, row.byte_offset


def test_fsdp2_resharded_load_checks_its_blocks(pools, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ck = tmp_path / "ck"
    model = block_cases.saved_model()
    monkeypatch.setattr(checksum, "BLOCK_BYTES", 1 << 20)  # four blocks of the 4,096,000-byte weight
    bytecp.save(str(ck), {"model": model})
    want = model.lin.weight.detach()
    got = pools(2).run(block_cases.load_fsdp2, str(ck))
    for r in got:
        assert "error" not in r, r
        assert torch.equal(r["rows"], want[r["first"] : r["first"] + 512])
    file, base = _flip(ck, "model.lin.weight", 900 * 4000 + 3)  # row 900: rank 1's rows, block 3
    got = pools(2).run(block_cases.load_fsdp2, str(ck))
    expect = (f"load/read failed on rank(s) 1:\n  rank 1: CorruptCheckpointError: {ck}/{file}: checksum mismatch in tensor "
              f"'model.lin.weight' region [0:1024, 0:1000], block 3 of 4 (bytes {base + 3 * (1 << 20)}.."
              f"{base + 4_096_000}), read to load its region [512:1024, 0:1000]")
    assert all(expect in r.get("error", "") for r in got), got
    assert all(r["error"].startswith("DistributedCheckpointError") for r in got)  # on every rank
    assert all("rank 0:" not in r["error"] for r in got)  # rank 0's blocks (0 and 1) are sound
    _, problems = verify(open_storage(str(ck)))
    assert [p.what for p in problems] == ["model.lin.weight"] and "block(s) 3" in problems[0].message
