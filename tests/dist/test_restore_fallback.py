"""CheckpointManager.restore on 2 ranks falls back past a checkpoint whose data
fail verification: every rank gets the same failure, skips the same
checkpoint and loads the same older one; strict mode raises everywhere."""

from __future__ import annotations

from pathlib import Path

from . import restore_cases


def test_every_rank_falls_back_to_the_same_checkpoint(pools, tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    pools(2).run(restore_cases.save, run, [1, 2])
    data = next((tmp_path / "run" / "step-2" / "data").rglob("*.bin"))
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    got = pools(2).run(restore_cases.restore, run)
    for r in got:
        assert r.get("step") == 1 and r["same"] and r["extra"] == {"step": 1}, r
        assert r["skipped"] == [f"{run}/step-2"], r
    strict = pools(2).run(restore_cases.restore, run, False)
    assert all("checksum mismatch" in r.get("error", "") for r in strict), strict
