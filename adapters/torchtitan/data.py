"""torchtitan's dataloader across a change of its data-parallel degree: the
position of ``ParallelAwareDataloader`` over ``HuggingFaceTextDataset``
(torchtitan 0.3.0's text pretraining data) recorded at a save, and the
state that continues it, every document read once, on another number of
data-parallel ranks.

torchtitan keeps ``{"dp_rank_<r>": pickle.dumps(loader state), "world_size":
W}`` per rank and refuses another ``W``. Here the pickles are read with
bytecp's restricted unpickler (plain containers only: no code runs), and
each rank's position is where its stream stands:

- a map-style dataset (``load_dataset(path)``, the ``c4_test`` kind): rank
  ``r`` reads the contiguous chunk ``split_dataset_by_node`` gives it, in
  epoch ``e > 0`` permuted as torchtitan's re-loop permutes it (seed ``42 +
  e``); ``sample_idx`` documents of it are read. A new rank reads the
  documents of its own new chunk that no saved rank read, in its order (the
  chunks of another degree cut across the saved ones, so what it skips is
  recorded with its later positions until the epoch ends);
- a streaming dataset (``load_dataset(..., streaming=True)``): the streams'
  cursors, as for any ``datasets.IterableDataset``
  (:mod:`bytecp.adapters.data.hf_datasets`);
- with sequence packing, each rank's token buffer holds the tail of a
  document the cursor already counts as read: the buffers move, saved rank
  ``r``'s to new rank ``r % W'`` (its first stream), so every token is
  trained once.

Called through :mod:`bytecp.data`'s registry (kind ``"torchtitan"``), every
rank: :meth:`TorchtitanResharder.position` at a save (the adapter's
:func:`~bytecp.adapters.plain.per_rank_leaf`), ``reshard`` in a load's match
phase; the map-style selection is put in place in the apply phase.
"""

from __future__ import annotations

import pickle
import weakref
from typing import Any

import numpy as np
from datasets import Dataset
from datasets import IterableDataset as HFIterable

from bytecp.data import DataReshardError, Resharded, Resharder, SavedData
from bytecp.errors import BytecpError
from bytecp.interop.torch_zip import restricted_loads
from bytecp.plugins import missing_extra

from ..data import hf_streams as hs
from ..data.hf_datasets import (
    SavedStreams,
    dp_rank_entry,
    loader_streams,
    new_loader_state,
    plan_streams,
    recorded_dp_rank,
    saved_rank_of,
    stream_position,
)

try:
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset
except ModuleNotFoundError as e:  # (the registry imports this module only once torchtitan's loader is imported)
    raise missing_extra(e, "torchtitan", __name__) from None

__all__ = ["TorchtitanResharder", "loader_state", "chunk", "consumed"]

#: torchtitan 0.3.0 re-loops a map-style dataset with ``shuffle(seed=42 + epoch)``
_SEED = 42
_BUFFERS = ("inputs_buffer", "labels_buffer", "positions_buffer")
#: dataset -> (its selection, its epoch, the saved pieces the selection leaves out): recorded at the next save
_SELECTED: weakref.WeakKeyDictionary[Any, tuple[Any, int, list[dict[str, Any]]]] = weakref.WeakKeyDictionary()


def loader_state(value: Any, where: str) -> dict[str, Any]:
    """(save and load) The ``StatefulDataLoader`` state inside torchtitan's
    ``{"dp_rank_<r>": pickle, "world_size": W}``, unpickled without running code."""
    blobs = [v for k, v in (value or {}).items() if isinstance(k, str) and k.startswith("dp_rank_")]
    if len(blobs) != 1 or not isinstance(blobs[0], bytes | bytearray):
        raise DataReshardError(f"{where}: not a torchtitan dataloader state (one dp_rank_<r> pickle)")
    state = restricted_loads(bytes(blobs[0]), where)
    if not isinstance(state, dict):
        raise DataReshardError(f"{where}: the dataloader pickle holds {type(state).__name__}, not a state")
    return state


def chunk(n: int, parts: int, index: int) -> tuple[int, int]:
    """The contiguous rows ``split_dataset_by_node`` gives rank ``index`` of ``parts`` of ``n``."""
    div, mod = divmod(n, parts)
    start = div * index + min(index, mod)
    return start, start + div + (1 if index < mod else 0)


