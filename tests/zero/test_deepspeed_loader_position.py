"""A DeepSpeed engine's training loader (the real ``DeepSpeedDataLoader`` over
torch's ``DistributedSampler``, as ``deepspeed.initialize(training_data=...)``
builds it) saved and resumed across data-parallel sizes, ranks simulated in
one process: each rank's position as the adapter records it
(:class:`bytecp.adapters.deepspeed.data.LoaderPosition`), the commit's
merge, each new rank's load decision (:func:`bytecp.data.restore.restore_data`),
then what the resumed loaders yield. The engine on gloo ranks is tested in
``test_deepspeed_adapter.py``."""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

import pytest

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed (make test installs it)", allow_module_level=True)
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from bytecp.adapters.deepspeed.data import LoaderPosition  # noqa: E402
from deepspeed.runtime.dataloader import DeepSpeedDataLoader  # noqa: E402
from torch.utils.data import DistributedSampler  # noqa: E402

from bytecp.data import position_of  # noqa: E402
from bytecp.data.positions import merge_positions  # noqa: E402
from bytecp.data.restore import restore_data  # noqa: E402
from bytecp.errors import DataReshardError  # noqa: E402

N = 144


def loader(world: int, rank: int, mbs: int, *, n: int = N, drop_last: bool = False, epoch: int = 1
           ) -> DeepSpeedDataLoader:
    data = list(range(n))
    s = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=5, drop_last=drop_last)
    s.set_epoch(epoch)
    return DeepSpeedDataLoader(data, batch_size=mbs, pin_memory=False, local_rank=rank, tput_timer=None,
                               num_local_io_workers=0, data_sampler=s, data_parallel_world_size=world,
                               data_parallel_rank=rank)


def steps(loaders: list[DeepSpeedDataLoader], k: int | None = None, *, fresh: bool = True) -> list[list[int]]:
    """The next ``k`` global steps (else to the epoch's end), samples sorted."""
    its = [iter(dl) if fresh else dl for dl in loaders]
    out: list[list[int]] = []
    while k is None or len(out) < k:
        got = []
        for it in its:
            try:
                got += [int(x) for x in next(it)]
            except StopIteration:
                pass
        if not got:
            break
        out.append(sorted(got))
    return out


def save(world: int, mbs: int, k: int, **kw: Any) -> tuple[dict[str, Any], list[Any], list[list[int]], list[Any]]:
    """``world`` ranks draw ``k`` steps and save; -> (record, states, their steps, the loaders)."""
    loaders = [loader(world, r, mbs, **kw) for r in range(world)]
    before = steps(loaders, k)
    states = [json.loads(json.dumps(LoaderPosition(dl).state_dict())) for dl in loaders]
    texts = {r: json.dumps(position_of(LoaderPosition(dl), st), sort_keys=True)
             for r, (dl, st) in enumerate(zip(loaders, states, strict=True))}
    return merge_positions(texts, world), states, before, loaders


def resume(record: dict[str, Any], states: list[Any], saved_world: int, world: int, mbs: int, mode: str = "exact",
           **kw: Any) -> tuple[list[list[int]], list[str]]:
    loaders, notes = [loader(world, r, mbs, **{**kw, "epoch": 0}) for r in range(world)], []
    for r, dl in enumerate(loaders):
        live = LoaderPosition(dl)
        got = restore_data("training_dataloader", live, record, saved_world, r, world, lambda s: states[s], mode)
        state = states[r] if got is None else states[r % saved_world] if got.as_saved else got.value
        notes += [got.warning] if got is not None and got.warning else []
        live.load_state_dict(state)
    return steps(loaders), notes


