"""benchmarks/s3_bench.py keeps working: a tiny run against the session's Ceph RGW."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from s3_servers import REPO

pytestmark = [pytest.mark.spawn, pytest.mark.bench, pytest.mark.s3, pytest.mark.ceph, pytest.mark.slow]


def test_s3_bench_quick_run(ceph_rgw, tmp_path):
    out = tmp_path / "bench.json"
    env = dict(
        os.environ,
        AWS_ACCESS_KEY_ID=ceph_rgw.key,
        AWS_SECRET_ACCESS_KEY=ceph_rgw.secret,
        AWS_DEFAULT_REGION="us-east-1",
        PYTHONPATH=REPO,
    )
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.s3_bench", "--endpoint", ceph_rgw.endpoint_url, "--gb", "0.02",
         "--repeats", "1", "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["save_gbps"]) == {"s3fs-one", "s3fs-4", "s3fs-8", "bytecp", "dcp", "dcp-t4"}
    assert set(result["load_gbps"]) == {"bytecp", "dcp"}  # both loads were checked bitwise
    for k in ("bytecp_save_vs_best_s3fs", "bytecp_save_vs_best_dcp", "bytecp_load_vs_dcp"):
        assert result[k] > 0
    assert "| bytecp |" in proc.stdout
