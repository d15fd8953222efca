"""Data loaders across a world-size change on real gloo ranks: torchdata's
``StatefulDataLoader`` saved with ``bytecp.save`` (or the manager) by W ranks
and loaded by W' ranks continues the uninterrupted run's global steps; a
position that cannot continue exactly is refused on every rank before
anything is loaded, or approximated when asked; and an FSDP2 training job
resumed 2 -> 3 trains on the uninterrupted run's samples at every step, its
loss following it."""

from __future__ import annotations

from pathlib import Path

import pytest

import bytecp

from . import data_cases

pytestmark = pytest.mark.timeout(600)

G = 12


def steps(per_rank: list[list[list[int]]]) -> list[tuple[int, ...]]:
    n = max(len(b) for b in per_rank)
    return [tuple(sorted(x for b in per_rank if k < len(b) for x in b[k])) for k in range(n)]


@pytest.mark.parametrize("old,new", [(2, 3), (3, 2), (4, 1), (1, 4)])
def test_the_global_steps_continue_across_world_sizes(pools, tmp_path: Path, old: int, new: int) -> None:
    url = str(tmp_path / "ck")
    saved = pools(old).run(data_cases.save_stream, url, G // old, 5)
    full = steps([r["before"] + r["after"] for r in saved])
    got = pools(new).run(data_cases.load_stream, url, G // new)
    for r in got:  # the RNG states restore rank r % W's, with the warning; nothing is said of the loader
        assert r["step"] == 5 and not any("dataloader" in w for w in r["warnings"]), r
    assert steps([r["after"] for r in got]) == full[5:]
    md = bytecp.load_state_dict(url)  # one process: rank 0's loader state; the merged position in metadata.json
    assert md["extra"]["dataloader"]["_num_yielded"] == 5


def test_workers_and_the_stateful_sampler_through_the_manager(pools, tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    saved = pools(2).run(data_cases.save_stream, "", 6, 4, workers=2, sampler="StatefulDistributedSampler",
                         epoch=2, run=run)
    full = steps([r["before"] + r["after"] for r in saved])
    got = pools(3).run(data_cases.load_stream, "", 4, workers=2, sampler="StatefulDistributedSampler", run=run)
    assert [r["epoch"] for r in got] == [2, 2, 2]  # the samplers were never told: the load set the saved epoch
    assert steps([r["after"] for r in got]) == full[4:]


def test_a_position_that_cannot_continue_is_refused_before_anything_is_loaded(pools, tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    pools(2).run(data_cases.save_stream, url, 5, 3)  # 30 samples: not a multiple of 4
    refused = pools(4).run(data_cases.load_stream, url, 3)
    for r in refused:
        assert r["type"] == "DistributedCheckpointError" and r["untouched"] and r["step"] == 0, r
        assert "'extra.dataloader'" in r["error"] and "2 sample(s) would be seen twice" in r["error"]
        assert "data_reshard='approximate'" in r["error"]
    got = pools(4).run(data_cases.load_stream, url, 3, mode="approximate")
    for r in got:
        assert r["step"] == 3 and any("2 sample(s) seen twice" in w for w in r["warnings"]), r
    drawn = [x for r in got for b in r["after"] for x in b]
    saved = pools(2).run(data_cases.save_stream, str(tmp_path / "again"), 5, 3)
    before = [x for r in saved for b in r["before"] for x in b]
    everything = before + drawn
    assert len(everything) - len(set(everything)) == 2 and set(everything) == set(range(data_cases.N))


def test_the_manager_refuses_rather_than_fall_back_to_an_older_checkpoint(pools, tmp_path: Path) -> None:
    """step-2 (20 samples: 5 for each of 4 ranks) would load; step-3 (30) does not divide among 4. The
    manager stops at step-3 (the error is not the checkpoint's fault) unless told to approximate."""
    run = str(tmp_path / "run")
    pools(2).run(data_cases.save_steps, run, 5, (2, 3))
    for r in pools(4).run(data_cases.load_stream, "", 3, run=run):
        assert "2 sample(s) would be seen twice" in r["error"] and r["step"] == 0 and r["untouched"], r
    for r in pools(4).run(data_cases.load_stream, "", 3, run=run, mode="approximate"):
        assert r["step"] == 3 and any("2 sample(s) seen twice" in w for w in r["warnings"]), r


@pytest.mark.slow
def test_fsdp2_training_resumed_2_to_3_follows_the_uninterrupted_run(pools, tmp_path: Path) -> None:
    """The same samples at every global step (exactly), hence the same loss
    (up to the rounding of reductions over another number of ranks); the
    old behaviour (each rank restoring saved rank r % 2's position) trains
    on other samples and departs from it."""
    run = str(tmp_path / "run")
    ref = pools(2).run(data_cases.fsdp2_train, run, G, 3, 8)
    got = pools(3).run(data_cases.fsdp2_train, run, G, 3, 8, resume=True)
    assert got[0]["start"] == 3
    want = [tuple(sorted(x for r in ref for x in r["ids"][k])) for k in range(3, 8)]
    have = [tuple(sorted(x for r in got for x in r["ids"][k])) for k in range(5)]
    assert have == want
    for a, b in zip(ref[0]["losses"][3:], got[0]["losses"], strict=True):
        assert abs(a - b) <= 1e-6 * max(1.0, abs(a)), (ref[0]["losses"], got[0]["losses"])
    old = pools(3).run(data_cases.fsdp2_train_as_before, run, G, 3, 8)[0]["losses"]
    # each rank resumed at 18 of its 32 samples: 6 of 96 samples skipped, the epoch one step short
    assert len(old) == 4 and any(abs(a - b) > 1e-3 for a, b in zip(ref[0]["losses"][3:7], old, strict=True))
