"""Per-process metrics through the neutral recorder, on fresh registries."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
import torch
from bytecp.monitoring.prometheus import PROCESS_METRICS, PrometheusRecorder, enable_prometheus
from monsynth import make_reports
from prometheus_client import CollectorRegistry

from bytecp import recorder


def _v(reg: CollectorRegistry, name: str, **labels: str) -> float | None:
    return reg.get_sample_value(name, labels)


def test_a_traced_save_becomes_metrics() -> None:
    reg = CollectorRegistry()
    rec = recorder.add_recorder(PrometheusRecorder(reg))
    trace = recorder.Trace("save", "memory://x/step-1", rank=3, world_size=4, step=1)
    job = trace.job
    lab = {"job": job, "rank": "3", "operation": "save"}
    assert _v(reg, "bytecp_operations_in_flight", **lab) == 1.0
    with trace.span("stage", nbytes=10):
        pass
    with trace.span("write", nbytes=4096, files=1) as s:
        s.nbytes += 4096
    trace.add_stall(0.25)
    trace.retries = 2
    trace.finish()
    recorder.remove_recorder(rec)

    assert _v(reg, "bytecp_operations_in_flight", **lab) == 0.0
    assert _v(reg, "bytecp_operations_total", **lab) == 1.0
    assert _v(reg, "bytecp_failures_total", **lab) == 0.0
    assert _v(reg, "bytecp_retries_total", **lab) == 2.0
    assert _v(reg, "bytecp_bytes_total", **lab) == 8192.0
    assert _v(reg, "bytecp_stall_seconds_sum", **lab) == pytest.approx(0.25)
    assert _v(reg, "bytecp_stall_seconds_bucket", le="0.25", **lab) == 1.0
    assert _v(reg, "bytecp_stall_seconds_bucket", le="0.1", **lab) == 0.0
    assert _v(reg, "bytecp_phase_seconds_count", phase="write", **lab) == 1.0
    assert _v(reg, "bytecp_phase_bytes_total", phase="write", **lab) == 8192.0
    assert _v(reg, "bytecp_phase_bytes_total", phase="stage", **lab) == 10.0
    assert (_v(reg, "bytecp_throughput_bytes_per_second", **lab) or 0) > 0


def test_failures_retries_events_and_drops() -> None:
    reg = CollectorRegistry()
    rec = PrometheusRecorder(reg, job="j", rank=1)
    for r in make_reports(2, job="j", failed_ranks=(1,)):
        rec.on_report(r)
    assert _v(reg, "bytecp_failures_total", job="j", rank="1", operation="save") == 1.0
    assert _v(reg, "bytecp_failures_total", job="j", rank="0", operation="save") == 0.0
    rec.on_event("storage_retry", 1.0, {"backend": "s3", "reason": "throttled"})
    rec.on_event("storage_retry", 1.0, {"backend": "s3", "reason": "throttled"})
    rec.on_event("storage_retry", 1.0, {})
    lab = {"job": "j", "rank": "1"}
    assert _v(reg, "bytecp_storage_retries_total", backend="s3", reason="throttled", **lab) == 2.0
    assert _v(reg, "bytecp_storage_retries_total", backend="unknown", reason="unknown", **lab) == 1.0
    rec.on_event("monitor_report_dropped", 1.0, {"job": "j", "rank": "1"})
    assert _v(reg, "bytecp_monitor_reports_dropped_total", job="j", rank="1") == 1.0
    # a report whose start this recorder never saw leaves the gauge alone
    assert _v(reg, "bytecp_operations_in_flight", job="j", rank="0", operation="save") is None


def test_every_declared_family_is_exported() -> None:
    reg = CollectorRegistry()
    rec = PrometheusRecorder(reg, job="j")
    rec.on_event(recorder.OPERATION_STARTED, 1.0, {"operation": "save"})
    for r in make_reports(1, job="j"):
        rec.on_report(r)
    rec.on_event("storage_retry", 1.0, {})
    rec.on_event("monitor_report_dropped", 1.0, {})
    for event in ("follower_lag_steps", "follower_lag_seconds", "follower_update_bytes"):
        rec.on_event(event, 2.0, {})
    names = {s.name for m in reg.collect() for s in m.samples}
    for fam in PROCESS_METRICS:
        assert any(n == fam or n.startswith(fam + "_") for n in names), fam


def test_no_recorder_no_cost_and_exporter_errors_never_fail_a_save() -> None:
    class Broken:
        def on_report(self, report: recorder.CheckpointReport) -> None:
            raise RuntimeError("exporter bug")

        def on_event(self, name: str, value: float, labels: dict[str, str]) -> None:
            raise RuntimeError("exporter bug")

    report = recorder.Trace("save", "memory://y").finish()  # nobody listening
    assert report.ok
    broken = recorder.add_recorder(Broken())
    try:
        t = recorder.Trace("load", "memory://y")
        assert t.finish().operation == "load"
    finally:
        recorder.remove_recorder(broken)


def test_opt_in_http_endpoint_on_loopback() -> None:
    reg = CollectorRegistry()
    rec = enable_prometheus(0, registry=reg, job="http", rank=0)
    try:
        assert rec in recorder.recorders()
        for r in make_reports(1, job="http"):
            rec.on_report(r)
        body = urllib.request.urlopen(f"http://127.0.0.1:{rec.http_port}/metrics", timeout=10).read().decode()
        assert 'bytecp_operations_total{job="http",operation="save",rank="0"} 1.0' in body
    finally:
        rec.http_server.shutdown()
        rec.http_server.server_close()


@pytest.mark.spawn
def test_a_save_with_nobody_listening_loads_no_exporter(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Zero cost when nothing listens: no gRPC, no Prometheus, no extra thread."""
    import subprocess
    import sys

    code = f"""
import sys, threading, torch, bytecp
def threads():  # the storage layer's request workers (per-request timeouts) wait idle for the next request
    return [t for t in threading.enumerate() if t.name != "bytecp-storage-request"]
before = len(threads())
bytecp.save({str(tmp_path / "ck")!r}, {{"w": torch.ones(4)}})
bytecp.load({str(tmp_path / "ck")!r}, {{"w": torch.zeros(4)}})
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("grpc", "prometheus_client")
                or m.startswith("bytecp.monitoring"))
assert not loaded, loaded
assert len(threads()) == before, threading.enumerate()
print("quiet")
"""
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("BYTECP_MONITOR")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and "quiet" in out.stdout, out.stderr