def _order(n: int, epoch: int) -> np.ndarray:
    return np.arange(n) if epoch == 0 else np.random.default_rng(_SEED + epoch).permutation(n)


def consumed(piece: dict[str, Any], epoch: int) -> tuple[int, int, np.ndarray]:
    """(load) A saved rank's read documents: ``piece`` is its rows ``[a, b)``,
    the count it read in its order, and the pieces its order left out (read
    before a reshard in this epoch) -> (a, b, a mask of read rows)."""
    a, b = (int(x) for x in piece["range"])
    out = np.zeros(b - a, dtype=bool)
    for sub in piece.get("skip", []):
        sa, sb, mask = consumed(sub, epoch)
        lo, hi = max(a, sa), min(b, sb)
        if lo < hi:
            out[lo - a:hi - a] |= mask[lo - sa:hi - sa]
    order = _order(b - a, epoch)
    left = order[~out[order]]
    out[left[:int(piece["read"])]] = True
    return a, b, out


def _datasets_of(state: dict[str, Any]) -> list[Any]:
    if "_snapshot" in state:
        ws = state["_snapshot"].get("_worker_snapshots", {})
        return [ws[k].get("dataset_state") for k in sorted(ws, key=lambda k: int(k.split("_")[-1]))]
    return [state.get("dataset_state")]