@pytest.mark.parametrize("old,new", [(2, 3), (3, 2), (4, 1), (1, 4), (2, 2)])
def test_the_global_steps_continue(old: int, new: int) -> None:
    """Global batch 12 both sides, epoch 1 (the load sets it): every later step is the uninterrupted run's."""
    full = steps([loader(old, r, 12 // old) for r in range(old)])
    record, states, before, _ = save(old, 12 // old, 5)
    assert before == full[:5]
    rest, notes = resume(record, states, old, new, 12 // new)
    assert rest == full[5:] and not notes


def test_another_global_batch_reads_each_sample_once_and_saves_again() -> None:
    """12 -> 18 per step (2 ranks of 6 -> 3 of 6), saved again mid-way and resumed on 2: each sample once."""
    record, states, before, _ = save(2, 6, 4)
    loaders = [loader(3, r, 6, epoch=0) for r in range(3)]
    for r, dl in enumerate(loaders):
        got = restore_data("training_dataloader", LoaderPosition(dl), record, 2, r, 3, lambda s: states[s], "exact")
        assert got is not None
        LoaderPosition(dl).load_state_dict(got.value)
    middle = steps(loaders, 2)  # the resumed iteration (skip included) is what the next save counts
    again = [json.loads(json.dumps(LoaderPosition(dl).state_dict())) for dl in loaders]
    assert {s["samples"] for s in again} == {48 // 3 + 12}  # the skip and two batches of 6
    texts = {r: json.dumps(position_of(LoaderPosition(dl), st), sort_keys=True)
             for r, (dl, st) in enumerate(zip(loaders, again, strict=True))}
    rest, _ = resume(merge_positions(texts, 3), again, 3, 2, 9)
    seen = [x for s in before + middle + rest for x in s]
    assert sorted(seen) == list(range(N))


def test_counts_that_do_not_divide_and_ranks_apart() -> None:
    record, states, before, _ = save(2, 5, 3)  # 30 samples: not a multiple of 4
    with pytest.raises(DataReshardError, match=r"30 samples of epoch 1 consumed by 2 data-parallel ranks do not "
                                               r"divide among 4 \(2 sample\(s\) would be seen twice\)"):
        resume(record, states, 2, 4, 3)
    rest, notes = resume(record, states, 2, 4, 3, mode="approximate")
    seen = [x for s in before + rest for x in s]
    assert len(seen) - len(set(seen)) == 2 and set(seen) == set(range(N)) and "approximate" in notes[0]
    # one rank a step ahead of the other: resumed at the slowest, the difference named
    loaders = [loader(2, r, 6) for r in range(2)]
    its = [iter(dl) for dl in loaders]
    for _ in range(3):
        next(its[0])
    for _ in range(2):
        next(its[1])
    sts = [LoaderPosition(dl).state_dict() for dl in loaders]
    texts = {r: json.dumps(position_of(LoaderPosition(dl), st), sort_keys=True)
             for r, (dl, st) in enumerate(zip(loaders, sts, strict=True))}
    with pytest.raises(DataReshardError, match="stopped at different positions"):
        resume(merge_positions(texts, 2), sts, 2, 3, 4)


def test_the_epoch_end_and_its_warning() -> None:
    """100 samples: 2 ranks end at 100, 3 pad to 102 (DistributedSampler): the load says so."""
    record, states, _, _ = save(2, 5, 6, n=100)  # 60 consumed: divides among 3 and 4
    _, notes = resume(record, states, 2, 4, 5, n=100)
    assert not notes  # 4 divides 100
    _, notes = resume(record, states, 2, 3, 5, n=100)
    assert len(notes) == 3 and "epoch 1 ends as 3 data-parallel ranks end it: 102 samples, 2 more" in notes[0]


def test_a_finished_epoch_and_another_order() -> None:
    record, states, _, loaders = save(2, 6, 12)
    steps(loaders, fresh=False)  # the iterators run out
    done = [LoaderPosition(dl).state_dict() for dl in loaders]
    assert all(d["finished"] and d["samples"] == 72 for d in done)
    with pytest.raises(DataReshardError, match="the data order changed"):
        resume(record, states, 2, 3, 4, n=120)


def test_the_same_ranks_with_another_order_are_refused_too() -> None:
    """2 ranks saved, 2 load with another dataset length: restored as saved
    it skipped and repeated samples silently; refused as at another size."""
    record, states, _, _ = save(2, 6, 3)
    with pytest.raises(DataReshardError, match="the data order changed"):
        resume(record, states, 2, 2, 6, n=150)
    _, notes = resume(record, states, 2, 2, 6, mode="approximate", n=150)
    assert len(notes) == 2 and "data order changed" in notes[0]


def test_a_save_after_the_epochs_last_batch_resumes_at_the_next_epoch() -> None:
    """50 samples: 2 ranks consumed all 50 (the loop has not seen StopIteration
    yet); 4 ranks would pad the epoch to 52: the rest is padding, the epoch is
    over (it was refused as 50 not dividing among 4), nothing seen again."""
    record, states, before, _ = save(2, 5, 5, n=50)
    assert sorted(x for s in before for x in s) == list(range(50))
    rest, notes = resume(record, states, 2, 4, 5, n=50)
    assert rest == [] and notes == []


def test_an_approximated_resume_names_the_padded_end_and_a_finished_epoch_takes_a_new_order() -> None:
    """100 samples, 2 ranks took 30 each (60: not dividing among 7, an epoch 7
    ranks pad to 105): the approximate load names both; an epoch that had
    ended (StopIteration) continues whole with a grown dataset, at any size."""
    record, states, _, _ = save(2, 5, 6, n=100)
    _, notes = resume(record, states, 2, 7, 5, mode="approximate", n=100)
    assert "sample(s) seen twice" in notes[0] and "ends as 7 data-parallel ranks end it: 105 samples" in notes[0]
    record, states, _, loaders = save(2, 6, 12)
    steps(loaders, fresh=False)  # the iterators run out
    done = [json.loads(json.dumps(LoaderPosition(dl).state_dict())) for dl in loaders]
    texts = {r: json.dumps(position_of(LoaderPosition(dl), st), sort_keys=True)
             for r, (dl, st) in enumerate(zip(loaders, done, strict=True))}
    finished = merge_positions(texts, 2)
    for world in (2, 3):
        rest, notes = resume(finished, done, 2, world, 6, n=150)
        assert sorted(x for s in rest for x in s)[:150] == list(range(150)) and notes == [], world
