"""The end-to-end training benchmark on its tiny ``--quick`` config.

Checks that one command produces the table, the JSON (every mode, its
rounds, blocking times, traced phases, the floor, the targets) and the PNG;
it asserts nothing about speed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .helpers import numeric as _numeric
from .helpers import run_benchmark

pytestmark = [pytest.mark.spawn, pytest.mark.bench]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_training_run_reports_every_mode(tmp_path: Path) -> None:
    from benchmarks.training import MODES

    out, png = tmp_path / "training.json", tmp_path / "training.png"
    proc = run_benchmark("training", ["--quick", "--rounds", "2", "--dir", str(tmp_path), "--out", str(out),
                                      "--png", str(png)], timeout=280)
    assert "| mode | added training time per checkpoint" in proc.stdout
    assert png.stat().st_size > 10_000
    res = json.loads(out.read_text())
    summary = res["summary"]
    assert set(summary["modes"]) == set(MODES) - {"none"}
    for mode, m in summary["modes"].items():
        assert len(m["added_rounds_s"]) == 2, mode
        for key in ("added_per_checkpoint_s", "blocking_median_s", "added_cpu_per_checkpoint_s", "first_blocking_s"):
            assert _numeric(m[key]), (mode, key, m)
        assert m["blocking_median_s"] >= 0
    assert [t["target"] for t in summary["targets"]] == [
        "eager blocking / DCP blocking", "lazy added time / DCP added time", "lazy added time - eager added time (s)"]
    assert all(t["status"] in ("met", "missed") for t in summary["targets"])
    assert all(_numeric(v) and v > 0 for v in summary["floor"].values())
    assert set(summary["floor_together"]) == {"memcpy_s", "copy_s"}
    assert all(_numeric(v) and v > 0 for v in summary["floor_together"].values())
    # every window of every round; bytecp checkpoints with their traced phases, DCP's with its end
    rounds = [r for r in res["results"] if r["mode"] != "none"]
    assert len(rounds) == 2 * (len(MODES) - 1)
    for r in rounds:
        c = r["checkpoint"]
        assert len(r["steps"]) == 2 and c["call"][0] <= c["call"][1] <= r["steps"][0][0] + 1e-3
        assert c["done"] is not None and c["done"] >= c["call"][1]
        if r["mode"].startswith("bytecp"):
            assert {"stage", "write", "commit"} <= {p[0] for p in c["phases"]}, (r["mode"], c)
    # nothing of the checkpoints is left in the folder under test
    assert sorted(p.name for p in tmp_path.iterdir()) == ["training.json", "training.png"]
