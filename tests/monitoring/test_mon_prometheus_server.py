"""A real Prometheus scrapes a real collector and real keepers; every dashboard query returns data.

The Prometheus configuration is deploy/prometheus/prometheus.yml with only the
collector's address and the intervals changed, and the keepers listed the way
a deployment lists them (a file under keepers/ beside it), so a mistake there
(honor_labels lost, say) fails here. The dashboard's queries come from the
checked-in JSON.
Needs the ``prometheus`` binary (Debian package ``prometheus``, installed by
``make test`` where it runs as root); skipped with that reason elsewhere.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
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
from spawning import spawns

import bytecp
from bytecp.recorder import resolve_monitor
from tests.netport import free_port

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "storage"))  # keeper processes as the memory-tier tests start them
from keepers import TOKEN, spawn_keeper  # noqa: E402

from tests.netport import free_ports  # noqa: E402

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
    def __init__(self, port: int, keeper_metrics: dict[str, int]) -> None:
        self.base = f"http://127.0.0.1:{port}"
        #: host -> the metrics port its keeper is to serve on (listed in keepers/ before Prometheus starts)
        self.keeper_metrics = keeper_metrics

    def query(self, expr: str) -> list[dict[str, Any]]:
        body = _get(f"{self.base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert body["status"] == "success", (expr, body)
        return list(body["data"]["result"])


@pytest.fixture(scope="module")
@spawns
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CollectorServer, Prom]]:
    """Collector (in process) and Prometheus (subprocess) on loopback."""
    tmp = tmp_path_factory.mktemp("prom")
    collector = CollectorServer("127.0.0.1:0", "127.0.0.1:0", complete_after=5.0).start()
    cfg = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
    [scrape] = [s for s in cfg["scrape_configs"] if s["job_name"] == "bytecp-collector"]
    scrape["static_configs"] = [{"targets": [f"127.0.0.1:{collector.metrics_port}"]}]
    [keepers] = [s for s in cfg["scrape_configs"] if s["job_name"] == "bytecp-keepers"]
    assert keepers["honor_labels"] is True  # the keeper's job label is the training job's
    keeper_metrics = dict(zip(("h0", "h1"), free_ports(2), strict=True))
    [pattern] = keepers["file_sd_configs"][0]["files"]  # relative to the configuration file, as deployed
    listed = tmp / pattern.replace("*", "test")
    listed.parent.mkdir(parents=True, exist_ok=True)
    listed.write_text(yaml.safe_dump([{"targets": [f"127.0.0.1:{p}" for p in keeper_metrics.values()]}]))
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
        yield collector, Prom(port, keeper_metrics)
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


def _assert_data(prom: Prom, exprs: list[tuple[str, str]]) -> None:
    """Every query returns at least one number (not NaN), for both operations."""
    empty = []
    for operation in ("save", "load"):
        for title, expr in exprs:
            q = _substitute(expr, operation)
            result = prom.query(q)
            values = [float(r["value"][1]) for r in result]
            if not values or all(math.isnan(v) for v in values):
                empty.append(f"{title} [{operation}]: {q}")
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)


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
    # the memory tier's panels read the keepers' own exporters (test_every_keeper_query_...), the
    # followers' panels the followers' (tests/serving/test_follow.py::test_follower_lag_and_bytes_reach_prometheus)
    _assert_data(prom, [(title, expr) for title, expr in exprs
                        if "bytecp_keeper_" not in expr and "bytecp_follower_" not in expr])

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


@pytest.mark.spawn
def test_every_keeper_query_returns_data_from_real_keepers(stack: tuple[CollectorServer, Prom], tmp_path: Path) -> None:
    """Two keeper processes (hosts h0, h1) serve /metrics as ``bytecp keeper --metrics-port`` does;
    a job checkpoints to their memory through the manager (replicated to the peer) and drains to
    disk; Prometheus scrapes them through the deployed job, and every memory-tier query of the
    dashboard -- memory held, replication lag, drain lag, failed drains -- returns data."""
    _, prom = stack
    ports = dict(zip(prom.keeper_metrics, free_ports(len(prom.keeper_metrics)), strict=True))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name, metrics in prom.keeper_metrics.items():
            procs.append(spawn_keeper(name, ports, tmp_path, args=["--metrics-port", str(metrics), "--job", JOB]))
        opts = {"keepers": ",".join(f"{n}=127.0.0.1:{p}" for n, p in ports.items()), "host": "h0", "token": TOKEN}
        mgr = bytecp.CheckpointManager(str(tmp_path / "run"), every_n_steps=2, memory_url=f"keeper://{JOB}/run",
                                       memory_every_n_steps=1, memory_storage_options=opts)
        state = {"model": torch.nn.Linear(256, 256), "extra": {"step": 0}}
        for step in (1, 2):  # two memory checkpoints; the second also drains to storage
            state["extra"]["step"] = step
            mgr.maybe_save(step, state)
        mgr.wait()

        sel = f'job="{JOB}"'
        deadline = time.monotonic() + 60
        while not (prom.query(f'sum(bytecp_keeper_drains{{{sel}, state="done"}}) == 1')
                   and len(prom.query(f"bytecp_keeper_memory_bytes{{{sel}}} > 0")) == 2
                   # the counters' increase() needs two scrapes of each keeper
                   and len(prom.query(f"count_over_time(bytecp_keeper_cpu_seconds_total{{{sel}}}[1m]) >= 2")) == 2):
            assert time.monotonic() < deadline, "Prometheus never scraped a finished drain from both keepers"
            time.sleep(0.5)
        assert (tmp_path / "run" / "step-2" / "metadata.json").exists()  # the drain committed

        exprs = [(title, expr) for title, expr in _dashboard_exprs() if "bytecp_keeper_" in expr]
        titles = " | ".join(title.lower() for title, _ in exprs)
        for figure in ("memory held", "replication", "drain lag", "staging arenas", "adopted vs written"):
            assert figure in titles, figure  # the per-tier view, and the single-copy path's
        assert len(exprs) >= 9
        _assert_data(prom, exprs)

        # and the figures are the keepers' own: both hold the checkpoints (h1 the copies), the
        # replication took time, the drain is over (no lag) and none failed
        held = {r["metric"]["host"]: float(r["value"][1]) for r in prom.query(f"bytecp_keeper_memory_bytes{{{sel}}}")}
        assert set(held) == {"h0", "h1"} and min(held.values()) >= 2 * 256 * 256 * 4
        [rep] = prom.query(f"max(bytecp_keeper_replication_seconds{{{sel}}})")
        assert float(rep["value"][1]) > 0
        lags = prom.query(f"bytecp_keeper_drain_lag_seconds{{{sel}}}")
        assert len(lags) == 2 and all(float(r["value"][1]) == 0 for r in lags)
        [failed] = prom.query(f'sum(bytecp_keeper_drains{{{sel}, state="failed"}})')
        assert float(failed["value"][1]) == 0
        # the saves staged into arenas h0 lent and h0 adopted them (single copy); h1 received the copies
        def one(expr: str) -> float:
            [r] = prom.query(expr)
            return float(r["value"][1])

        h0, h1 = f'{sel}, host="h0"', f'{sel}, host="h1"'
        assert one(f'bytecp_keeper_arena_events_total{{{h0}, event="adopted"}}') >= 2
        assert one(f'bytecp_keeper_arena_events_total{{{h0}, event="lent"}}') >= 2
        assert one(f'bytecp_keeper_data_bytes_total{{{h0}, how="adopted"}}') >= 2 * 256 * 256 * 4
        assert one(f'bytecp_keeper_data_bytes_total{{{h1}, how="received"}}') >= 2 * 256 * 256 * 4
        assert one(f'bytecp_keeper_arenas{{{h0}, state="lent"}}') == 0  # every lent arena adopted
        assert one(f"bytecp_keeper_cpu_seconds_total{{{h0}}}") > 0
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
