"""Start a torchtitan job of N local gloo processes running
:mod:`tests.integrations.titan_worker` (used by the tests and by
``benchmarks/torchtitan_bench.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.netport import free_port as _free_port

__all__ = ["launch", "titan_args", "JobFailed"]

REPO = Path(__file__).resolve().parents[2]


class JobFailed(RuntimeError):
    pass




def titan_args(dump: Path, *extra: str, config: str = "bytecp_debug") -> list[str]:
    """CLI args of one run: the test config function, its dump folder, ``extra`` flags."""
    return ["--module", "tests.integrations.titan_config", "--config", config,
            "--dump_folder", str(dump), *extra]


def launch(runs: list[dict[str, Any]], nprocs: int, workdir: Path, assets: Path,
           timeout: float = 240.0) -> dict[str, Any]:
    """Run ``runs`` in one job of ``nprocs`` processes; rank 0's results.
    On failure, every rank is stopped and the failing rank's log tail raised."""
    workdir.mkdir(parents=True, exist_ok=True)
    tag = f"job{time.monotonic_ns()}"
    spec = workdir / f"{tag}.json"
    out = workdir / f"{tag}.out.json"
    spec.write_text(json.dumps({"runs": runs, "out": str(out)}))
    port = _free_port()
    procs, logs = [], []
    for rank in range(nprocs):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs),
                   LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   BYTECP_TITAN_ASSETS=str(assets), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
                   TORCHINDUCTOR_CACHE_DIR=str(workdir / "inductor"))
        log = open(workdir / f"{tag}.rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.integrations.titan_worker", str(spec)],
                                      cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    failed: int | None = None
    try:
        while any(p.poll() is None for p in procs):
            for rank, p in enumerate(procs):
                if p.poll() not in (None, 0):
                    failed = rank
            if failed is not None or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        for rank, p in enumerate(procs):
            if failed is None and p.poll() not in (None, 0):
                failed = rank
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    if failed is not None or not out.exists():
        rank = failed if failed is not None else 0
        tail = (workdir / f"{tag}.rank{rank}.log").read_text()[-4000:]
        why = "timed out" if failed is None else f"rank {rank} exited with {procs[rank].returncode}"
        raise JobFailed(f"torchtitan job {why}; its log ends:\n{tail}")
    return json.loads(out.read_text())
