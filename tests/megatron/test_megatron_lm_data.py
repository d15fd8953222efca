"""Megatron-LM's data position (``MegatronLMData``) across a data-parallel
size change, ranks simulated in one process: every saving rank records its
position exactly as the adapters do, the commit's merge, then each loading
rank's decision (:func:`bytecp.data.restore.restore_data`) over the merged
record; the restored ``args.consumed_train_samples`` then drives Megatron-LM's
sampler rules (:mod:`lm_samplers`), and what they read is checked against
the uninterrupted run. No Megatron import is needed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from bytecp.adapters.megatron import MegatronLMData

from bytecp.data import position_of
from bytecp.data.positions import merge_positions, summary
from bytecp.data.restore import restore_data
from bytecp.errors import DataReshardError

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lm_samplers import Job, args_of, global_steps, rank_batches  # noqa: E402

TP = 2  # every data-parallel rank is TP ranks: the world is dp * TP


def save(job: Job, consumed: int, *, loader_len: bool = True) -> tuple[dict[str, Any], list[Any]]:
    """Every rank of ``job`` (dp x TP) records its position and counters; -> (merged record, states)."""
    world = job.dp * TP
    objs = [MegatronLMData(args_of(job, consumed), total_samples=job.n if loader_len else None) for _ in range(world)]
    states = [o.state_dict() for o in objs]
    texts = {r: json.dumps(position_of(o, s), sort_keys=True) for r, (o, s) in enumerate(zip(objs, states, strict=True))}
    return merge_positions(texts, world), states


def load(job: Job, record: dict[str, Any], states: list[Any], saved_world: int, mode: str = "exact"
         ) -> tuple[list[int], list[str], list[int]]:
    """Every rank of ``job`` loads; -> (each rank's restored consumed count, warnings, saved ranks read)."""
    world, reads, notes, out = job.dp * TP, [], [], []

    def read(r: int) -> Any:
        reads.append(r)
        return json.loads(json.dumps(states[r]))

    for rank in range(world):
        args = args_of(job)
        live = MegatronLMData(args, total_samples=job.n)
        got = restore_data("data", live, record, saved_world, rank, world, read, mode)
        state = read(rank) if got is None else read(rank % saved_world) if got.as_saved else got.value
        notes += [got.warning] if got is not None and got.warning else []
        live.load_state_dict(state)
        out.append(args.consumed_train_samples)
    return out, notes, reads


TRANSITIONS = [(2, 3), (3, 2), (4, 1), (1, 4)]


def jobs(old_dp: int, new_dp: int, kind: str, sharding: bool = True, n: int = 144) -> tuple[Job, Job]:
    """Global batch 12 on both sides (micro-batch 12 / dp)."""
    return (Job(old_dp, 12 // old_dp, n=n, kind=kind, sharding=sharding),
            Job(new_dp, 12 // new_dp, n=n, kind=kind, sharding=sharding))


@pytest.mark.parametrize("old_dp,new_dp", TRANSITIONS)
def test_the_single_sampler_continues_step_by_step(old_dp: int, new_dp: int) -> None:
    """dataloader_type='single': the global count is the whole position."""
    old, new = jobs(old_dp, new_dp, "single")
    full = global_steps(old, 0, 12)
    record, states = save(old, 5 * old.gbs)
    restored, notes, reads = load(new, record, states, old.dp * TP)
    assert set(restored) == {60} and not notes
    assert global_steps(new, restored[0], 7) == full[5:]
    assert len(reads) == new.dp * TP  # one saved rank's counters per loading rank


def test_another_global_batch_reads_every_sample_once() -> None:
    old, new = Job(2, 3, micro=2), Job(3, 2, micro=3)  # 12 -> 18 per step
    record, states = save(old, 36)
    restored, _, _ = load(new, record, states, old.dp * TP)
    before = [x for s in global_steps(old, 0, 3) for x in s]
    after = [x for s in global_steps(new, restored[0], 6) for x in s]
    assert sorted(before + after) == list(range(144))


@pytest.mark.parametrize("old_dp,new_dp", TRANSITIONS)
@pytest.mark.parametrize("sharding", [False, True])
def test_the_cyclic_sampler_continues_in_epoch_0(old_dp: int, new_dp: int, sharding: bool) -> None:
    """Epoch 0 without sharding continues step by step; with sharding only at an epoch boundary."""
    old, new = jobs(old_dp, new_dp, "cyclic", sharding)
    full = global_steps(old, 0, 24)
    record, states = save(old, 5 * old.gbs)
    if not sharding:
        restored, notes, _ = load(new, record, states, old.dp * TP)
        assert not notes and global_steps(new, restored[0], 19) == full[5:]
        return
    with pytest.raises(DataReshardError) as e:
        load(new, record, states, old.dp * TP)
    assert "data_reshard='approximate'" in str(e.value) and "\n" not in str(e.value)
    # the counts the refusal names are what Megatron's sampler would then read, counted independently
    done = {x for s in full[:5] for x in s}
    rest_new = rest_of_epoch(new, 60)
    assert e.value.repeat == len(done & rest_new) > 0
    assert e.value.skip == len(rest_of_epoch(old, 60) - rest_new) > 0
    assert f"{e.value.repeat} sample(s) of epoch 0 would be seen twice and {e.value.skip} skipped" in str(e.value)
    approx, notes, _ = load(new, record, states, old.dp * TP, mode="approximate")
    assert set(approx) == {60} and "data_reshard='approximate'" in notes[0]


@pytest.mark.parametrize("old_dp,new_dp", TRANSITIONS)
def test_sharded_at_an_epoch_boundary_reads_each_sample_once(old_dp: int, new_dp: int) -> None:
    old, new = jobs(old_dp, new_dp, "cyclic")
    record, states = save(old, 144)  # 12 steps: epoch 0 done
    restored, notes, _ = load(new, record, states, old.dp * TP)
    epoch1 = [x for s in global_steps(new, restored[0], 12) for x in s]
    assert sorted(epoch1) == list(range(144))
    assert len(notes) == new.dp * TP and all("from epoch 1 on, Megatron's cyclic sampler orders each epoch by" in x for x in notes)


def rest_of_epoch(job: Job, consumed: int) -> set[int]:
    """What ``job``'s samplers, built at ``consumed``, read to the end of that epoch."""
    block = job.m * job.dp
    active = job.n - job.n % block
    micro = ((consumed // active + 1) * active - consumed) // block
    return {x for r in range(job.dp) for b in _take(rank_batches(job, consumed, r), micro) for x in b}


def test_a_later_epoch_cut_and_ordered_otherwise_is_refused_with_the_count() -> None:
    """105 samples: 96 per epoch in blocks of 12 (micro-batch 6), 102 in
    blocks of 6 (micro-batch 2, a permutation of 104 rather than 102): 108
    consumed stand at 12 of epoch 1, Megatron would read 6 of epoch 1 in another order."""
    old = Job(2, 6, n=105, kind="cyclic", sharding=False)
    new = Job(3, 2, micro=2, n=105, kind="cyclic", sharding=False)
    record, states = save(old, 108)
    with pytest.raises(DataReshardError) as e:
        load(new, record, states, old.dp * TP)
    msg = str(e.value)
    assert "sample 12 of epoch 1 on 2" in msg and "sample 6 of epoch 1 on 3" in msg and "permutes 104" in msg
    done = {x for r in range(2) for b in _take(rank_batches(old, 96, r), 1) for x in b}
    rest_old, rest_new = rest_of_epoch(old, 108), rest_of_epoch(new, 108)
    assert (e.value.repeat, e.value.skip) == (len(done & rest_new), len(rest_old - rest_new))
    assert e.value.repeat > 0 and e.value.skip > 0


def test_a_later_epoch_in_the_same_order_continues() -> None:
    """120 samples, micro-batches of 6 and 3 (both permute 120): epochs of 120 both ways."""
    old, new = Job(2, 6, n=120, kind="cyclic", sharding=False), Job(4, 3, n=120, kind="cyclic", sharding=False)
    full = global_steps(old, 0, 20)
    record, states = save(old, 13 * 12)
    restored, notes, _ = load(new, record, states, old.dp * TP)
    assert not notes and global_steps(new, restored[0], 7) == full[13:]


def _take(it: Any, k: int) -> list[list[int]]:
    return [next(it) for _ in range(k)]


def test_what_cannot_continue_is_named() -> None:
    old, new = jobs(2, 3, "cyclic")
    record, states = save(old, 24, loader_len=False)
    with pytest.raises(DataReshardError, match=r"loader=train_dataloader\) records it"):
        load(new, record, states, old.dp * TP)
    ext_old, ext_new = Job(2, 6, kind="external"), Job(3, 4, kind="external")
    record, states = save(ext_old, 24)
    with pytest.raises(DataReshardError, match="put that loader in the state instead"):
        load(ext_new, record, states, ext_old.dp * TP)
    record, states = save(Job(2, 6, kind="single"), 24)
    with pytest.raises(DataReshardError, match="saved with dataloader_type='single', loaded with 'cyclic'"):
        load(Job(3, 4, kind="cyclic"), record, states, 4)


def test_the_same_layout_restores_as_saved_and_inspect_reads_the_position() -> None:
    job = Job(2, 6, kind="cyclic")
    record, states = save(job, 36)
    restored, notes, _ = load(job, record, states, job.dp * TP)
    assert restored == [36] * 4 and not notes
    s = summary(record, job.dp * TP)
    assert s["samples"] == 36 and s["dp_size"] == 2 and s["epoch"] == 0 and record["varying"] == {}
