"""The torchtitan benchmark's arithmetic (its runs need torchtitan's trainer
on 2 processes; the trainer-level behaviour is tested in
tests/integrations/test_torchtitan.py)."""

from __future__ import annotations

import pytest

from benchmarks.torchtitan_bench import CASES, _added, summarize, table


def test_a_checkpoint_costs_its_step_and_the_next_against_clean_steps() -> None:
    loop = [1.0] * 13  # steps 1..13 of a 14-step run, a checkpoint every 3 steps
    loop[3 - 1] += 0.5  # the save at step 3
    loop[4 - 1] += 0.25  # its copy overlapping step 4 (lazy)
    loop[5 - 1] += 9.0  # a noisy clean step does not move the median baseline
    added, base = _added(loop, 14, 3)
    assert base == 1.0 and added == [0.75, 0.0, 0.0, 0.0]


def test_summary_rows_and_table() -> None:
    results = {f"{i}:{r}": {"loop_s": [1.0] * 13, "save_s": [0.1] if i else []}
               for i in range(len(CASES)) for r in range(2)}
    rows = summarize(results, 14, 3, 2)
    assert [r["case"] for r in rows] == [c[0] for c in CASES]
    assert rows[0]["checkpoints"] == 0 and rows[1]["checkpoints"] == 8
    assert rows[1]["added_per_checkpoint_s"] == pytest.approx(0.0) and rows[1]["save_call_s"] == 0.1
    assert "| bytecp, lazy | 0.000 |" in table(rows, 14, 3)
