"""Hugging Face ``datasets`` iterable datasets (``split_dataset_by_node``) read
through torchdata's ``StatefulDataLoader``, resharded across world sizes:
real local parquet and JSON-lines shards, real loaders (workers included),
ranks simulated in one process (:mod:`tests.data.hf_sim`).

What is checked is what the loaders yield: every example of the epoch read
exactly once over the save and the resume; where every rank reads the whole
stream (``num_shards`` not a multiple of the world size) and the global
batch is unchanged, every global step equals the uninterrupted run's; what
cannot continue exactly is refused with the count, and approximated with
exactly that many examples read twice.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from datasets import IterableDataset
from datasets.distributed import split_dataset_by_node
from torchdata.stateful_dataloader import StatefulDataLoader

from bytecp.data import position_of, resharder_for
from bytecp.data.positions import merge_positions
from bytecp.data.restore import restore_data
from bytecp.errors import DataReshardError

from .hf_sim import Setup, make, resume, save_after, uninterrupted, write_shards

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

#: loaders without and with worker processes (those start processes: ``spawn``)
WORKERS = [0, pytest.param(2, marks=pytest.mark.spawn)]


@pytest.fixture(autouse=True)
def _quiet() -> None:
    logging.getLogger("datasets").setLevel(logging.ERROR)


@pytest.fixture(scope="module")
def even(tmp_path_factory: pytest.TempPathFactory):
    """12 parquet shards of 12 rows (row groups of 5: tables that do not align with batches)."""
    return write_shards(tmp_path_factory.mktemp("even"), [12] * 12)


@pytest.fixture(scope="module")
def uneven(tmp_path_factory: pytest.TempPathFactory):
    """7 JSON-lines shards of different lengths: no world size above 1 divides them."""
    return write_shards(tmp_path_factory.mktemp("uneven"), [12, 9, 14, 12, 7, 12, 11], fmt="jsonl")


def once(saved, rest, files) -> None:
    every = saved.seen() + sorted(x for s in rest for x in s)
    assert sorted(every) == files.all_ids(), (len(every), len(set(every)))


@pytest.mark.parametrize("old_w,new_w", [(2, 4), (1, 4), (2, 3), (3, 6)])
@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("epoch", [0, 2])
def test_growing_the_world_reads_every_example_once(even, old_w: int, new_w: int, workers: int, epoch: int) -> None:
    """Each new rank's shards were one saved stream's: their cursors carry over (epoch 2: the shards permuted)."""
    old = Setup(even, old_w, 12 // old_w, workers=workers, epoch=epoch)
    saved = save_after(old, 3)
    rest, notes = resume(saved, old.with_(world=new_w, batch=12 // new_w))
    once(saved, rest, even)
    assert notes == [] and len(saved.reads) == new_w  # one saved state each: the seeds


@pytest.mark.parametrize("old_w,new_w", [(2, 3), (3, 2), (4, 1), (1, 4)])
@pytest.mark.parametrize("workers", WORKERS)
def test_a_stream_every_rank_reads_continues_step_by_step(uneven, old_w: int, new_w: int, workers: int) -> None:
    """7 shards: every rank reads every shard and keeps one example in W; the
    global batch of 12 unchanged, each global step after the resume is the
    uninterrupted run's, in a later epoch too."""
    old = Setup(uneven, old_w, 12 // old_w, workers=workers, epoch=1)
    full = uninterrupted(old)
    saved = save_after(old, 3)
    assert saved.steps == full[:3]
    rest, _ = resume(saved, old.with_(world=new_w, batch=12 // new_w))
    once(saved, rest, uneven)
    assert rest[:-1] == full[3:len(rest) + 2]


@pytest.mark.spawn
def test_changing_the_workers_reshards_too(even, uneven) -> None:
    saved = save_after(Setup(even, 2, 6, workers=2), 4)
    rest, _ = resume(saved, Setup(even, 4, 3, workers=0))
    once(saved, rest, even)
    saved = save_after(Setup(uneven, 2, 6, workers=0), 3)
    rest, _ = resume(saved, Setup(uneven, 2, 6, workers=2))  # the same world size, another layout
    once(saved, rest, uneven)


@pytest.mark.parametrize("old_w,new_w", [(4, 2), (4, 1), (3, 1)])
@pytest.mark.parametrize("workers", WORKERS)
def test_shrinking_at_shard_ends_is_exact(tmp_path: Path, old_w: int, new_w: int, workers: int) -> None:
    """Every saved stream stands at the end of a shard (its cursor not yet
    moved on): the merged streams' shards are read or unread, which a read of
    the shard's length tells."""
    files = write_shards(tmp_path, [12] * 12)
    old = Setup(files, old_w, 4, workers=workers)
    saved = save_after(old, 3 * max(1, workers))
    rest, _ = resume(saved, old.with_(world=new_w))
    once(saved, rest, files)


@pytest.mark.parametrize("workers", WORKERS)
def test_shrinking_mid_shard_is_refused_with_the_count_or_approximated(even, workers: int) -> None:
    old = Setup(even, 4, 3, workers=workers)
    saved = save_after(old, 2 * max(1, workers))
    new = old.with_(world=2, batch=6)
    with pytest.raises(DataReshardError) as e:
        resume(saved, new)
    msg = str(e.value)
    assert "\n" not in msg and "'dataloader'" in msg and "data_reshard='approximate'" in msg
    assert "example(s) would be read twice" in msg and e.value.repeat
    counts = []
    for r in range(2):  # each new rank names its own
        from bytecp.data.restore import restore_data as decide

        with pytest.raises(DataReshardError) as one:
            decide("dataloader", make(new, r), saved.record, 4, r, 2, saved.read, "exact")
        counts.append(one.value.repeat)
    rest, notes = resume(saved, new, mode="approximate")
    every = saved.seen() + [x for s in rest for x in s]
    assert len(every) - len(set(every)) == sum(counts) and set(every) == set(even.all_ids())
    assert all("seen twice" in n for n in notes)


def test_a_python_generator_dataset(tmp_path: Path) -> None:
    """``IterableDataset.from_generator`` (no arrow tables: cursors count the examples themselves)."""
    def gen(shards: list[int]):
        for s in shards:
            for i in range(10):
                yield {"id": s * 1000 + i}

    base = IterableDataset.from_generator(gen, gen_kwargs={"shards": list(range(8))})

    def loaders(w: int) -> list[StatefulDataLoader]:
        return [StatefulDataLoader(split_dataset_by_node(base, r, w), batch_size=3) for r in range(w)]

    for old_w, new_w in [(2, 4), (4, 2), (3, 2)]:
        old = loaders(old_w)
        its = [iter(d) for d in old]
        first = [int(x) for it in its for _ in range(2) for x in next(it)["id"]]
        states = [d.state_dict() for d in old]
        rec = merge_positions({r: json.dumps(position_of(d, s)) for r, (d, s) in enumerate(zip(old, states, strict=True))},
                              old_w)
        new = loaders(new_w)
        try:
            for r, d in enumerate(new):
                d.load_state_dict(restore_data("dl", d, rec, old_w, r, new_w, states.__getitem__, "exact").value)
        except DataReshardError as e:  # 4 -> 2 after 6 of 10 examples per shard: partly read shards merge
            assert (old_w, new_w) == (4, 2) and "would be read twice" in str(e)
            continue
        rest = [int(x) for d in new for b in d for x in b["id"]]
        assert sorted(first + rest) == sorted(s * 1000 + i for s in range(8) for i in range(10)), (old_w, new_w)


def test_a_finished_epoch_and_the_position_record(even) -> None:
    old = Setup(even, 2, 6)
    saved = save_after(old, 100)  # past the epoch's end
    c = saved.record["common"]
    assert c["finished"] is True and c["kind"] == "hf_datasets"
    assert saved.record["varying"] == {"dp_rank": [0, 1]}  # equal shards: every stream at the same cursor
    rest, _ = resume(saved, old.with_(world=3, batch=4, epoch=1))
    assert sorted(x for s in rest for x in s) == even.all_ids()  # the next epoch, whole
    mid = save_after(old, 2).record["common"]
    # shard 0 read to its end, not yet marked done
    assert mid["samples"] == 12 and mid["streams"] == [{"at": [0, 12]}] and mid["strategy"] == "shards"


def test_a_pipeline_it_cannot_read_is_refused(even) -> None:
    old = Setup(even, 2, 6)
    loader = make(old, 0)
    mapped = StatefulDataLoader(loader.dataset.map(lambda x: x), batch_size=6)
    assert resharder_for(mapped).kind == "hf_datasets"
    pos = position_of(mapped, mapped.state_dict())
    assert "MappedExamplesIterable" in pos["unknown"]
    rec = merge_positions({0: json.dumps(pos), 1: json.dumps(pos)}, 2)
    with pytest.raises(DataReshardError, match=r"its dataset cannot be resharded: its pipeline ends in "
                                               r"MappedExamplesIterable"):
        restore_data("dl", mapped, rec, 2, 0, 3, lambda r: mapped.state_dict(), "exact")
