"""deploy/ stays consistent with the code: dashboard, Prometheus, compose, Kubernetes."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from bytecp.monitoring.cli import _parser
from bytecp.monitoring.job_metrics import JOB_METRICS
from bytecp.monitoring.keeper_metrics import KEEPER_METRICS
from bytecp.monitoring.prometheus import FOLLOWER_EVENTS

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def _load_script(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _serve_args(argv: list[str]) -> Any:
    """Parse a container's collector arguments with the real CLI parser."""
    argv = argv[2:] if argv[:2] == ["bytecp", "monitor"] else argv
    args = _parser().parse_args(argv)
    assert args.command == "serve"
    return args


def test_checked_in_dashboard_is_what_the_script_generates() -> None:
    gen = _load_script(DEPLOY / "grafana" / "make_dashboard.py")
    assert (DEPLOY / "grafana" / "dashboards" / "bytecp.json").read_text() == gen.render(), (
        "run `python deploy/grafana/make_dashboard.py` and commit the JSON"
    )


def test_dashboard_uses_only_exported_metrics_and_covers_the_issue() -> None:
    board = json.loads((DEPLOY / "grafana" / "dashboards" / "bytecp.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    exprs.append(board["templating"]["list"][1]["definition"])
    allowed = set(JOB_METRICS) | {f"{m}_{s}" for m in JOB_METRICS for s in ("bucket", "sum", "count")}
    allowed |= set(KEEPER_METRICS)  # the memory tier's keepers export their own
    allowed |= set(FOLLOWER_EVENTS.values())  # so do followers (bytecp.follow)
    used = {m for e in exprs for m in re.findall(r"\bbytecp_[a-z_]+", e)}
    assert used and used <= allowed, used - allowed
    titles = " | ".join(p["title"].lower() for p in board["panels"])
    for topic in ("stall", "phase breakdown", "straggler", "throughput", "failed", "retries", "memory tier",
                  "followers: lag", "followers: bytes"):
        assert topic in titles, topic
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])


@pytest.mark.spawn
def test_prometheus_config_keeps_job_labels_and_scrapes_the_collector_and_keepers() -> None:
    path = DEPLOY / "prometheus" / "prometheus.yml"
    cfg = yaml.safe_load(path.read_text())
    [scrape] = [s for s in cfg["scrape_configs"] if s["job_name"] == "bytecp-collector"]
    assert scrape["honor_labels"] is True
    assert scrape["static_configs"][0]["targets"] == ["collector:9470"]
    # the keepers' job: their own job label kept, their list in files beside the config (as compose mounts it)
    [keepers] = [s for s in cfg["scrape_configs"] if s["job_name"] == "bytecp-keepers"]
    assert keepers["honor_labels"] is True
    [pattern] = keepers["file_sd_configs"][0]["files"]
    shipped = sorted(path.parent.glob(pattern))
    assert shipped and all(isinstance(yaml.safe_load(f.read_text()), list) for f in shipped)
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    mounts = {v.split(":")[1] for v in compose["services"]["prometheus"]["volumes"]}
    assert "/etc/prometheus/" + pattern.split("/")[0] in mounts
    promtool = shutil.which("promtool")
    if promtool:
        out = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr


def test_compose_stack_is_wired_together() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert {"collector", "prometheus", "grafana", "s3"} <= set(services)
    args = _serve_args(services["collector"]["command"])
    assert args.metrics.endswith(":9470") and args.grpc.endswith(":7470")
    assert "BYTECP_MONITOR_TOKEN" in services["collector"]["environment"]  # it listens beyond loopback
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)
        for vol in svc.get("volumes", []):
            src = vol.split(":", 1)[0]
            if src.startswith("."):
                assert (DEPLOY / src).exists(), (name, src)
    build = services["collector"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).exists()


def test_kubernetes_example_points_ranks_at_the_collector_service() -> None:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "training-job.yaml").read_text()) if d]
    by_kind: dict[tuple[str, str], dict[str, Any]] = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    collector = by_kind[("Deployment", "bytecp-collector")]["spec"]["template"]["spec"]["containers"][0]
    args = _serve_args(collector["args"])
    assert args.token_file  # non-loopback: token required
    service = by_kind[("Service", "bytecp-collector")]
    grpc_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    trainer = by_kind[("Job", "train")]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in trainer["env"]}
    assert env["BYTECP_MONITOR"]["value"] == f"bytecp-collector:{grpc_port}"
    assert env["BYTECP_MONITOR_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "bytecp-monitor"
    monitor = by_kind[("ServiceMonitor", "bytecp-collector")]
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True


@pytest.mark.parametrize("name", ["prometheus.yaml", "bytecp.yaml"])
def test_grafana_provisioning_parses(name: str) -> None:
    found = list((DEPLOY / "grafana" / "provisioning").rglob(name))
    assert len(found) == 1
    doc = yaml.safe_load(found[0].read_text())
    assert doc["apiVersion"] == 1
