"""``bytecp monitor show``: the table and the timeline picture, from stored reports."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from bytecp.monitoring.cli import load_stored_reports, main
from bytecp.monitoring.timeline import STRAGGLER_COLOUR, TimelineLayout, render_timeline
from monsynth import make_reports

import bytecp


def _rgb(hex_colour: str) -> np.ndarray:
    return np.array([int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)], dtype=float) / 255.0


def _colours_on_row(img: np.ndarray, layout: TimelineLayout, rank: int) -> set[str]:
    """Which named colours (phases, straggler mark) appear along a rank's row."""
    row = img[layout.row_y[rank], :, :3]
    named = {**{p: c for p, c in layout.colours.items()}, "straggler": STRAGGLER_COLOUR}
    return {name for name, c in named.items() if (np.abs(row - _rgb(c)).max(axis=1) < 0.02).sum() >= 3}


def _store(tmp_path: Path, reports: list) -> str:  # type: ignore[type-arg]
    url = str(tmp_path / "step-100")
    (tmp_path / "step-100" / "reports").mkdir(parents=True)
    for r in reports:
        (tmp_path / "step-100" / "reports" / f"{r.rank}.json").write_text(json.dumps(r.to_json()))
    return url


def test_show_prints_the_table_and_draws_every_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = _store(tmp_path, make_reports(4, job="show", slow={(2, "write"): 1.2}))
    png = tmp_path / "timeline.png"
    assert main(["show", url, "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "straggler: rank 2 in write" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert rows[2][3].endswith("*") and "straggler" in rows[2][-1]

    # the CLI's picture, checked against where the renderer says things are
    layout = render_timeline(load_stored_reports(url), tmp_path / "again.png")
    import matplotlib.image

    img = matplotlib.image.imread(png)
    assert img.shape[:2] == (layout.height, layout.width)
    assert layout.width >= 1000 and layout.height >= 300
    assert layout.straggler == 2
    ys = [layout.row_y[r] for r in range(4)]
    assert ys == sorted(ys) and min(np.diff(ys)) > 20  # rank 0 on top, rows apart
    for rank in range(4):
        seen = _colours_on_row(img, layout, rank)
        assert {"plan", "stage", "write", "commit"} <= seen, (rank, seen)
        assert ("straggler" in seen) == (rank == 2), (rank, seen)
    # the straggler's write bar is long: blue where the other ranks are already committing
    x0, scale, t0 = layout.x_of
    far = int(x0 + 0.6 * scale)
    blue = _rgb(layout.colours["write"])
    assert np.abs(img[layout.row_y[2], far, :3] - blue).max() < 0.02
    assert np.abs(img[layout.row_y[0], far, :3] - blue).max() > 0.1


def test_show_a_real_single_process_save(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = str(tmp_path / "ckpt")
    bytecp.save(url, {"model": torch.nn.Linear(32, 32), "extra": {"step": 3}}, step=3)
    png = tmp_path / "one.png"
    assert main(["show", url, "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "1/1 ranks reported, ok" in out and "write" in out
    assert png.stat().st_size > 10_000
    assert main(["show", url, "--json"]) == 0
    [report] = json.loads(capsys.readouterr().out)
    assert report["operation"] == "save" and report["step"] == 3


def test_show_without_reports_says_where_it_looked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(tmp_path / "nothing")]) == 2
    assert "no reports stored" in capsys.readouterr().err


def test_serve_refuses_a_public_address_without_a_token(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--grpc", "0.0.0.0:0", "--metrics", "none"]) == 2
    assert "without a token" in capsys.readouterr().err


def test_show_reads_reports_through_any_storage_backend(capsys: pytest.CaptureFixture[str]) -> None:
    url = "memory://monitoring-show/step-9"
    bytecp.save(url, {"w": torch.arange(1000.0)}, step=9)
    assert main(["show", url]) == 0
    out = capsys.readouterr().out
    assert "save step 9" in out and "1/1 ranks reported" in out


def test_show_takes_the_storage_options_of_the_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--storage-options`` as for the other commands (an S3 checkpoint on
    another endpoint): they reach the storage, which checks them."""
    url = _store(tmp_path, make_reports(2, job="show"))
    assert main(["show", url, "--json", "--storage-options", '{"fsync": false}']) == 0
    assert len(json.loads(capsys.readouterr().out)) == 2
    assert main(["show", url, "--storage-options", '{"endpoint_url": "x"}']) == 2
    assert "unknown option(s) ['endpoint_url']" in capsys.readouterr().err
