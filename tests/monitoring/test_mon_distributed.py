"""Two ranks on gloo save and load with monitoring on; a slow writer is named.

Rank 1 sleeps 1.5 s inside its write phase (``BYTECP_FAULT_DELAY``, honoured
by the core). The collector must get both ranks' reports for the save and
the load, and name rank 1 / write as the save's straggler, while rank 0's
long wait for it (inside the commit gather) must not be blamed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bytecp.monitoring.cli import main as monitor_main
from bytecp.monitoring.server import CollectorServer

from tests.netport import free_port

pytestmark = pytest.mark.spawn

WORKER = Path(__file__).with_name("mon_dist_worker.py")
WORLD = 2


@pytest.mark.timeout(240)
def test_two_ranks_report_and_the_slow_writer_is_the_straggler(
    collector: CollectorServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = str(tmp_path / "step-7")
    env = {
        **os.environ,
        "BYTECP_JOB": "two-ranks",
        "BYTECP_FAULT_DELAY": "write:1:1.5",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("BYTECP_MONITOR", None)
    port = free_port()
    addr = f"127.0.0.1:{collector.grpc_port}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), str(WORLD), str(port), url, addr],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD)
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=200)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0] * WORLD, "\n".join(outputs)

    deadline = time.monotonic() + 30
    while len([a for a in collector.aggregator.list(job="two-ranks") if a.complete]) < 2:
        assert time.monotonic() < deadline, "the collector did not get every rank's reports"
        time.sleep(0.1)
    save = collector.aggregator.list(job="two-ranks", operation="save")[0]
    load = collector.aggregator.list(job="two-ranks", operation="load")[0]
    assert sorted(save.reports) == sorted(load.reports) == [0, 1]
    assert save.ok and load.ok and save.world_size == WORLD
    assert save.key.checkpoint_id == load.key.checkpoint_id  # a load names the save it read

    st = save.straggler()
    assert st is not None and (st.rank, st.phase) == (1, "write"), st
    assert st.seconds >= 1.5 and st.lag_seconds > 1.0
    assert save.reports[1].phase_seconds()["write"] >= 1.5 > save.reports[0].phase_seconds()["write"]
    # the waiting rank 0 was blocked about as long as the slow rank worked
    assert save.reports[0].stall_seconds >= 1.4

    v = collector.registry.get_sample_value
    lab = {"job": "two-ranks", "operation": "save"}
    assert v("bytecp_job_straggler_rank", lab) == 1.0
    assert v("bytecp_job_straggler_info", {**lab, "rank": "1", "phase": "write"}) == 1.0
    assert (v("bytecp_job_rank_phase_seconds", {**lab, "rank": "1", "phase": "write"}) or 0) >= 1.5
    assert v("bytecp_job_last_ranks_reported", lab) == 2.0
    assert (v("bytecp_job_last_bytes", lab) or 0) >= 8 << 20

    # the same story from the reports stored beside the checkpoint
    png = tmp_path / "timeline.png"
    assert monitor_main(["show", url, "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "2/2 ranks reported" in out and "straggler: rank 1 in write" in out
    assert png.stat().st_size > 20_000
