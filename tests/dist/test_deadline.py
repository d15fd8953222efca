"""Every save has a deadline (``save_timeout_s``): a rank stuck past it (a
storage call that does not return, a process stopped by SIGSTOP) fails the
save on every other rank within the deadline plus the roll call, named,
never commits, leaves no files; and once it is back, the next save of every
rank commits (on a new checkpoint group)."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from bytecp.dist import DistContext

from . import deadline_cases
from .conftest import discard_pool

pytestmark = pytest.mark.timeout(300)

TIMEOUT = 3.0
#: the deadline, the survivors' roll call and some slack for a loaded 2-core machine
WITHIN = TIMEOUT + DistContext.ROLL_CALL_SECONDS + 4.0


@pytest.mark.parametrize("lazy", [None, False, True], ids=["sync", "eager", "lazy"])
def test_a_rank_stuck_in_its_write_fails_the_save_on_every_rank_by_the_deadline(pools, tmp_path: Path,
                                                                                 lazy: bool | None) -> None:
    pool = pools(2)
    url = str(tmp_path / "ck")
    (msg0, t0), (msg1, t1) = pool.run(deadline_cases.timed_save, url, TIMEOUT, "write:1:9", lazy, timeout=120)
    assert "rank 1" in msg0 and "deadline" in msg0, msg0  # named by the rank that waited
    assert t0 < WITHIN, t0
    assert msg1 != "committed" and t1 >= 9  # the stuck rank fails too once it is back, never commits
    assert not (tmp_path / "ck" / "metadata.json").exists()
    assert [f for f in pool.run(deadline_cases.leftovers, url)[0] if f.startswith("data/")] == []
    ok = pool.run(deadline_cases.timed_save, str(tmp_path / "next"), 60.0, None, lazy, timeout=120)
    assert [m for m, _ in ok] == ["committed", "committed"]


def test_a_stopped_rank_is_named_and_the_job_saves_again_once_it_continues(pools, tmp_path: Path) -> None:
    """SIGSTOP, as an OS or a debugger stops a process: the other rank's save
    fails by the deadline naming it; after SIGCONT both save again."""
    pool = pools(2)
    victim = pool.run(deadline_cases.pid)[1]
    stop = threading.Timer(0.3, os.kill, (victim, signal.SIGSTOP))
    resume = threading.Timer(0.3 + TIMEOUT + DistContext.ROLL_CALL_SECONDS + 3.0, os.kill, (victim, signal.SIGCONT))
    stop.start()
    resume.start()
    try:
        # a delay on rank 1 keeps the save in flight when the stop lands
        got = pool.run(deadline_cases.timed_save, str(tmp_path / "ck"), TIMEOUT, "plan:1:1.0", None, timeout=120)
    finally:
        stop.join()
        resume.join()
        os.kill(victim, signal.SIGCONT)
    (msg0, t0), (msg1, _) = got
    assert "rank 1" in msg0 and "deadline" in msg0, msg0
    assert t0 < WITHIN, t0
    assert msg1 != "committed"
    assert not (tmp_path / "ck" / "metadata.json").exists()
    ok = pool.run(deadline_cases.timed_save, str(tmp_path / "next"), 60.0, timeout=120)
    assert [m for m, _ in ok] == ["committed", "committed"]


def test_a_rank_stopped_during_a_load_is_named_by_every_other_rank_by_the_deadline(pools, tmp_path: Path) -> None:
    """load_timeout_s: the same machinery as a save's deadline. Rank 1 is
    SIGSTOPped in the middle of a load; rank 0's load fails within the
    deadline plus the roll call, naming rank 1 and the option; rank 1, once
    continued, fails too (it reached the step after the deadline)."""
    pool = pools(2)
    url = str(tmp_path / "ck")
    assert [m for m, _ in pool.run(deadline_cases.timed_save, url, 60.0, timeout=120)] == ["committed"] * 2
    assert [m for m, _ in pool.run(deadline_cases.timed_load, url, 60.0, timeout=120)] == ["loaded"] * 2
    victim = pool.run(deadline_cases.pid)[1]
    stop = threading.Timer(0.3, os.kill, (victim, signal.SIGSTOP))
    resume = threading.Timer(0.3 + TIMEOUT + DistContext.ROLL_CALL_SECONDS + 3.0, os.kill, (victim, signal.SIGCONT))
    stop.start()
    resume.start()
    try:
        got = pool.run(deadline_cases.timed_load, url, TIMEOUT, "match:1:1.0", timeout=120)
    finally:
        stop.join()
        resume.join()
        os.kill(victim, signal.SIGCONT)
        discard_pool(2)  # the load ran on the job's group, now out of step: restart the job (the guide)
    (msg0, t0), (msg1, _) = got
    assert "rank 1" in msg0 and "load_timeout_s" in msg0 and "load/" in msg0, msg0
    assert t0 < WITHIN, t0
    assert msg1 != "loaded" and "load_timeout_s" in msg1, msg1


def test_a_one_process_load_past_its_deadline_stops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import bytecp

    bytecp.save(str(tmp_path / "ck"), {"x": deadline_cases.torch.ones(8)})
    monkeypatch.setenv("BYTECP_FAULT_DELAY", "match:0:0.6")
    with pytest.raises(TimeoutError, match="load_timeout_s"):
        bytecp.load_state_dict(str(tmp_path / "ck"), load_timeout_s=0.3)


@pytest.mark.parametrize(("behind", "async_save"), [(0, False), (1, True)], ids=["coordinator-behind-sync",
                                                                              "rank1-behind-async"])
def test_ranks_a_save_apart_come_back_into_step(pools, tmp_path: Path, behind: int, async_save: bool) -> None:
    """Ranks whose collectives paired a save apart (the chaos run: a stalled
    coordinator committed after the others gave up) realign by the votes'
    steps: the rank behind skips its save, named, the others wait for its next
    one, and every later save commits and loads bitwise."""
    pool = pools(2)
    run = str(tmp_path / "run")
    got = pool.run(deadline_cases.saves_apart, run, behind, 60.0, async_save, timeout=180)
    late, ahead = got[behind], got[1 - behind]
    assert late[0][0] == 1 and "a save behind" in late[0][1] and "step 2" in late[0][1], late
    assert late[1:] == [(2, "committed"), (3, "committed"), (4, "committed")], late
    assert ahead == [(2, "committed"), (3, "committed"), (4, "committed")], ahead
    assert sorted(p.parent.name for p in Path(run).glob("*/metadata.json")) == ["step-2", "step-3", "step-4"]
    assert pool.run(deadline_cases.leftovers, f"{run}/step-1")[0] == []  # the skipped save wrote nothing
    assert [m for m, _ in pool.run(deadline_cases.timed_load, f"{run}/step-4", 60.0)] == ["loaded", "loaded"]
