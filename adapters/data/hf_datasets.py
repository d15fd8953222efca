"""Hugging Face ``datasets.IterableDataset`` split with ``split_dataset_by_node``
and read through torchdata's ``StatefulDataLoader`` (workers or none): its
position at a save, and the state that continues it on another number of
data-parallel ranks, every example of the epoch read once.

At a save each rank records, per reading stream (one per worker), where the
stream stands in its list of shards (:mod:`.hf_streams` reads ``datasets``'
state). The streams of all ranks together say, for every shard of the
dataset, whether it was read to its end, up to which example, or not at all.
At a load under another layout each new stream (``datasets`` assigns the
shards to ranks and workers as it always does) starts where that says, when
it can be said as ``datasets`` says positions: the shards of its list before
one read, one shard partly read, the rest unread. That holds when the world
grows (a new stream's shards are a subset of one saved stream's) and when a
stream every rank reads (``num_shards`` not a multiple of the world size:
every rank keeps one example in W) moves to another number of ranks with the
same workers -- then every global step after the resume holds the
uninterrupted run's examples. Shrinking the world merges saved streams: it
is exact when the merged shards were read to their ends or not at all (a
shard whose cursor stands at its end is read to find out), and refused
otherwise, naming how many examples would be read twice.

Called through :mod:`bytecp.data`'s registry (kind ``"hf_datasets"``), every
rank: :meth:`HFIterableResharder.position` at a save,
:meth:`~HFIterableResharder.reshard` in a load's match phase (nothing changes
before the apply phase, where the dataset's epoch is set to the saved one:
``datasets`` applies a state only in its epoch).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from bytecp.data import DataReshardError, Resharded, Resharder, SavedData
from bytecp.plugins import missing_extra

try:  # (the registry imports this module only once datasets is imported)
    from datasets import IterableDataset
    from torchdata.stateful_dataloader import StatefulDataLoader
except ModuleNotFoundError as e:
    raise missing_extra(e, "datasets", __name__) from None

from . import hf_streams as hs

__all__ = ["HFIterableResharder", "loader_streams", "stream_position", "Plan", "plan_streams", "SavedStreams",
           "new_loader_state", "dp_rank_entry", "saved_rank_of", "recorded_dp_rank"]

def loader_streams(state: dict[str, Any]) -> list[tuple[Any, bool]]:
    """(save) Each reading stream's ``datasets`` state in a ``StatefulDataLoader``
    state, and whether the stream ended: one with no workers, one per worker."""
    if "_snapshot" in state:
        ws = state["_snapshot"].get("_worker_snapshots", {})
        out = []
        for k in sorted(ws, key=lambda k: int(k.split("_")[-1])):
            fetch = ws[k].get("fetcher_state") or {}
            out.append((ws[k].get("dataset_state"), bool(fetch.get("fetcher_ended", False))))
        return out
    fetch = state.get("fetcher_state") or {}
    return [(state.get("dataset_state"), bool(fetch.get("fetcher_ended", False)))]


def dp_rank_entry(dp_rank: int) -> dict[str, int]:
    """(save) ``{"dp_rank": r}``, left out where it is the process's own rank
    (a job split over all its ranks): then every rank of a synchronous run
    sends the same position, stored once."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() == dp_rank:
        return {}
    return {"dp_rank": dp_rank}


def recorded_dp_rank(position: dict[str, Any]) -> int | None:
    """(load, at the saving world size) The data-parallel rank a position of
    this process's own saved rank recorded (left out: this process's rank)."""
    import torch.distributed as dist

    own = dist.get_rank() if dist.is_available() and dist.is_initialized() else None
    return position.get("dp_rank", own)


def saved_rank_of(saved: SavedData, dp_rank: int, column: list[Any] | None = None) -> int:
    """(load) A saved rank that read as data-parallel rank ``dp_rank`` (its
    position's ``dp_rank``, else its own rank): O(1) where they coincide."""
    recorded = list(saved.recorded) if saved.ranks is not None else None
    r = dp_rank if recorded is None else recorded[dp_rank] if dp_rank < len(recorded) else None
    if r is not None and saved.position(r).get("dp_rank", r) == dp_rank:
        return r
    rows = list(saved.recorded)
    col = saved.column("dp_rank") if column is None else column
    for r, d in zip(rows, col, strict=True):
        if (r if d is None else d) == dp_rank:
            return r
    raise DataReshardError(f"no saved rank read as data-parallel rank {dp_rank}")


