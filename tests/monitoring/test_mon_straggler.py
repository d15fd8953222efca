"""Straggler detection and cross-rank aggregation, in one process."""

from __future__ import annotations

from bytecp.monitoring.aggregate import Aggregator, CheckpointAggregate, find_straggler
from monsynth import make_reports


def test_slow_write_is_named_not_the_ranks_that_waited_for_it() -> None:
    # Fast ranks sit in commit waiting for rank 2: long commits that are waits.
    st = find_straggler(make_reports(4, slow={(2, "write"): 1.5}))
    assert st is not None
    assert (st.rank, st.phase) == (2, "write")
    assert st.seconds > 1.5 and st.median_seconds < 0.4
    assert st.lag_seconds > 1.4


def test_two_ranks_the_mirror_wait_does_not_win() -> None:
    # With two ranks the waiting rank's commit excess mirrors the slow write
    # exactly; only finish times tell them apart.
    for rank in (0, 1):
        st = find_straggler(make_reports(2, slow={(rank, "write"): 1.0}))
        assert st is not None and (st.rank, st.phase) == (rank, "write")


def test_a_slow_early_phase_is_blamed_not_the_late_start_after_it() -> None:
    st = find_straggler(make_reports(8, slow={(5, "stage"): 0.9}))
    assert st is not None and (st.rank, st.phase) == (5, "stage")


def test_loads_and_a_slow_read() -> None:
    st = find_straggler(make_reports(3, operation="load", slow={(0, "read"): 0.7}))
    assert st is not None and (st.rank, st.phase) == (0, "read")


def test_one_rank_names_its_longest_phase_without_lag() -> None:
    st = find_straggler(make_reports(1, slow={(0, "plan"): 2.0}))
    assert st is not None
    assert (st.rank, st.phase, st.lag_seconds) == (0, "plan", 0.0)


def test_wait_phases_are_never_blamed() -> None:
    reps = make_reports(2)
    reps[1].spans.insert(0, type(reps[1].spans[0])("wait_previous", reps[1].started - 5, 5.0))
    st = find_straggler(reps)
    assert st is not None and st.phase != "wait_previous"


def test_aggregate_figures() -> None:
    reps = make_reports(4, slow={(1, "write"): 0.5}, failed_ranks=(3,))
    agg = CheckpointAggregate.from_reports(reps)
    assert agg.complete and not agg.ok
    assert agg.errors() == {3: "OSError: disk full"}
    assert agg.nbytes == 4 * (64 << 20)
    assert agg.retries == 1
    assert agg.max_stall_seconds == max(r.stall_seconds for r in reps)
    assert agg.duration == max(r.ended for r in reps) - min(r.started for r in reps)
    assert agg.throughput == agg.nbytes / agg.duration


def test_aggregator_finalizes_once_when_the_last_rank_reports() -> None:
    done: list[CheckpointAggregate] = []
    aggr = Aggregator(on_finalize=done.append)
    reps = make_reports(3)
    assert aggr.add(reps[0]) and aggr.add(reps[2])
    assert done == []
    assert not aggr.add(reps[0])  # duplicate
    assert aggr.add(reps[1])
    assert len(done) == 1 and done[0].complete
    assert aggr.expire(now=done[0].first_seen + 1e6) == []  # already final


def test_aggregator_gives_up_on_missing_ranks_after_the_grace_period() -> None:
    done: list[CheckpointAggregate] = []
    aggr = Aggregator(complete_after=30.0, on_finalize=done.append)
    reps = make_reports(4)
    aggr.add(reps[0])
    agg = aggr.get("ckpt-100")
    assert agg is not None
    assert aggr.expire(now=agg.first_seen + 29.0) == []
    assert aggr.expire(now=agg.first_seen + 31.0) == [agg]
    assert done == [agg] and not agg.complete


def test_list_and_get_newest_first_and_bounded() -> None:
    aggr = Aggregator(keep=3)
    for i in range(5):
        for r in make_reports(2, checkpoint_id=f"c{i}", url=f"file:///run/step-{i}", t0=1000.0 + i, step=i):
            aggr.add(r)
    assert [a.key.checkpoint_id for a in aggr.list()] == ["c4", "c3", "c2"]
    assert aggr.get("file:///run/step-3") is not None
    assert aggr.get("c0") is None  # evicted
    assert aggr.list(job="other") == []
    assert [a.key.checkpoint_id for a in aggr.list(limit=1)] == ["c4"]


def test_loading_one_checkpoint_twice_is_two_operations() -> None:
    done: list[CheckpointAggregate] = []
    aggr = Aggregator(on_finalize=done.append)
    for t0 in (1000.0, 2000.0):
        for r in make_reports(2, operation="load", t0=t0):
            assert aggr.add(r)
    assert len(done) == 2
    assert [a.started for a in aggr.list()] == [2000.0, 1000.0]


def test_median_of_the_other_ranks() -> None:
    from statistics import median

    from bytecp.monitoring.aggregate import _median_without

    for values in ([1.0], [1.0, 5.0], [3.0, 1.0, 2.0], [4.0, 4.0, 1.0, 9.0, 2.0], [0.5] * 6):
        ordered = sorted(values)
        for v in values:
            rest = list(values)
            rest.remove(v)
            assert _median_without(ordered, v) == (median(rest) if rest else v)


def test_memory_is_bounded_by_reports_too() -> None:
    aggr = Aggregator(keep=100, max_reports=10)
    for i in range(5):
        for r in make_reports(4, checkpoint_id=f"c{i}", t0=1000.0 + i):
            aggr.add(r)
    kept = aggr.list()
    assert [a.key.checkpoint_id for a in kept] == ["c4", "c3"]
    assert sum(len(a.reports) for a in kept) <= 10
