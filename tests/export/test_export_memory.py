"""An export of a checkpoint far larger than its memory limit: peak RSS is
measured for real in a subprocess (``ru_maxrss``), against the same process
doing everything but the export (imports, metadata, index)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from .mem_worker import tensor

pytestmark = [pytest.mark.spawn, pytest.mark.slow, pytest.mark.timeout(900)]

N, MIB = 32, 32  # 1 GiB of tensors, 32 MiB each
#: what the export may add to the process's peak: a group of small tensors
#: (64 MiB), one tensor, and slack for allocator and thread pools -- a quarter
#: of the checkpoint's size
LIMIT_MIB = 256


def run(*args: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-m", "tests.export.mem_worker", *args], capture_output=True, text=True,
                         timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_export_of_1gib_stays_under_the_memory_limit(tmp_path: Path) -> None:
    ck, out = str(tmp_path / "ck"), tmp_path / "hf"
    run("save", ck, str(N), str(MIB))
    base = run("baseline", ck)
    got = run("export", ck, str(out), "300MB")
    extra_mib = (got["maxrss_kib"] - base["maxrss_kib"]) / 1024
    print(f"export of {N * MIB} MiB: peak RSS {got['maxrss_kib'] / 1024:.0f} MiB, baseline "
          f"{base['maxrss_kib'] / 1024:.0f} MiB, +{extra_mib:.0f} MiB; {got['seconds']:.1f} s")
    assert extra_mib < LIMIT_MIB, (extra_mib, got, base)
    shards = sorted(p for p in out.iterdir() if p.suffix == ".safetensors")
    assert len(shards) == 4  # eight 32 MiB tensors are 268 MB, nine would pass 300 MB
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for i in range(N):  # every byte, one tensor at a time
        name = f"layer{i}.weight"
        with safe_open(str(out / index["weight_map"][name]), "pt") as f:
            assert torch.equal(f.get_tensor(name), tensor(i, MIB)), name