def stream_position(lay: hs.Layout, states: list[tuple[Any, bool]], finished: bool) -> dict[str, Any]:
    """(save) A rank's position from its streams' states: JSON, small."""
    pos: dict[str, Any] = {"epoch": lay.epoch, "num_shards": lay.num_shards, "strategy": lay.strategy,
                           "dp_size": lay.dp_size, **dp_rank_entry(lay.dp_rank), "streams_per_rank": lay.workers,
                           "finished": finished}
    streams: list[dict[str, Any]] = []
    counts: list[int | None] = []
    for st, ended in states:
        if ended or finished:
            streams.append({"end": True})
            counts.append(None)
            continue
        if st is None:
            streams.append({"at": [0, 0]})
            counts.append(0)
            continue
        d = hs.decode(st, lay.dp_size, lay.dp_rank)
        counts.append(d.pop("count", None))
        streams.append(d)
    pos["streams"] = streams
    if all(isinstance(c, int) for c in counts):
        pos["counts"] = counts
        pos["samples"] = sum(counts)
    return pos


@dataclasses.dataclass
class Plan:
    """The cursor of each new stream, or what stops it from being exact."""

    cursors: list[tuple[int, int]]
    repeat: int  # examples a new stream would read again (refused unless approximate)
    why: list[str]


class SavedStreams:
    """The saved job's streams, read from the merged positions as a new rank
    needs them: O(the shards it gets) of the record."""

    def __init__(self, saved: SavedData, ds: IterableDataset, order: list[int]) -> None:
        self.saved, self.ds, self.order = saved, ds, order
        self.n, self.dp = int(saved.value("num_shards")), int(saved.value("dp_size"))
        self.strategy, self.workers = str(saved.value("strategy")), int(saved.value("streams_per_rank"))
        # shard -> position in the epoch's order (epoch 0: the identity, nothing built)
        self.where: Any = {g: p for p, g in enumerate(order)} if order != list(range(len(order))) else None
        self._cursors: dict[tuple[int, int], tuple[int, int] | None] = {}
        self._rows: dict[int, int] = {}
        self._lists: dict[tuple[int, int], list[int]] = {}

    def rows(self, shard: int) -> int:
        if shard not in self._rows:
            self._rows[shard] = hs.shard_rows(self.ds, shard)
        return self._rows[shard]

    def _rank_of(self, dp_rank: int) -> int:
        return saved_rank_of(self.saved, dp_rank)

    def _list(self, dp_rank: int, stream: int) -> list[int]:
        key = (dp_rank, stream)
        if key not in self._lists:
            ps = hs.stream_positions(self.n, self.dp, dp_rank, self.strategy, self.workers)[stream]
            self._lists[key] = [self.order[p] for p in ps]
        return self._lists[key]

    def locate(self, shard: int) -> tuple[int, int, int]:
        """Shard -> (saved data-parallel rank, stream, index in the stream's list)."""
        p = shard if self.where is None else self.where[shard]
        if self.strategy == "shards":
            q = p // self.dp
            return p % self.dp, q % self.workers, q // self.workers
        return 0, p % self.workers, p // self.workers

    def cursor(self, dp_rank: int, stream: int) -> tuple[int, int] | None:
        """A saved stream's cursor (None: read to its end)."""
        key = (dp_rank, stream)
        if key in self._cursors:
            return self._cursors[key]
        if self.strategy == "shards":
            rec = self.saved.position(self._rank_of(dp_rank))["streams"][stream]
        else:  # every rank reads the stream: where all of them together stand
            rec = self._common_stream(stream)
        out = None if rec.get("end") else self._resolve(rec, self._list(dp_rank, stream))
        self._cursors[key] = out
        return out

    def _common_stream(self, stream: int) -> dict[str, Any]:
        """The cursor of a stream every saved rank reads (one example in dp each):
        the ranks read alike (then the last rank's cursor follows the stream's
        last example read), else refused with the examples that would repeat."""
        try:
            counts = self.saved.value("counts")
        except ValueError:
            col = [c[stream] if isinstance(c, list) else None for c in self.saved.column("counts")]
            known = [c for c in col if isinstance(c, int)]
            more = sum(known) - min(known) * len(known) if known else 0
            raise DataReshardError(
                f"the saved ranks read different numbers of examples from stream {stream} ({min(known, default=0)} "
                f"to {max(known, default=0)}): resuming at the slowest, {more} example(s) would be read twice",
                repeat=more) from None
        try:
            uniform = self.saved.value("streams")
        except ValueError:
            uniform = None
        if uniform is not None:
            return dict(uniform[stream])
        if counts is None or self.strategy != "examples":  # ranks at different cursors, no count to compare
            raise DataReshardError(f"the saved ranks stand at different cursors of stream {stream}: an unknown "
                                   "number of examples would repeat or be skipped")
        return dict(self.saved.position(self._rank_of(self.dp - 1))["streams"][stream])

    def _resolve(self, rec: dict[str, Any], shards: list[int]) -> tuple[int, int]:
        if "at" in rec:
            return int(rec["at"][0]), int(rec["at"][1])
        i, k, j, rows = (int(x) for x in rec["cross"])
        for idx in range(i, j):  # the rows ran past the ends of shards i..j-1
            rows -= self.rows(shards[idx]) - (k if idx == i else 0)
        if rows < 0:
            raise DataReshardError(f"a saved cursor does not fit its shards (shard {shards[i]}): the dataset's files "
                                   "changed since the save")
        return j, rows

    def state_of(self, shard: int) -> tuple[str, int]:
        """("done" | "part" | "new", examples read)."""
        d, w, idx = self.locate(shard)
        cur = self.cursor(d, w)
        if cur is None or idx < cur[0]:
            return "done", 0
        if idx == cur[0] and cur[1] > 0:
            return "part", cur[1]
        return "new", 0


