"""torchdata's ``StatefulDataLoader`` resharded across world sizes, with the real
loaders (workers included), ranks simulated in one process (:mod:`tests.data.sim`).

The claim checked for every cell, from the epoch's order ``L`` (the sampler's
permutation, padded or cut as ``DistributedSampler`` does): the saved job
consumed ``L[0:C]``; after the resume the j-th global step holds exactly
``L[C + j*G' : C + (j+1)*G']`` (G' the new global batch) up to where the new
world size ends the epoch. With the global batch unchanged, that is the
uninterrupted run's step, observed independently; a difference at the
epoch's end (padding, a dropped remainder) is announced with its count.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from bytecp.adapters.data.torchdata import sampler_sizes

from bytecp.errors import DataReshardError

from .sim import Setup, _drain, resume, save_after, seen, steps_of, uninterrupted

TRANSITIONS = [(2, 3), (3, 2), (4, 1), (1, 4)]


def order(setup: Setup, total: int) -> list[int]:
    """The epoch's order: the sampler's permutation repeated (padding) or cut to ``total``."""
    if setup.shuffle:
        perm = torch.randperm(setup.n, generator=torch.Generator().manual_seed(setup.seed + setup.epoch)).tolist()
    else:
        perm = list(range(setup.n))
    return (perm * (total // setup.n + 2))[:total]


def epoch_end(setup: Setup, start_per_rank: int = 0) -> int:
    """Where ``setup``'s ranks end the epoch, having each consumed ``start_per_rank``."""
    per, _ = sampler_sizes(setup.n, setup.world, setup.drop_last)
    left = per - start_per_rank
    if setup.loader_drop_last:
        left = left // setup.batch * setup.batch
    return setup.world * (start_per_rank + left)


def expected_steps(new: Setup, consumed: int, per_rank: int) -> list[tuple[int, ...]]:
    end = epoch_end(new, per_rank)
    L = order(new, max(end, consumed) + new.n)
    g = new.world * new.batch
    return [tuple(sorted(L[i : min(i + g, end)])) for i in range(consumed, end, g)]