class TorchtitanResharder(Resharder):
    """torchtitan's ``ParallelAwareDataloader`` over ``HuggingFaceTextDataset`` (registered as ``"torchtitan"``)."""

    kind = "torchtitan"

    def detect(self, obj: Any) -> bool:
        return isinstance(obj, ParallelAwareDataloader)

    def position(self, loader: Any, state: Any) -> dict[str, Any]:
        pos: dict[str, Any] = {"dp_size": int(loader.dp_world_size), **dp_rank_entry(int(loader.dp_rank)),
                               "num_workers": int(loader.num_workers), "batch_size": loader.batch_size}
        ds = loader.dataset
        if type(ds) is not HuggingFaceTextDataset:
            pos["unknown"] = f"its dataset is a {type(ds).__name__}, not HuggingFaceTextDataset"
            return pos
        try:
            inner = loader_state(state, "torchtitan dataloader")
        except BytecpError as e:  # a save never fails for it: the position is unknown, a load refuses to reshard
            pos["unknown"] = str(e)
            return pos
        sets = _datasets_of(inner)
        pos["buffered"] = sum(len((s or {}).get("inputs_buffer", [])) for s in sets)
        try:
            if isinstance(ds._data, HFIterable):
                lay = hs.layout(ds._original_data, loader.num_workers)
                streams = [((s or {}).get("data"), ended) for s, (_, ended) in zip(sets, loader_streams(inner), strict=True)]
                pos.update(stream_position(lay, streams, bool(inner.get("_iterator_finished", False))), mode="iterable")
            elif loader.num_workers:
                raise hs.Unknown("a map-style dataset read by workers (each worker reads the whole chunk)")
            else:
                s = sets[0] or {}
                pos.update(mode="map", epoch=int(s.get("epoch", 0)), read=int(s.get("sample_idx", 0)),
                           rows=len(ds._original_data), samples=int(s.get("sample_idx", 0)))
                sel = _SELECTED.get(ds)
                if sel is not None and sel[0] is ds._data and sel[1] == pos["epoch"]:
                    pos["skip"] = sel[2]
        except hs.Unknown as e:
            pos["unknown"] = str(e)
        return pos

    def same_layout(self, loader: Any, position: dict[str, Any]) -> bool:
        return ((position.get("dp_size"), recorded_dp_rank(position), position.get("num_workers"))
                == (loader.dp_world_size, loader.dp_rank, loader.num_workers) and "skip" not in position)

    def reshard(self, loader: Any, saved: SavedData, rank: int, world_size: int) -> Any:
        ds = loader.dataset
        if type(ds) is not HuggingFaceTextDataset:
            raise DataReshardError(f"its dataset is a {type(ds).__name__}, not torchtitan's HuggingFaceTextDataset: "
                                   "an unknown number of documents would repeat or be skipped")
        try:
            unknown, mode, old_dp = saved.value("unknown"), saved.value("mode"), int(saved.value("dp_size"))
        except ValueError as e:
            raise DataReshardError(f"the saved ranks differ in {e}: an unknown number of documents would repeat "
                                   "or be skipped") from None
        if unknown:
            raise DataReshardError(f"its saved position is unknown ({unknown}): an unknown number of documents "
                                   "would repeat or be skipped")
        dp, me = int(loader.dp_world_size), int(loader.dp_rank)
        live_mode = "iterable" if isinstance(ds._data, HFIterable) else "map"
        if mode != live_mode:
            raise DataReshardError(f"saved reading a {mode} dataset, here a {live_mode} one: an unknown number of "
                                   "documents would repeat or be skipped")
        finder = _Ranks(saved)
        buffers = self._buffers(saved, finder, old_dp, dp, me)
        if mode == "iterable":
            return self._iterable(loader, saved, rank, buffers)
        if loader.num_workers:
            raise DataReshardError("a map-style dataset read by workers (each worker reads its whole chunk): an "
                                   "unknown number of documents would repeat")
        return self._map(loader, saved, finder, old_dp, rank, buffers)

    # ------------------------------------------------------------------ token buffers
    @staticmethod
    def _buffers(saved: SavedData, finder: _Ranks, old_dp: int, dp: int, me: int) -> dict[str, list[int]]:
        """The token buffers of the saved ranks ``r % dp == me``, joined (documents' tails: no token is lost)."""
        out: dict[str, list[int]] = {k: [] for k in _BUFFERS}
        for d in range(me, old_dp, dp):
            r = finder.rank_of(d)
            if not saved.position(r).get("buffered"):
                continue
            for s in _datasets_of(loader_state(saved.state(r), f"{saved.fqn} of saved rank {r}")):
                for k in _BUFFERS:
                    out[k] += list((s or {}).get(k, []))
        return out

    # ------------------------------------------------------------------ streaming datasets
    def _iterable(self, loader: Any, saved: SavedData, rank: int, buffers: dict[str, list[int]]) -> Any:
        ds = loader.dataset
        try:
            lay = hs.layout(ds._original_data, loader.num_workers)
            tpl = hs.template(ds._original_data)
            epoch, n, finished = int(saved.value("epoch")), int(saved.value("num_shards")), bool(saved.value("finished"))
        except (hs.Unknown, ValueError) as e:
            raise DataReshardError(f"its streaming dataset cannot be resharded ({e}): an unknown number of documents "
                                   "would repeat or be skipped") from None
        if n != lay.num_shards:
            raise DataReshardError(f"the dataset has {lay.num_shards} shards here and had {n} at the save")
        if finished:  # the epoch read to its end (torchtitan drops what its buffers hold then)
            return Resharded(_wrap(loader, new_loader_state(loader, _Template(saved), rank, None)),
                             after=_data_epoch(ds, epoch))
        order = hs.order(ds._original_data, epoch, n)
        plan = plan_streams(SavedStreams(saved, ds._original_data, order), [[order[p] for p in ps] for ps in lay.streams()])
        sets = [{**{k: (buffers[k] if i == 0 else []) for k in _BUFFERS},
                 "data": hs.encode(tpl, c, lay.dp_size, lay.dp_rank, epoch)} for i, c in enumerate(plan.cursors)]
        state = Resharded(_wrap(loader, new_loader_state(loader, _Template(saved), rank, sets)))
        if plan.repeat:
            raise DataReshardError(f"{len(plan.why)} partly read shard(s) would fall into one reading stream "
                                   f"({'; '.join(plan.why[:4])}): {plan.repeat} document(s) would be read twice",
                                   repeat=plan.repeat, approximate=state)
        return state

    # ------------------------------------------------------------------ map-style datasets
    def _map(self, loader: Any, saved: SavedData, finder: _Ranks, old_dp: int, rank: int,
             buffers: dict[str, list[int]]) -> Any:
        ds = loader.dataset
        try:
            epoch = int(saved.value("epoch"))
        except ValueError:
            col = [e for e in saved.column("epoch") if isinstance(e, int)]
            raise DataReshardError(f"the saved ranks read different epochs ({min(col)} to {max(col)}: torchtitan "
                                   "re-loops each rank on its own): an unknown number of documents would repeat or be "
                                   "skipped") from None
        rows = self._rows(saved)
        dp, me = int(loader.dp_world_size), int(loader.dp_rank)
        a, b = chunk(rows, dp, me)
        if b - a != len(ds._original_data):
            raise DataReshardError(f"the dataset has {len(ds._original_data)} rows in data-parallel rank {me}'s chunk "
                                   f"here, {b - a} at the save: the dataset changed")
        read = np.zeros(b - a, dtype=bool)
        pieces = []
        for d in _overlapping(rows, old_dp, a, b):
            p = saved.position(finder.rank_of(d))
            piece = {"range": list(chunk(rows, old_dp, d)), "read": int(p["read"]), **({"skip": p["skip"]} if p.get("skip") else {})}
            pa, pb, mask = consumed(piece, epoch)
            lo, hi = max(a, pa), min(b, pb)
            read[lo - a:hi - a] |= mask[lo - pa:hi - pa]
            pieces.append(piece)
        order = _order(b - a, epoch)
        keep = [int(i) for i, done in zip(range(b - a), read[order], strict=True) if not done]
        state_ds = {**buffers, "sample_idx": 0, "epoch": epoch}
        tpl = _Template(saved)

        def select() -> None:  # (apply phase) the rows of the new chunk no saved rank read, in the epoch's order
            ds.load_state_dict(state_ds)
            base = ds._original_data if epoch == 0 else ds._original_data.shuffle(seed=_SEED + epoch)
            chosen = base.select(keep) if len(keep) < len(base) else base
            ds._data = chosen
            if len(keep) < len(base):
                _SELECTED[ds] = (chosen, epoch, pieces)

        return Resharded(_wrap(loader, new_loader_state(loader, tpl, rank, [None])), after=select)

    @staticmethod
    def _rows(saved: SavedData) -> int:
        """The whole dataset's rows: each saved rank's chunk, added up."""
        try:
            return int(saved.value("rows")) * int(saved.value("dp_size"))
        except ValueError:
            col = saved.column("rows")
            ranks = _Ranks(saved)
            return sum(int(col[list(saved.recorded).index(ranks.rank_of(d))])
                       for d in range(int(saved.value("dp_size"))))


