"""The benchmark harness end to end on the tiny ``--quick`` config.

Checks that one run produces every case of every group with numeric timings,
the dd figures, the targets and the PNG; it asserts nothing about speed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bytecp.format import checked_reads

from .helpers import numeric, run_benchmark

pytestmark = [pytest.mark.spawn, pytest.mark.bench]


def _numeric(v: object) -> bool:
    return numeric(v) and v >= 0  # type: ignore[operator]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_quick_run_reports_every_case(tmp_path: Path) -> None:
    from benchmarks.run import LAST_CASES, LOAD_CASES, SAVE_CASES, SHORT_CASES

    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = run_benchmark("run", ["--quick", "--dir", str(tmp_path / "data"), "--out", str(out), "--png", str(png)],
                         timeout=400)
    res = json.loads(out.read_text())
    assert png.stat().st_size > 10_000
    assert "| group | case |" in proc.stdout

    expected = {
        "fsdp2": SAVE_CASES + LOAD_CASES + LAST_CASES,
        "ddp": SHORT_CASES["ddp"],
        "fsdp1": SHORT_CASES["fsdp1"],
        "reshard 2->3": LOAD_CASES,
        "reshard 2->1": LOAD_CASES,
    }
    assert set(res["groups"]) == set(expected)
    for label, names in expected.items():
        group = res["groups"][label]
        assert set(group["cases"]) == set(names), label
        for name, case in group["cases"].items():
            if case["status"].startswith("n/a") and name.endswith("cold") and os.geteuid() != 0:
                continue  # dropping the page cache needs root
            assert case["status"] == "ok", (label, name, case)
            assert _numeric(case["blocking_s"]) and _numeric(case["total_s"]), (label, name, case)
            assert case["blocking_s"] <= case["total_s"] + 1e-9, (label, name, case)
            assert len(case["rss_peak_delta_per_rank"]) == group["world_size"]
            if name.startswith(("bytecp.save", "dcp.save", "bytecp.async", "dcp.async")):
                assert all(_numeric(b) for b in case["bytes_per_rank"]), (label, name, case)
                assert case["bytes_total"] > 0
            if "load" in name:
                assert case.get("verified", True), (label, name, "loaded values differ from the saved ones")
        ran = [n for n, c in group["cases"].items() if c["status"] == "ok"]
        assert any(n.startswith("dcp.") for n in ran), label

    for key in ("write_fdatasync_gbps", "write_parallel_gbps", "write_direct_gbps"):
        assert _numeric(res["disk"][key]), key
    assert res["ratios"], "no bytecp / DCP ratio was computed"
    assert all(t["status"] in ("met", "missed", "n/a") for t in res["targets"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dcp_source_quick_reports_both_libraries(tmp_path: Path) -> None:
    """``python -m benchmarks.dcp_source --quick``: every pair of cases timed, verified, in the table."""
    out = tmp_path / "dcp.json"
    proc = run_benchmark("dcp_source", ["--quick", "--dir", str(tmp_path), "--out", str(out)], timeout=280)
    res = json.loads(out.read_text())
    assert set(res["groups"]) == {"FSDP2 x2 -> FSDP2 x3", "FSDP2 x2 -> one process"}
    for label, group in res["groups"].items():
        assert group["verified"], label
        assert group["ratios"] and all(_numeric(r) for r in group["ratios"].values()), label
        assert all(_numeric(s) for s in group["seconds"].values()), label
    assert "| FSDP2 x2 -> FSDP2 x3 | `bytecp.load` |" in proc.stdout
    assert res["tensors"] > 20 and res["checkpoint_bytes"] > 0


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_deepspeed_source_quick_reports_both_libraries(tmp_path: Path) -> None:
    """``python -m benchmarks.deepspeed_source --quick``: DeepSpeed writes ZeRO-3 and ZeRO-2
    checkpoints; every row timed for both libraries, every bytecp load bitwise."""
    pytest.importorskip("deepspeed")
    from benchmarks.deepspeed_source import ROWS

    out = tmp_path / "ds.json"
    proc = run_benchmark("deepspeed_source", ["--quick", "--dir", str(tmp_path), "--out", str(out)], timeout=380)
    res = json.loads(out.read_text())
    assert res["bitwise"], res["seconds"]
    for label, b, d in ROWS:
        assert _numeric(res["seconds"][b]) and _numeric(res["seconds"][d]), label
        assert f"| {label} |" in proc.stdout


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.timeout(120)
def test_scale_s3_load_tiny_world_against_moto(tmp_path: Path) -> None:
    """``python -m benchmarks.scale_s3_load`` at 128 ranks against moto: the MoE middle rank's
    load from S3 one part at a time and 16 at once, and from the local copy, each timed, all
    reading the same parts; the server stopped (no timing is asserted)."""
    pytest.importorskip("moto")
    out = tmp_path / "s3load.json"
    proc = run_benchmark("scale_s3_load", ["--world", "128", "--server", "moto", "--repeats", "1",
                                           "--out", str(out)], timeout=110)
    res = json.loads(out.read_text())
    loads = res["loads"]
    assert set(loads) == {"s3, one part at a time", "s3, 16 at once", "local disk"}
    for name, v in loads.items():
        assert _numeric(v["s"]) and _numeric(v["client_cpu_s"]), (name, v)
        assert v["parts_read"] == res["touched"]["parts"] > 0, (name, v)
    assert len({(v["rows"], v["part_bytes"], v["directory_bytes"]) for v in loads.values()}) == 1
    assert _numeric(res["serial_over_concurrent"])
    assert _numeric(res["metadata"]["fetch_s"]) and _numeric(res["metadata"]["parse_s"])
    assert res["upload"]["files"] == res["parts_written"] + 2  # the parts, the directory, metadata.json
    assert "| s3, one part at a time |" in proc.stdout and "| s3, 16 at once |" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_load_floor_tiny_reports_every_case(tmp_path: Path) -> None:
    """``python -m benchmarks.load_floor`` at a tiny size: the floor, both bytecp loads and DCP timed,
    wall and CPU, each against the floor (nothing asserted about speed)."""
    out = tmp_path / "load.json"
    run_benchmark("load_floor", ["--gb", "0.01", "--repeats", "1", "--root", str(tmp_path), "--json", str(out)],
                  timeout=280)
    res = json.loads(out.read_text())
    assert res["read_gb"] > 0.005 and res["tensors"] > 20
    for case in ("floor", "bytecp", "bytecp_unverified", "dcp"):
        assert all(_numeric(v) for v in res[f"{case}_s"].values()), case
        if case != "floor":
            assert _numeric(res[f"{case}_speed_vs_floor"]) and _numeric(res[f"{case}_cpu_vs_floor"]), case
    if checked_reads.compiled() is not None:  # the floor of a copy out of a mapping, where bytecp reads so
        assert all(_numeric(v) for v in res["floor_mapped_s"].values())
        assert _numeric(res["bytecp_speed_vs_mapped_floor"]) and _numeric(res["bytecp_unverified_speed_vs_mapped_floor"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lazy_call_tiny_reports_every_mode_and_both_floors(tmp_path: Path) -> None:
    """``python -m benchmarks.lazy_call`` at a tiny size: the three calls, the training step beside each
    and alone, the copy floor back to back and in the loop, and the eager call against the latter
    (nothing asserted about speed)."""
    out = tmp_path / "lazy.json"
    run_benchmark("lazy_call", ["--mb", "2", "--layers", "2", "--saves", "2", "--warmup", "1", "--json", str(out)],
                  timeout=280)
    res = json.loads(out.read_text())
    assert res["tensors"] > 20 and res["saves_each"] == 2
    for mode in ("lazy", "manager_lazy", "eager"):
        assert all(_numeric(v) for v in res[f"{mode}_call"].values()), mode
        assert all(_numeric(v) for v in res[f"{mode}_training_step"].values()), mode
    floors = [k for k in res if k.startswith("floor_in_loop_")]
    assert floors and all(all(_numeric(v) for v in res[k].values()) for k in floors)
    vs = [k for k in res if k.startswith("eager_call_vs_floor_in_loop_")]
    assert len(vs) == len(floors) and all(_numeric(res[k]) for k in vs)
    assert _numeric(res["floor_ms_1_thread"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_follow_serving_tiny_reports_every_rate(tmp_path: Path) -> None:
    """``python -m benchmarks.follow --serving`` on a tiny Llama: both followers
    of each learning rate timed (wall and CPU), their bytes, the trainer's
    blocking and background time (the benchmark itself asserts every update
    bitwise; nothing asserted about speed)."""
    out = tmp_path / "follow.json"
    run_benchmark("follow", ["--serving", "--hidden", "64", "--layers", "1", "--steps", "3", "--lrs", "1e-6,1e-4",
                             "--json", str(out)], timeout=240)
    rows = json.loads(out.read_text())
    assert [r["lr"] for r in rows] == [1e-6, 1e-4]
    for r in rows:
        for k in ("delta_s", "whole_s", "time_ratio", "delta_cpu_s", "whole_cpu_s", "block_deltas_s", "serve_s"):
            assert _numeric(r[k]), (r["lr"], k)
        assert 0 < r["delta_bytes"] and 0 < r["whole_bytes"] and 0 <= r["changed"] <= 1, r