def check_cell(old: Setup, new: Setup, k: int) -> None:
    full = uninterrupted(old)
    saved = save_after(old, k)
    assert saved.steps == full[:k]
    consumed = sum(len(s) for s in saved.steps)
    rest, notes = resume(saved, new)
    assert rest == expected_steps(new, consumed, consumed // new.world)
    if new.world * new.batch == old.world * old.batch:  # the uninterrupted run's own steps, seen independently
        assert rest[:-1] == full[k:len(rest) + k - 1]
        if len(rest) == len(full) - k:
            assert rest[-1] == full[-1] or notes
    tail_differs = epoch_end(new, consumed // new.world) != epoch_end(old)
    assert bool(notes) == tail_differs, notes
    if notes:
        assert "the epoch ends as" in notes[0] and "'dataloader'" in notes[0]
    # each new rank read one saved rank's state (the seeds), whatever the saved world size
    assert len(saved.reads) == new.world


@pytest.mark.parametrize("old_w,new_w", TRANSITIONS)
@pytest.mark.parametrize("sampler", ["DistributedSampler", "StatefulDistributedSampler"])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("epoch", [0, 3])
def test_same_global_batch_continues_step_by_step(old_w: int, new_w: int, sampler: str, shuffle: bool,
                                                  drop_last: bool, epoch: int) -> None:
    """Global batch 12 on every world size; 144 samples (no padding) and 100 (padding or cut)."""
    for n in (144, 100):
        old = Setup(world=old_w, batch=12 // old_w, n=n, sampler=sampler, shuffle=shuffle, drop_last=drop_last,
                    loader_drop_last=drop_last, epoch=epoch)
        check_cell(old, old.with_(world=new_w, batch=12 // new_w), k=5)


@pytest.mark.spawn  # loader worker processes
@pytest.mark.parametrize("old_w,new_w", TRANSITIONS)
@pytest.mark.parametrize("sampler", ["DistributedSampler", "StatefulDistributedSampler"])
def test_workers_with_prefetch_in_flight(old_w: int, new_w: int, sampler: str) -> None:
    """Two workers prefetching two batches each at the save; the new job's
    loaders have workers too (and, in one cell each, none: another reshard)."""
    old = Setup(world=old_w, batch=12 // old_w, sampler=sampler, workers=2, epoch=1)
    check_cell(old, old.with_(world=new_w, batch=12 // new_w), k=4)
    check_cell(old, old.with_(world=new_w, batch=12 // new_w, workers=0 if new_w < old_w else 1), k=3)


@pytest.mark.parametrize("old_w,new_w", TRANSITIONS)
def test_another_global_batch_sees_each_sample_once(old_w: int, new_w: int) -> None:
    """The per-rank batch kept: the global batch changes with the world size."""
    for n, drop in ((144, False), (100, False), (100, True)):
        old = Setup(world=old_w, batch=3, n=n, drop_last=drop)
        saved = save_after(old, 4)
        consumed = sum(len(s) for s in saved.steps)
        new = old.with_(world=new_w)
        rest, _ = resume(saved, new)
        assert rest == expected_steps(new, consumed, consumed // new_w)
        end = epoch_end(new, consumed // new_w)
        assert seen(saved.steps + rest) == sorted(order(old, end))
        if not drop and n == 144:
            assert seen(saved.steps + rest) == list(range(n))


def test_the_same_layout_restores_each_rank_as_saved() -> None:
    from bytecp.data.restore import restore_data

    saved = save_after(Setup(world=2, batch=6), 3)
    for r, dl in enumerate([__import__("tests.data.sim", fromlist=["make"]).make(saved.setup, r) for r in range(2)]):
        assert restore_data("dataloader", dl, saved.record, 2, r, 2, saved.read, "exact") is None
    assert saved.reads == []


@pytest.mark.spawn  # loader worker processes
def test_workers_changed_at_the_same_world_size_reshard() -> None:
    old = Setup(world=2, batch=6, workers=2)
    check_cell(old, old.with_(workers=0), k=3)
    old = Setup(world=2, batch=6)
    check_cell(old, old.with_(workers=2), k=3)


def test_a_later_epoch_and_a_sampler_left_at_epoch_0() -> None:
    """The new job's samplers were never told the epoch: the load sets the saved one."""
    old = Setup(world=2, batch=6, epoch=4)
    saved = save_after(old, 5)
    epochs: list[int] = []
    rest, _ = resume(saved, old.with_(world=3, batch=4, epoch=0),
                     check=lambda loaders: epochs.extend(dl.sampler.epoch for dl in loaders))
    assert epochs == [4, 4, 4]
    assert rest == uninterrupted(old)[5:]


def test_a_finished_epoch_starts_the_next_one_whole() -> None:
    old = Setup(world=2, batch=6, n=48)
    saved = save_after(old, 10)  # past the epoch's 4 steps: the loaders hit StopIteration
    assert saved.record["common"]["finished"] is True
    rest, _ = resume(saved, old.with_(world=3, batch=4))
    assert seen(rest) == list(range(48))


def test_consumed_samples_that_do_not_divide_are_refused_or_approximated() -> None:
    old = Setup(world=2, batch=5)
    saved = save_after(old, 3)  # 30 samples; 4 ranks would take 7.5 each
    new = old.with_(world=4, batch=5)
    with pytest.raises(DataReshardError) as e:
        resume(saved, new)
    msg = str(e.value)
    assert "\n" not in msg and "'dataloader'" in msg and "2 sample(s) would be seen twice" in msg
    assert "30 samples of epoch 0 consumed by 2 data-parallel ranks" in msg and "data_reshard='approximate'" in msg
    assert e.value.repeat == 2
    rest, notes = resume(saved, new, mode="approximate")
    assert any("2 sample(s) seen twice" in n for n in notes)
    everything = seen(saved.steps + rest)
    assert len(everything) - len(set(everything)) == 2 and set(everything) == set(range(old.n))


def test_an_approximated_resume_also_names_the_padded_epoch_end() -> None:
    """4 -> 3 ranks, 20 of 200 samples consumed (not dividing among 3) and an
    epoch 3 ranks pad to 201: the approximate load names both the 2 samples
    seen twice and the padded end (the note exact loads give was dropped)."""
    saved = save_after(Setup(world=4, batch=5, n=200), 1)
    _, notes = resume(saved, Setup(world=3, batch=5, n=200), mode="approximate")
    assert len(notes) == 3 and "2 sample(s) seen twice" in notes[0], notes
    assert "the epoch ends as 3 data-parallel ranks end it: 201 samples in all, 1 more" in notes[0], notes


def test_torch_batch_sampler_fast_forwards_by_whole_batches() -> None:
    old = Setup(world=2, batch=6, torch_batch_sampler=True)
    check_cell(old, old.with_(world=3, batch=4), k=5)  # 60 samples: 20 per rank, 5 batches of 4
    saved = save_after(old, 5)
    with pytest.raises(DataReshardError, match=r"6 sample\(s\) would be seen twice") as e:
        resume(saved, old.with_(world=3, batch=6))  # 20 per rank is not whole batches of 6
    assert e.value.repeat == 6


def test_ranks_at_different_positions_resume_at_the_slowest_only_when_asked() -> None:
    saved = save_after(Setup(world=2, batch=6), 4)
    col = saved.record
    # rank 1 one batch further on (as a job whose ranks stopped apart would record it)
    col["varying"]["samples"] = [24, 30]
    del col["common"]["samples"]
    saved.states[1] = save_after(Setup(world=2, batch=6), 5).states[1]
    with pytest.raises(DataReshardError, match=r"stopped at different positions \(24 to 30 samples each; resuming "
                                               r"at the slowest, 6 sample\(s\) would be seen twice\)"):
        resume(saved, Setup(world=3, batch=4))
    _, notes = resume(saved, Setup(world=3, batch=4), mode="approximate")
    assert notes


def test_a_changed_dataset_or_seed_is_refused() -> None:
    saved = save_after(Setup(world=2, batch=6), 3)
    with pytest.raises(DataReshardError, match=r"data order changed \(dataset_len 144 saved, 150 here\)"):
        resume(saved, Setup(world=3, batch=4, n=150))
    with pytest.raises(DataReshardError, match=r"seed 7 saved, 8 here"):
        resume(saved, Setup(world=3, batch=4, seed=8))


@pytest.mark.parametrize("change", [{"seed": 8}, {"n": 150}, {"shuffle": False}, {"drop_last": True}])
def test_a_changed_data_order_at_the_same_world_size_is_refused_too(change: dict[str, object]) -> None:
    """Same ranks, same batch, another seed (or dataset length, shuffle,
    drop_last): each rank's saved state restored as it is skipped and
    repeated samples without a word; now refused as at another world size,
    and restored as saved (with the warning) only when asked."""
    old = Setup(world=2, batch=6, shuffle=True)
    saved = save_after(old, 3)
    with pytest.raises(DataReshardError, match=r"'dataloader'.*data order changed .* data_reshard='approximate'"):
        resume(saved, old.with_(**change))
    _, notes = resume(saved, old.with_(**change), mode="approximate")
    assert len(notes) == 2 and all("data order changed" in n for n in notes)


@pytest.mark.parametrize("n,old_w,new_w", [(200, 4, 3), (48, 2, 3), (50, 2, 4)])
def test_a_save_after_the_epochs_last_batch_resumes_at_the_next_epoch(n: int, old_w: int, new_w: int) -> None:
    """The save lands on the epoch's last step (every sample consumed, the
    loop has not yet seen StopIteration): on ranks that would pad the epoch
    (4 -> 3 of 200: 201 positions) the rest is padding only, so the epoch is
    over -- it was refused ('200 samples ... do not divide among 3'). The
    next epoch then comes whole, no note of the padding."""
    old = Setup(world=old_w, batch=2, n=n, shuffle=True)
    per, _ = sampler_sizes(n, old_w, False)
    saved = save_after(old, per // 2 + per % 2)  # each rank's last batch taken
    assert saved.record["common"]["finished"] is False
    assert sorted(set(seen(saved.steps))) == list(range(n))
    loaders: list[Any] = []
    rest, notes = resume(saved, old.with_(world=new_w), check=loaders.extend)
    assert rest == [] and notes == []  # nothing left of epoch 0, nothing seen twice
    for dl in loaders:  # the training loop's next epoch
        dl.sampler.set_epoch(1)
    assert steps_of([_drain(iter(dl)) for dl in loaders]) == uninterrupted(old.with_(world=new_w, epoch=1))


@pytest.mark.parametrize("kw,new_w", [
    ({"world": 4, "batch": 5, "n": 200, "torch_batch_sampler": True}, 3),  # torch's BatchSampler: whole batches
    ({"world": 2, "batch": 5, "n": 48, "torch_batch_sampler": True}, 3),  # its last batch partial
    ({"world": 2, "batch": 5, "n": 51, "drop_last": True}, 3),  # the sampler cut 1: the new ranks would not
    ({"world": 4, "batch": 6, "n": 200, "loader_drop_last": True}, 5),  # the loader left 2 of each rank out
])
def test_an_epoch_ended_by_its_last_batch_in_other_batchings(kw: dict[str, Any], new_w: int) -> None:
    """Every batch the saved loaders would yield in the epoch was taken: the
    epoch is over on the new ranks too -- nothing yielded again (torch's
    BatchSampler skips whole batches: the last partial one was yielded
    twice), nothing refused (what a drop_last left out, the uninterrupted
    run never saw), no note -- and the next epoch comes whole."""
    old = Setup(**kw)  # type: ignore[arg-type]
    full = uninterrupted(old)
    saved = save_after(old, len(full))
    assert saved.record["common"]["finished"] is False
    loaders: list[Any] = []
    rest, notes = resume(saved, old.with_(world=new_w), check=loaders.extend)
    assert rest == [] and notes == [], (rest, notes)
    for dl in loaders:
        dl.batch_sampler.sampler.set_epoch(1)  # (the DistributedSampler, under either batch sampler)
    assert steps_of([_drain(iter(dl)) for dl in loaders]) == uninterrupted(old.with_(world=new_w, epoch=1))


def test_a_finished_epoch_continues_whole_in_a_new_order_at_any_world_size() -> None:
    """Saved once the loop saw StopIteration, then the dataset grew (or the
    seed changed): the next epoch comes whole in the new order, at the same
    world size and another (refusing it said samples would repeat or be
    skipped, and none would)."""
    old = Setup(world=2, batch=6, n=144)
    saved = save_after(old, 100)  # past the epoch's 12 steps: the loaders hit StopIteration
    assert saved.record["common"]["finished"] is True
    for new in (old.with_(n=150), old.with_(seed=8), old.with_(world=3, batch=4, n=150)):
        rest, notes = resume(saved, new)
        assert rest == uninterrupted(new) and notes == [], new


def test_padding_note_counts_the_difference() -> None:
    old = Setup(world=2, batch=6, n=100)  # 2 ranks: 100 samples; 3 ranks pad to 102
    saved = save_after(old, 5)
    _, notes = resume(saved, old.with_(world=3, batch=4))
    assert len(notes) == 3 and len(set(notes)) == 1  # every rank warns alike
    assert "102 samples in all, 2 more than the uninterrupted run on 2 ranks (100)" in notes[0]


def test_position_is_compact_and_names_the_epoch_and_samples() -> None:
    saved = save_after(Setup(world=4, batch=3, epoch=2, workers=0), 5)
    rec = saved.record
    assert rec["ranks"] is None and rec["varying"] == {}
    c = rec["common"]
    assert (c["kind"], c["sampler"], c["epoch"], c["samples"], c["dp_size"], c["batch_size"]) == (
        "torchdata", "DistributedSampler", 2, 15, 4, 3)
    assert math.isclose(c["samples"] * c["dp_size"], 60)


@pytest.mark.parametrize("sampler", ["DistributedSampler", "StatefulDistributedSampler"])
def test_unbatched_loaders_reshard_by_samples(sampler: str) -> None:
    """``batch_size=None``: each step is one sample per rank; 2 -> 3 after 12 steps (24 samples: 8 each)."""
    old = Setup(world=2, batch=1, n=60, sampler=sampler, unbatched=True)
    saved = save_after(old, 12)
    assert saved.record["common"]["batching"] == "none" and saved.record["common"]["samples"] == 12
    rest, _ = resume(saved, old.with_(world=3))
    assert seen(saved.steps + rest) == list(range(60))
    assert rest == expected_steps(old.with_(world=3), 24, 8)
