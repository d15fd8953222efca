"""Many loads at once under contention, every tensor compared bitwise with
what was saved (not only checksums): resharded reads (parts of chunks, checked
block by block) and whole-chunk loads with two entries sharing memory, beside
async saves reusing their arena, with thread switches every microsecond,
eight reader threads per load, tiny read batches, random delays at every
hand-off and reused buffers poisoned on release. The race of the Megatron
fp32 model and its optimizer's mains failed here within a few loads (the
reader before the fix: every thread's first whole load, "checksum mismatch
in tensor 'model.w'"). Its long form, several processes at once: ``python -m
benchmarks.load_stress``."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.load_stress import stress

pytestmark = pytest.mark.timeout(180)


def test_loads_under_contention_are_bitwise(tmp_path: Path) -> None:
    report = stress(tmp_path, threads=4, seconds=3.0)
    assert not report.failures, "\n".join(report.failures[:10])
    assert report.resharded >= 8 and report.whole >= 4 and report.saves >= 1, report