def test_storage_retries_count_into_the_open_operation() -> None:
    reg = CollectorRegistry()
    recorder.add_recorder(PrometheusRecorder(reg, job="r", rank=0))  # removed by the autouse fixture
    trace = recorder.Trace("save", "memory://retry", rank=0)
    recorder.emit_event(recorder.STORAGE_RETRY, 1, backend="s3", reason="throttled")
    recorder.emit_event(recorder.STORAGE_RETRY, 1, backend="s3", reason="5xx")
    report = trace.finish()
    recorder.emit_event(recorder.STORAGE_RETRY, 1, backend="s3", reason="5xx")  # after: not this save's
    assert report.retries == 2
    lab = {"job": report.job, "rank": "0", "operation": "save"}
    assert reg.get_sample_value("bytecp_retries_total", lab) == 2.0
    assert reg.get_sample_value(
        "bytecp_storage_retries_total", {"job": "r", "rank": "0", "backend": "s3", "reason": "5xx"}
    ) == 2.0


def test_recording_keeps_the_reports_of_the_block_only(tmp_path: Path) -> None:
    from bytecp.monitoring import recording

    import bytecp

    m = torch.nn.Linear(8, 8)
    with recording() as reports:
        bytecp.save(str(tmp_path / "a"), {"model": m})
        bytecp.load(str(tmp_path / "a"), {"model": m})
    bytecp.save(str(tmp_path / "b"), {"model": m})  # after the block: not kept
    assert [r.operation for r in reports] == ["save", "load"]
    assert sum(s.nbytes for s in reports[1].spans if s.phase == "read") >= 8 * 8 * 4
