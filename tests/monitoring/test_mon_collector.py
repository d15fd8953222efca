"""The gRPC collector: servicer in process, then over a real loopback channel."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc
import pytest
from bytecp.monitoring._wire import report_to_pb
from bytecp.monitoring.aggregate import Aggregator
from bytecp.monitoring.client import CollectorClient
from bytecp.monitoring.generated import monitor_pb2 as pb
from bytecp.monitoring.job_metrics import JOB_METRICS, JobMetrics
from bytecp.monitoring.push import PushRecorder
from bytecp.monitoring.server import CollectorServer, CollectorServicer
from monsynth import make_reports
from prometheus_client import CollectorRegistry

from bytecp.errors import ConfigError
from tests.netport import free_port


class _Aborted(Exception):
    pass


class _Context:
    """The part of ``grpc.ServicerContext`` the servicer uses."""

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        raise _Aborted(details)


def _until(cond: Callable[[], object], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)


def test_servicer_in_process_aggregates_and_answers_queries() -> None:
    reg = CollectorRegistry()
    metrics = JobMetrics(reg)
    servicer = CollectorServicer(Aggregator(on_finalize=metrics.observe), metrics)
    ctx = _Context()
    for r in make_reports(4, job="j", slow={(2, "write"): 1.0}):
        assert servicer.Report(report_to_pb(r), ctx).accepted
    assert not servicer.Report(report_to_pb(r), ctx).accepted  # duplicate

    listed = servicer.ListCheckpoints(pb.ListCheckpointsRequest(job="j"), ctx).checkpoints
    assert len(listed) == 1 and listed[0].complete and listed[0].ranks_reported == 4
    assert (listed[0].straggler.rank, listed[0].straggler.phase) == (2, "write")
    assert len(listed[0].reports) == 0  # listing is light

    got = servicer.GetCheckpoint(pb.GetCheckpointRequest(checkpoint="memory://run/step-100"), ctx)
    assert [r.rank for r in got.reports] == [0, 1, 2, 3] and got.step == 100
    with pytest.raises(_Aborted):
        servicer.GetCheckpoint(pb.GetCheckpointRequest(checkpoint="nope"), ctx)
    assert ctx.code == grpc.StatusCode.NOT_FOUND

    v = reg.get_sample_value
    lab = {"job": "j", "operation": "save"}
    assert v("bytecp_job_checkpoints_total", lab) == 1.0
    assert v("bytecp_job_checkpoints_failed_total", lab) == 0.0
    assert v("bytecp_job_straggler_rank", lab) == 2.0
    assert v("bytecp_job_straggler_info", {**lab, "rank": "2", "phase": "write"}) == 1.0
    assert v("bytecp_job_rank_phase_seconds", {**lab, "rank": "2", "phase": "write"}) == pytest.approx(1.32)
    assert v("bytecp_job_last_step", lab) == 100.0
    assert v("bytecp_job_last_ranks_reported", lab) == 4.0
    assert v("bytecp_job_retries_total", lab) == 1.0
    assert v("bytecp_collector_reports_total", {"job": "j"}) == 5.0
    assert v("bytecp_collector_rejected_total", {"reason": "duplicate"}) == 1.0
    names = {s.name for m in reg.collect() for s in m.samples}
    for fam in JOB_METRICS:
        assert any(n == fam or n.startswith(fam + "_") for n in names), fam


def test_failed_save_and_a_new_straggler_replace_the_last_figures() -> None:
    reg = CollectorRegistry()
    metrics = JobMetrics(reg)
    aggr = Aggregator(on_finalize=metrics.observe)
    for r in make_reports(3, job="j", slow={(1, "stage"): 0.5}, checkpoint_id="a"):
        aggr.add(r)
    for r in make_reports(3, job="j", slow={(0, "write"): 0.5}, checkpoint_id="b", failed_ranks=(2,)):
        aggr.add(r)
    v = reg.get_sample_value
    lab = {"job": "j", "operation": "save"}
    assert v("bytecp_job_checkpoints_failed_total", lab) == 1.0
    assert v("bytecp_job_checkpoints_total", lab) == 2.0
    assert v("bytecp_job_straggler_info", {**lab, "rank": "0", "phase": "write"}) == 1.0
    assert v("bytecp_job_straggler_info", {**lab, "rank": "1", "phase": "stage"}) is None  # no stale series


def test_reports_pushed_over_loopback_reach_the_collector(collector: CollectorServer) -> None:
    addr = f"127.0.0.1:{collector.grpc_port}"
    push = PushRecorder(addr)
    t = time.perf_counter()
    for r in make_reports(4, job="loop", slow={(3, "write"): 0.8}):
        push.on_report(r)
    assert time.perf_counter() - t < 0.5  # queued, not sent, on the caller's thread
    assert push.flush(20)
    assert push.sent == 4 and push.dropped == 0
    v = collector.registry.get_sample_value
    _until(lambda: v("bytecp_job_checkpoints_total", {"job": "loop", "operation": "save"}) == 1.0)
    assert v("bytecp_job_straggler_rank", {"job": "loop", "operation": "save"}) == 3.0

    with CollectorClient(addr) as client:
        [summary] = client.list(job="loop")
        assert summary.complete and summary.straggler.phase == "write"
        agg = client.get("ckpt-100", job="loop")
        assert sorted(agg.reports) == [0, 1, 2, 3]
        assert agg.straggler() is not None and agg.straggler().rank == 3
        with pytest.raises(grpc.RpcError) as e:
            client.get("unknown")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    push.close()


def test_a_wrong_token_is_refused() -> None:
    server = CollectorServer("127.0.0.1:0", None, token="s3cret", registry=CollectorRegistry()).start()
    try:
        addr = f"127.0.0.1:{server.grpc_port}"
        msg = report_to_pb(make_reports(1, job="tok")[0])
        for token in ("wrong", ""):
            with CollectorClient(addr, token=token) as client, pytest.raises(grpc.RpcError) as e:
                client.report(msg)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with CollectorClient(addr, token="wrong") as client, pytest.raises(grpc.RpcError):
            client.list()
        assert server.registry.get_sample_value("bytecp_collector_rejected_total", {"reason": "unauthenticated"}) == 3.0
        assert server.aggregator.list() == []
        with CollectorClient(addr, token="s3cret") as client:
            assert client.report(msg)
            assert len(client.list()) == 1
    finally:
        server.stop(None)


def test_non_loopback_needs_a_token() -> None:
    with pytest.raises(ConfigError, match="without a token"):
        CollectorServer("0.0.0.0:0")
    with pytest.raises(ConfigError, match="both"):
        CollectorServer("127.0.0.1:0", tls_cert=b"x")


def test_absent_collector_never_blocks_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    push = PushRecorder(f"127.0.0.1:{free_port()}", queue_size=4, timeout=0.5)
    caplog.set_level(logging.WARNING, logger="bytecp.monitoring.push")
    t = time.perf_counter()
    for i in range(50):
        for r in make_reports(2, checkpoint_id=f"c{i}"):
            push.on_report(r)
    assert time.perf_counter() - t < 0.5  # 100 reports: queued or dropped, never waited on
    assert push.dropped >= 90  # a queue of 4
    push.flush(10)
    assert push.sent == 0 and push.dropped == 100
    warnings = [r for r in caplog.records if "dropping reports" in r.getMessage()]
    assert len(warnings) == 1
    push.close(0)


def _self_signed() -> tuple[bytes, bytes]:
    """A certificate for 127.0.0.1/localhost and its key (PEM)."""
    import datetime
    import ipaddress

    x509 = pytest.importorskip("cryptography.x509", reason="TLS test needs the cryptography package")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bytecp-collector-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def test_tls_and_token_together() -> None:
    cert, key = _self_signed()
    server = CollectorServer(
        "127.0.0.1:0", None, token="tok", tls_cert=cert, tls_key=key, registry=CollectorRegistry()
    ).start()
    try:
        addr = f"127.0.0.1:{server.grpc_port}"
        push = PushRecorder(addr, token="tok", root_certificates=cert)
        for r in make_reports(2, job="tls"):
            push.on_report(r)
        assert push.flush(20) and push.sent == 2
        with CollectorClient(addr, token="tok", root_certificates=cert) as client:
            assert client.list(job="tls")[0].complete
        # the same port refuses a client that does not speak TLS
        with CollectorClient(addr, token="tok", timeout=3) as plain, pytest.raises(grpc.RpcError):
            plain.list()
        push.close(0)
    finally:
        server.stop(None)


def test_ls_and_show_ask_the_collector(collector: CollectorServer, capsys: pytest.CaptureFixture[str]) -> None:
    from bytecp.monitoring.cli import main

    addr = f"127.0.0.1:{collector.grpc_port}"
    with CollectorClient(addr) as client:
        for r in make_reports(3, job="cli", slow={(1, "stage"): 0.6}):
            client.report(report_to_pb(r))
    assert main(["ls", "--collector", addr]) == 0
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("cli")]
    assert "step 100" in line and "3/3 ranks" in line and "straggler rank 1 stage" in line
    assert main(["show", "ckpt-100", "--collector", addr, "--job", "cli"]) == 0
    assert "straggler: rank 1 in stage" in capsys.readouterr().out
    assert main(["show", "nope", "--collector", addr]) == 2
    assert "NOT_FOUND" in capsys.readouterr().err


def test_an_unusable_tls_setup_drops_reports_instead_of_stalling(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("BYTECP_MONITOR_CA", str(tmp_path / "missing-ca.pem"))
    push = PushRecorder(f"127.0.0.1:{free_port()}")
    for r in make_reports(2):
        push.on_report(r)
    assert push.flush(10)
    assert push.dropped == 2 and push.sent == 0
    push.close(0)


def test_bytecp_monitor_environment_variable_is_enough(
    collector: CollectorServer, tmp_path, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    import torch

    import bytecp
    from bytecp.recorder import resolve_monitor

    addr = f"127.0.0.1:{collector.grpc_port}"
    monkeypatch.setenv("BYTECP_MONITOR", addr)
    monkeypatch.setenv("BYTECP_JOB", "env")
    bytecp.save(str(tmp_path / "ck"), {"w": torch.ones(8)}, step=5)  # no monitor= argument
    push = resolve_monitor(None)
    assert isinstance(push, PushRecorder) and push.address == addr
    assert push.flush(20)
    _until(lambda: collector.aggregator.list(job="env"))
    [agg] = collector.aggregator.list(job="env")
    assert agg.step == 5 and agg.complete
