"""The checked-in gRPC modules are exactly what the .proto generates."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_generated_modules_are_up_to_date(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is a test dependency (make install-test)")
    spec = importlib.util.spec_from_file_location("bytecp_proto_generate", ROOT / "proto" / "generate.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    written = gen.generate(tmp_path)
    assert {p.name for p in written} == {"monitor_pb2.py", "monitor_pb2.pyi", "monitor_pb2_grpc.py"}
    for fresh in written:
        checked_in = ROOT / "monitoring" / "generated" / fresh.name
        assert checked_in.read_text() == fresh.read_text(), (
            f"{checked_in} is stale: run `python proto/generate.py` and commit the result"
        )


def test_wire_round_trip_keeps_every_field() -> None:
    from bytecp.monitoring._wire import report_from_pb, report_to_pb
    from bytecp.monitoring.generated import monitor_pb2 as pb
    from monsynth import make_reports

    for r in make_reports(2, failed_ranks=(1,)) + make_reports(1, step=None, operation="load"):
        data = report_to_pb(r, "host", 7).SerializeToString()
        assert report_from_pb(pb.RankReport.FromString(data)) == r
