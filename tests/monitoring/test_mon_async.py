"""Asynchronous and lazy saves: the stall is only what training waited for.

One process; the core's fault hook slows the staging copy (0.6 s, the only
blocking phase of an eager async save) and the background write (0.8 s) so
the phases are measurable.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from bytecp.monitoring.prometheus import PrometheusRecorder
from bytecp.monitoring.push import PushRecorder
from bytecp.monitoring.server import CollectorServer
from prometheus_client import CollectorRegistry

import bytecp
from bytecp import recorder


def test_async_and_lazy_saves_report_their_stall_and_waits(
    collector: CollectorServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BYTECP_JOB", "async")
    monkeypatch.setenv("BYTECP_FAULT_DELAY", "stage:0:0.6,write:0:0.8")
    reg = CollectorRegistry()
    recorder.add_recorder(PrometheusRecorder(reg))
    reports: list[recorder.CheckpointReport] = []

    class Keep:
        def on_report(self, report: recorder.CheckpointReport) -> None:
            reports.append(report)

        def on_event(self, name: str, value: float, labels: dict[str, str]) -> None:
            pass

    recorder.add_recorder(Keep())
    push = PushRecorder(f"127.0.0.1:{collector.grpc_port}")
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": opt}
    in_flight = {"job": "async", "rank": "0", "operation": "save"}

    t = time.perf_counter()
    first = bytecp.async_save(str(tmp_path / "s1"), state, step=1, monitor=push)
    returned = time.perf_counter() - t
    assert reg.get_sample_value("bytecp_operations_in_flight", in_flight) == 1.0
    assert not first.done() and returned < 0.6 + 0.8  # the write goes on in the background

    second = bytecp.async_save(str(tmp_path / "s2"), state, step=2, lazy=True, monitor=push)
    model(torch.randn(4, 256)).sum().backward()
    opt.step()  # the lazy pre-step hook waits for a staging slowed by 0.6 s
    second.wait()
    assert push.flush(20)

    s1, s2 = sorted(reports, key=lambda r: r.step or 0)
    p1, p2 = s1.phase_seconds(), s2.phase_seconds()
    assert p1["stage"] >= 0.6 and p1["write"] >= 0.8
    assert s1.stall_seconds >= 0.6 and s1.stall_seconds < s1.duration - 0.5
    assert p2["wait_previous"] > 0.2 and p2["lazy_wait"] > 0.2
    assert s2.stall_seconds >= p2["wait_previous"] + p2["lazy_wait"] - 0.05
    assert reg.get_sample_value("bytecp_operations_in_flight", in_flight) == 0.0
    assert reg.get_sample_value("bytecp_phase_seconds_count", {**in_flight, "phase": "lazy_wait"}) == 1.0

    aggs = collector.aggregator.list(job="async")
    assert sorted(a.step or 0 for a in aggs) == [1, 2] and all(a.complete and a.ok for a in aggs)
    v = collector.registry.get_sample_value
    lab = {"job": "async", "operation": "save", "rank": "0"}
    deadline = time.monotonic() + 10
    while v("bytecp_job_last_step", {"job": "async", "operation": "save"}) != 2.0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert (v("bytecp_job_rank_phase_seconds", {**lab, "phase": "lazy_wait"}) or 0) > 0.2
    st = collector.aggregator.get(str(tmp_path / "s2")).straggler()  # type: ignore[union-attr]
    assert st is not None and st.phase not in recorder.WAIT_PHASES
    push.close(0)