def plan_streams(saved: SavedStreams, new_lists: list[list[int]]) -> Plan:
    """(load) Each new stream's cursor in its list of shards, or the count of
    examples that would be read twice (starting at its first unread shard)."""
    cursors, repeat, why = [], 0, []
    for shards in new_lists:
        states = [saved.state_of(g) for g in shards]
        last_read = max((i for i, (s, _) in enumerate(states) if s != "new"), default=-1)
        for i in range(last_read):  # a shard partly read, then another read: was it read to its end?
            s, k = states[i]
            if s == "part" and saved.rows(shards[i]) <= k:
                states[i] = ("done", 0)
        first = next((i for i, (s, _) in enumerate(states) if s != "done"), len(states))
        cursors.append((first, states[first][1] if first < len(states) else 0))
        again = [(shards[i], s, k) for i, (s, k) in enumerate(states) if i > first and s != "new"]
        for g, s, k in again:
            n = saved.rows(g) if s == "done" else k
            repeat += n
            why.append(f"shard {g} ({'read to its end' if s == 'done' else f'{k} examples read'}, {n} read again)")
    return Plan(cursors, repeat, why)


class HFIterableResharder(Resharder):
    """``StatefulDataLoader`` over a ``datasets.IterableDataset`` (registered as ``"hf_datasets"``)."""

    kind = "hf_datasets"

    def detect(self, obj: Any) -> bool:
        return isinstance(obj, StatefulDataLoader) and isinstance(obj.dataset, IterableDataset)

    def position(self, loader: Any, state: Any) -> dict[str, Any]:
        pos: dict[str, Any] = {"num_workers": int(loader.num_workers), "batch_size": loader.batch_size}
        try:
            lay = hs.layout(loader.dataset, loader.num_workers)
            since = int(state.get("_steps_since_snapshot", 0)) if "_snapshot" in state else 0
            if since:
                raise hs.Unknown(f"its workers' states are {since} step(s) old (snapshot_every_n_steps > 1)")
            pos.update(stream_position(lay, loader_streams(state), bool(state.get("_iterator_finished", False))))
        except hs.Unknown as e:
            pos["unknown"] = str(e)
        return pos

    def same_layout(self, loader: Any, position: dict[str, Any]) -> bool:
        try:
            lay = hs.layout(loader.dataset, loader.num_workers)
        except hs.Unknown:
            return True  # not ours to reshard: restored as saved
        return (position.get("dp_size"), recorded_dp_rank(position), position.get("strategy"),
                position.get("streams_per_rank"), position.get("num_shards")) == (
            lay.dp_size, lay.dp_rank, lay.strategy, lay.workers, lay.num_shards)

    def reshard(self, loader: Any, saved: SavedData, rank: int, world_size: int) -> Any:
        ds = loader.dataset
        try:
            lay = hs.layout(ds, loader.num_workers)
            tpl = hs.template(ds)
        except hs.Unknown as e:
            raise DataReshardError(f"its dataset cannot be resharded: {e}: an unknown number of examples would "
                                   "repeat or be skipped") from None
        try:
            unknown = saved.value("unknown")
            epoch, n = int(saved.value("epoch")), int(saved.value("num_shards"))
            finished = bool(saved.value("finished"))
        except ValueError as e:
            raise DataReshardError(f"the saved ranks differ in {e}: an unknown number of examples would repeat or "
                                   "be skipped") from None
        if unknown:
            raise DataReshardError(f"its saved position is unknown ({unknown}): an unknown number of examples "
                                   "would repeat or be skipped")
        if n != lay.num_shards:
            raise DataReshardError(f"the dataset has {lay.num_shards} shards here and had {n} at the save: an "
                                   "unknown number of examples would repeat or be skipped")
        after = self._epoch_setter(ds, epoch)
        if finished:
            return Resharded(new_loader_state(loader, saved, rank, None), after=after)
        order = hs.order(ds, epoch, n)
        old = SavedStreams(saved, ds, order)
        new_lists = [[order[p] for p in ps] for ps in lay.streams()]
        plan = plan_streams(old, new_lists)
        states = [hs.encode(tpl, c, lay.dp_size, lay.dp_rank, epoch) for c in plan.cursors]
        state = Resharded(new_loader_state(loader, saved, rank, states), after=after)
        if plan.repeat:
            raise DataReshardError(
                f"{len(plan.why)} partly read shard(s) of epoch {epoch} would fall into one reading stream of data-"
                f"parallel rank {lay.dp_rank} of {lay.dp_size} ({'; '.join(plan.why[:4])}"
                f"{'; ...' if len(plan.why) > 4 else ''}): {plan.repeat} example(s) would be read twice",
                repeat=plan.repeat, approximate=state)
        return state

    @staticmethod
    def _epoch_setter(ds: Any, epoch: int) -> Callable[[], None] | None:
        if ds.epoch == epoch:
            return None

        def set_epoch() -> None:  # (apply phase) datasets applies a state only in its own epoch
            ds.set_epoch(epoch)

        return set_epoch


