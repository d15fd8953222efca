"""Simulated data-parallel ranks of real Hugging Face ``datasets`` iterable
datasets (``split_dataset_by_node``) read through torchdata's
``StatefulDataLoader``, in one process.

The shards are real local files written here (parquet with several row
groups per file, or JSON lines); every example carries its id
(``shard * 1000 + row``), so what the loaders yield says which examples were
read. Each simulated rank records its position as the adapters do, the
positions are merged as the commit merges them, and each new rank's state
comes from the load's own decision (:func:`bytecp.data.restore.restore_data`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from datasets import load_dataset
from datasets.distributed import split_dataset_by_node
from torchdata.stateful_dataloader import StatefulDataLoader

from bytecp.data import position_of
from bytecp.data.positions import merge_positions
from bytecp.data.restore import restore_data

__all__ = ["Files", "write_shards", "Setup", "Saved", "make", "save_after", "resume", "uninterrupted", "ids",
           "steps_of"]

Step = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Files:
    """Shards on disk: ``rows[s]`` examples in shard ``s``."""

    paths: tuple[str, ...]
    rows: tuple[int, ...]
    fmt: str

    def all_ids(self) -> list[int]:
        return sorted(s * 1000 + i for s, n in enumerate(self.rows) for i in range(n))


def write_shards(where: Path, rows: list[int], fmt: str = "parquet", row_group: int = 5) -> Files:
    """One file per shard; parquet files of several row groups (tables), or JSON lines."""
    where.mkdir(parents=True, exist_ok=True)
    paths = []
    for s, n in enumerate(rows):
        ids = [s * 1000 + i for i in range(n)]
        if fmt == "parquet":
            p = where / f"shard-{s:03d}.parquet"
            pq.write_table(pa.table({"id": ids, "text": [f"doc {i}" for i in ids]}), p, row_group_size=row_group)
        else:
            p = where / f"shard-{s:03d}.jsonl"
            p.write_text("".join(json.dumps({"id": i, "text": f"doc {i}"}) + "\n" for i in ids))
        paths.append(str(p))
    return Files(tuple(paths), tuple(rows), fmt)


@dataclasses.dataclass(frozen=True)
class Setup:
    """``world`` ranks, ``batch`` examples per rank per step, ``workers`` per rank."""

    files: Files
    world: int
    batch: int
    workers: int = 0
    epoch: int = 0
    split: bool = True

    def with_(self, **kw: Any) -> Setup:
        return dataclasses.replace(self, **kw)


def dataset(setup: Setup, rank: int) -> Any:
    fmt = "json" if setup.files.fmt == "jsonl" else setup.files.fmt
    ds = load_dataset(fmt, data_files=list(setup.files.paths), split="train", streaming=True)
    if setup.split:
        ds = split_dataset_by_node(ds, rank=rank, world_size=setup.world)
    ds.set_epoch(setup.epoch)
    return ds


def make(setup: Setup, rank: int) -> StatefulDataLoader:
    kw: dict[str, Any] = {"num_workers": setup.workers}
    if setup.workers:
        kw.update(prefetch_factor=2, multiprocessing_context="fork")
    return StatefulDataLoader(dataset(setup, rank), batch_size=setup.batch, **kw)


def ids(batch: Any) -> list[int]:
    return [int(x) for x in batch["id"]]


def steps_of(per_rank: list[list[list[int]]]) -> list[Step]:
    n = max((len(b) for b in per_rank), default=0)
    return [tuple(sorted(x for b in per_rank if k < len(b) for x in b[k])) for k in range(n)]


def _drain(it: Any, limit: int | None = None) -> list[list[int]]:
    out: list[list[int]] = []
    if limit == 0:
        return out
    for b in it:
        out.append(ids(b))
        if limit is not None and len(out) == limit:
            break
    return out


def uninterrupted(setup: Setup) -> list[Step]:
    return steps_of([_drain(iter(make(setup, r))) for r in range(setup.world)])


@dataclasses.dataclass
class Saved:
    setup: Setup
    steps: list[Step]
    states: list[Any]
    record: dict[str, Any]

    def __post_init__(self) -> None:
        self.reads: list[int] = []

    def read(self, rank: int) -> Any:
        self.reads.append(rank)
        return json.loads(json.dumps(self.states[rank]))

    def seen(self) -> list[int]:
        return sorted(x for s in self.steps for x in s)


def save_after(setup: Setup, k: int) -> Saved:
    """Every rank draws ``k`` batches (workers prefetching ahead), then saves."""
    loaders = [make(setup, r) for r in range(setup.world)]
    iters = [iter(dl) for dl in loaders]
    taken = [_drain(it, k) for it in iters]
    states = [dl.state_dict() for dl in loaders]
    texts = {r: json.dumps(position_of(dl, st), sort_keys=True) for r, (dl, st) in enumerate(zip(loaders, states, strict=True))}
    del iters
    return Saved(setup, steps_of(taken), states, merge_positions(texts, setup.world))


def resume(saved: Saved, new: Setup, mode: str = "exact",
           check: Callable[[list[StatefulDataLoader]], None] | None = None) -> tuple[list[Step], list[str]]:
    """Every new rank restores through the load's decision and reads to the epoch's end."""
    loaders, notes = [make(new, r) for r in range(new.world)], []
    for r, dl in enumerate(loaders):
        got = restore_data("dataloader", dl, saved.record, saved.setup.world, r, new.world, saved.read, mode)
        if got is None:
            state = saved.read(r)
        elif got.as_saved:
            state = saved.read(r % saved.setup.world)
        else:
            state = got.value
        notes += [got.warning] if got is not None and got.warning else []
        dl.load_state_dict(state)
        if got is not None and got.after is not None:
            got.after()
    if check is not None:
        check(loaders)
    return steps_of([_drain(iter(dl)) for dl in loaders]), notes