class _Ranks:
    """Saved data-parallel rank -> a saved rank that read as it (O(1) when they coincide)."""

    def __init__(self, saved: SavedData) -> None:
        self.saved = saved

    def rank_of(self, dp_rank: int) -> int:
        return saved_rank_of(self.saved, dp_rank)


def _overlapping(rows: int, parts: int, a: int, b: int) -> range:
    """The ranks of ``parts`` whose chunks meet rows ``[a, b)``."""
    if a >= b:
        return range(0)
    lo = next(d for d in range(parts) if chunk(rows, parts, d)[1] > a) if parts < 64 else _search(rows, parts, a)
    hi = lo
    while hi < parts and chunk(rows, parts, hi)[0] < b:
        hi += 1
    return range(lo, hi)


def _search(rows: int, parts: int, a: int) -> int:
    lo, hi = 0, parts - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if chunk(rows, parts, mid)[1] > a:
            hi = mid
        else:
            lo = mid + 1
    return lo


class _Template:
    """The saved rank a new one takes its seeds from, with the state unpickled."""

    def __init__(self, saved: SavedData) -> None:
        self.saved = saved

    def template_rank(self, rank: int) -> int:
        return self.saved.template_rank(rank)

    def state(self, rank: int) -> Any:
        return loader_state(self.saved.state(rank), f"{self.saved.fqn} of saved rank {rank}")


def _wrap(loader: Any, state: dict[str, Any]) -> dict[str, Any]:
    """torchtitan's own per-rank form of a loader state."""
    return {f"dp_rank_{int(loader.dp_rank)}": pickle.dumps(state), "world_size": int(loader.dp_world_size)}


def _data_epoch(ds: Any, epoch: int) -> Any:
    def set_epoch() -> None:
        if isinstance(ds._data, HFIterable) and ds._data.epoch != epoch:
            ds._data.set_epoch(epoch)

    return set_epoch


_ = Dataset  # (map-style datasets are datasets.Dataset)