def new_loader_state(loader: Any, saved: Any, rank: int, datasets: list[Any] | None) -> dict[str, Any]:
    """A ``StatefulDataLoader`` state for ``loader`` (its workers) whose streams
    start from ``datasets`` (None: the epoch was read to its end); seeds from
    the saved rank this one starts from (``saved``: a :class:`SavedData`, or
    what reads the loader states in another wrapping: ``state``, ``template_rank``)."""
    tpl = saved.state(saved.template_rank(rank))
    tmain = tpl["_snapshot"]["_main_snapshot"] if isinstance(tpl, dict) and "_snapshot" in tpl else (tpl or {})
    finished = datasets is None
    main: dict[str, Any] = {"_index_sampler_state": None, "_sampler_iter_state": None, "_sampler_iter_yielded": 0,
                            "_IterableDataset_len_called": None, "_shared_seed": tmain.get("_shared_seed")}
    fetch = {"dataset_iter_state": None, "fetcher_ended": False}
    workers = int(loader.num_workers)
    if workers == 0:
        return {**main, "_num_yielded": 0, "fetcher_state": fetch,
                "dataset_state": None if datasets is None else datasets[0], "_iterator_finished": finished}
    seed = tmain.get("_base_seed")
    main.update(_num_workers=workers, _base_seed=seed if seed is not None else int.from_bytes(os.urandom(8)) >> 1)
    snap = tpl.get("_snapshot", {}) if isinstance(tpl, dict) else {}
    same = snap.get("_main_snapshot", {}).get("_num_workers") == workers
    last = int(snap.get("_last_yielded_worker_id", workers - 1)) if same else workers - 1
    return {
        "_snapshot": {
            "_snapshot_step": int(snap.get("_snapshot_step", 0)) if same else 0,
            "_last_yielded_worker_id": last,
            "_main_snapshot": main,
            "_worker_snapshots": {f"worker_{i}": {"worker_id": i, "fetcher_state": dict(fetch),
                                                  "dataset_state": None if datasets is None else datasets[i]}
                                  for i in range(workers)},
        },
        "_steps_since_snapshot": 0,
        "_iterator_finished": finished,
    }
