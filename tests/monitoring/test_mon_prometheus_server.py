"""A real Prometheus scrapes a real collector; every dashboard query returns data.

The Prometheus configuration is deploy/prometheus/prometheus.yml with only the
target address and the intervals changed, so a mistake there (honor_labels
lost, say) fails here. The dashboard's queries come from the checked-in JSON.
Needs the ``prometheus`` binary (Debian package ``prometheus``, installed by
``make test`` where it runs as root); skipped with that reason elsewhere.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from bytecp.monitoring.server import CollectorServer
from monsynth import free_port

import bytecp
from bytecp.recorder import resolve_monitor

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "bytecp.json"
JOB = "dash"
PROMETHEUS = shutil.which("prometheus")

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="needs the prometheus binary (Debian package `prometheus`; `make test` installs it as root)",
)


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


class Prom:
    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def query(self, expr: str) -> list[dict[str, Any]]:
        body = _get(f"{self.base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert body["status"] == "success", (expr, body)
        return list(body["data"]["result"])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CollectorServer, Prom]]:
    """Collector (in process) and Prometheus (subprocess) on loopback."""
    tmp = tmp_path_factory.mktemp("prom")
    collector = CollectorServer("127.0.0.1:0", "127.0.0.1:0", complete_after=5.0).start()
    cfg = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
    [scrape] = [s for s in cfg["scrape_configs"] if s["job_name"] == "bytecp-collector"]
    scrape["static_configs"] = [{"targets": [f"127.0.0.1:{collector.metrics_port}"]}]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    assert PROMETHEUS is not None
    log = open(tmp / "prometheus.log", "wb")
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2).read()
                break
            except OSError:
                assert proc.poll() is None, (tmp / "prometheus.log").read_text()
                assert time.monotonic() < deadline, "prometheus did not become ready"
                time.sleep(0.2)
        yield collector, Prom(port)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        collector.stop(None)


def _dashboard_exprs() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", [])]


def _substitute(expr: str, operation: str) -> str:
    for var, value in (
        ("$__rate_interval", "1m"),
        ("$__interval", "15s"),
        ("$__range", "1h"),
        ("$operation", operation),
        ("$job", JOB),
    ):
        expr = expr.replace(var, value)
    assert "$" not in expr, expr
    return expr


def test_every_dashboard_query_returns_data_after_a_save(
    stack: tuple[CollectorServer, Prom], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    collector, prom = stack
    monkeypatch.setenv("BYTECP_JOB", JOB)
    addr = f"127.0.0.1:{collector.grpc_port}"
    state = {"model": torch.nn.Linear(128, 128), "extra": {"step": 1}}
    bytecp.save(str(tmp_path / "ok"), state, step=1, monitor=addr)
    bytecp.load(str(tmp_path / "ok"), state, monitor=addr)
    monkeypatch.setenv("BYTECP_FAULT_ERROR", "write:0")
    with pytest.raises(Exception, match="injected failure"):
        bytecp.save(str(tmp_path / "bad"), state, step=2, monitor=addr)
    monkeypatch.delenv("BYTECP_FAULT_ERROR")
    push = resolve_monitor(addr)
    assert push is not None and push.flush(20)  # type: ignore[attr-defined]

    # wait until the failed save is scraped and a few scrapes cover it (rate windows)
    deadline = time.monotonic() + 60
    sel = f'{{job="{JOB}", operation="save"}}'
    while not prom.query(f"count_over_time(bytecp_job_checkpoints_failed_total{sel}[1m]) >= 3 "
                         f"and bytecp_job_checkpoints_failed_total{sel} == 1"):
        assert time.monotonic() < deadline, "Prometheus never scraped the collector's figures"
        time.sleep(0.5)

    exprs = _dashboard_exprs()
    assert len(exprs) >= 15
    # the memory tier's panels read keeper processes' own exporters (no keeper runs
    # here; tests/storage/test_storage_keeper.py scrapes those metrics)
    exprs = [(title, expr) for title, expr in exprs if "bytecp_keeper_" not in expr]
    empty = []
    for operation in ("save", "load"):
        for title, expr in exprs:
            q = _substitute(expr, operation)
            result = prom.query(q)
            values = [float(r["value"][1]) for r in result]
            if not values or all(math.isnan(v) for v in values):
                empty.append(f"{title} [{operation}]: {q}")
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)

    # the template variable's query, as Grafana runs it
    jobs = _get(f"{prom.base}/api/v1/label/job/values?" + urllib.parse.urlencode({"match[]": "bytecp_job_checkpoints_total"}))
    assert JOB in jobs["data"]

    # and a few figures are the right ones, not just present
    [failed] = prom.query(f"bytecp_job_checkpoints_failed_total{sel}")
    assert float(failed["value"][1]) == 1.0
    [total] = prom.query(f"bytecp_job_checkpoints_total{sel}")
    assert float(total["value"][1]) == 2.0
    [info] = prom.query(f'bytecp_job_straggler_info{{job="{JOB}", operation="load"}}')
    assert info["metric"]["rank"] == "0"
