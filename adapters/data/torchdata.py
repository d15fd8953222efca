"""torchdata's ``StatefulDataLoader`` over a map-style dataset, drawn by torch's
``DistributedSampler`` or torchdata's ``StatefulDistributedSampler``: its
position at a save, and the state that continues it exactly on another
number of data-parallel ranks.

Why it can: both samplers order an epoch alike on every rank (a permutation
of the dataset seeded by ``seed + epoch``, padded or cut to a multiple of the
ranks) and give rank ``r`` of ``D`` the positions ``r, r + D, r + 2D, ...``
of that order. After each of ``D`` ranks consumed ``s`` samples, the run has
consumed exactly positions ``[0, D*s)``; a global step of ``G`` samples is
the contiguous block ``[k*G, (k+1)*G)``, whatever ``D`` is. So the new ranks
continue at position ``C = D*s``: each of ``D'`` ranks skips ``C / D'`` of its
own positions. With the global batch unchanged every later global step holds
the uninterrupted run's samples; otherwise every sample of the epoch is
still seen once. ``C`` must divide by ``D'`` (else the load refuses, naming
the samples that would repeat). The epoch ends as ``D'`` ranks end it
(padding or cut to a multiple of ``D'``; a loader's ``drop_last`` batch): when
that differs from the uninterrupted run, the load warns with the count.

The loader's own state is rewritten for the loading loader (its batch size,
its ``num_workers``): torchdata fast-forwards its sampler by the samples
(its ``BatchSampler``) or batches (torch's) recorded there. Called through
:mod:`bytecp.data`'s registry (kind ``"torchdata"``) on every rank: at a save
(:meth:`TorchdataResharder.position`) and in a load's match phase
(:meth:`TorchdataResharder.reshard`, nothing changed before the apply phase,
where the sampler's epoch is set).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

from torch.utils.data import BatchSampler as TorchBatchSampler
from torch.utils.data import DistributedSampler, IterableDataset

from bytecp.data import DataReshardError, Resharded, Resharder, SavedData
from bytecp.data.registry import has_hook
from bytecp.plugins import missing_extra

from .distributed import ORDER as _ORDER
from .distributed import epoch_done, order_of, same_order, sampler_sizes

try:
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader import sampler as td
except ModuleNotFoundError as e:  # (the registry imports this module only once torchdata is imported)
    raise missing_extra(e, "torchdata", __name__) from None

__all__ = ["TorchdataResharder", "sampler_sizes"]

#: the samplers whose order is known, by their ``__iter__`` (subclasses that keep it qualify)
_KNOWN = {DistributedSampler.__iter__: "DistributedSampler",
          td.StatefulDistributedSampler.__iter__: "StatefulDistributedSampler"}


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How a loader draws its indices."""

    sampler: Any
    #: "DistributedSampler", "StatefulDistributedSampler", "hook:<class>", or another sampler's class name
    name: str
    #: "samples" (torchdata's BatchSampler: fast-forwarded by samples), "batches" (torch's: by
    #: batches) or "none" (no batching: one index per item)
    batching: str
    batch_size: int
    drop_last: bool  # the batch sampler's

    @property
    def known(self) -> bool:
        return self.name in _KNOWN.values()

    @property
    def hook(self) -> bool:
        return self.name.startswith("hook:")


def _layout(loader: StatefulDataLoader) -> _Layout:
    bs = loader.batch_sampler
    if bs is None:
        sampler, batching, size, drop = loader.sampler, "none", 1, False
    elif type(bs) in (td.BatchSampler, TorchBatchSampler):
        sampler, size, drop = bs.sampler, int(bs.batch_size), bool(bs.drop_last)
        batching = "samples" if type(bs) is td.BatchSampler else "batches"
    else:
        sampler, batching, size, drop = bs, "custom", 0, False
    cls = type(sampler)
    name = _KNOWN.get(getattr(cls, "__iter__", None))
    if name is None:
        stateful = callable(getattr(sampler, "state_dict", None)) and callable(getattr(sampler, "load_state_dict", None))
        name = f"hook:{cls.__module__}.{cls.__qualname__}" if has_hook(sampler) and stateful \
            and batching in ("samples", "none") else cls.__name__
    return _Layout(sampler, name, batching, size, drop)


def _digest(state: Any) -> str:
    """A short digest of a loader state less its per-process seeds: alike on ranks at the same place."""
    def strip(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("_base_seed", "_shared_seed")}
        if isinstance(x, list | tuple):
            return [strip(v) for v in x]
        return x

    text = json.dumps(strip(state), sort_keys=True, default=repr)
    return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()[:16]


def _main(state: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The state's sampler part (the main snapshot with workers) and the batches yielded since it."""
    if "_snapshot" in state:
        return state["_snapshot"]["_main_snapshot"], int(state.get("_steps_since_snapshot", 0))
    return state, 0


def _sampler_state(main: dict[str, Any], lay: _Layout) -> Any:
    """The sampler's own saved state (stateful samplers), where torchdata keeps it."""
    if lay.batching == "none":
        return main.get("_index_sampler_state")
    return (main.get("_sampler_iter_state") or {}).get("sampler_state")


def _dataset_states(state: dict[str, Any]) -> list[Any]:
    """The dataset's saved state, one per worker (one with no workers)."""
    if "_snapshot" in state:
        workers = state["_snapshot"].get("_worker_snapshots", {})
        return [workers[k].get("dataset_state") for k in sorted(workers, key=lambda k: int(k.split("_")[-1]))]
    return [state.get("dataset_state")]


class TorchdataResharder(Resharder):
    """``StatefulDataLoader`` over a map-style dataset (registered as ``"torchdata"``)."""

    kind = "torchdata"

    def detect(self, obj: Any) -> bool:
        return isinstance(obj, StatefulDataLoader) and not isinstance(obj.dataset, IterableDataset)

    def position(self, loader: Any, state: Any) -> dict[str, Any]:
        lay = _layout(loader)
        pos: dict[str, Any] = {"sampler": lay.name, "batching": lay.batching, "batch_size": lay.batch_size,
                               "loader_drop_last": lay.drop_last, "num_workers": int(loader.num_workers),
                               "finished": bool(state.get("_iterator_finished", False))}
        s = lay.sampler
        if lay.known:
            main, since = _main(state)
            if lay.batching == "samples":
                done = int((main.get("_sampler_iter_state") or {}).get("samples_yielded", 0)) + since * lay.batch_size
            else:
                done = (int(main.get("_sampler_iter_yielded", 0)) + since) * lay.batch_size
            pos.update(epoch=int(s.epoch), samples=min(done, int(s.num_samples)), dp_size=int(s.num_replicas),
                       dataset_len=len(s.dataset), shuffle=bool(s.shuffle), seed=int(s.seed),
                       drop_last=bool(s.drop_last))
        elif lay.hook and callable(getattr(s, "data_position", None)):
            mine = dict(s.data_position())
            pos["sampler_position"] = mine
            pos.update({k: mine[k] for k in ("epoch", "samples", "dp_size") if k in mine})
        else:  # a sampler of no known order: whether every rank stands at the same place of the same stream
            pos["replica"] = _digest(state)
        return pos

    def same_layout(self, loader: Any, position: dict[str, Any]) -> bool:
        lay = _layout(loader)
        dp = int(lay.sampler.num_replicas) if lay.known else position.get("dp_size")
        return (position.get("sampler"), position.get("batching"), position.get("batch_size"),
                position.get("num_workers"), position.get("dp_size")) == (
            lay.name, lay.batching, lay.batch_size, int(loader.num_workers), dp) and (
            not lay.known or same_order(lay.sampler, position))

    def reshard(self, loader: Any, saved: SavedData, rank: int, world_size: int) -> Any:
        lay = _layout(loader)
        try:
            name = saved.value("sampler")
        except ValueError:
            raise DataReshardError("different samplers on different saved ranks") from None
        if lay.hook or str(name).startswith("hook:"):
            if name != lay.name:
                raise DataReshardError(f"saved with sampler {name}, the loader here has {lay.name}")
            return self._hooked(loader, lay, saved, rank, world_size)
        if not lay.known and name not in _KNOWN.values() and self._replicated(loader, lay, saved):
            # every saved rank read the same stream to the same place (no distributed sampler): each new
            # rank continues it from there, as every saved rank would have
            return saved.state(saved.template_rank(rank))
        if not lay.known or name not in _KNOWN.values():
            raise DataReshardError(
                f"its sampler ({name if name not in _KNOWN.values() else lay.name}) is not a DistributedSampler "
                "(nor a StatefulDistributedSampler) and has no reshard method: no known resharding")
        return self._distributed(loader, lay, saved, rank, world_size)

    @staticmethod
    def _replicated(loader: Any, lay: _Layout, saved: SavedData) -> bool:
        try:
            there = [saved.value(k) for k in ("replica", "sampler", "batching", "batch_size", "num_workers")]
        except ValueError:
            return False
        return there[0] is not None and there[1:] == [lay.name, lay.batching, lay.batch_size, int(loader.num_workers)]

    # ------------------------------------------------------------------ the distributed samplers
    def _distributed(self, loader: Any, lay: _Layout, saved: SavedData, rank: int, world_size: int) -> Any:
        s = lay.sampler
        here = order_of(s)
        try:
            there = {k: saved.value(k) for k in _ORDER}
            dp, epoch, finished = saved.value("dp_size"), saved.value("epoch"), saved.value("finished")
        except ValueError as e:
            raise DataReshardError(f"the saved ranks differ in {e} (an unknown number of samples would repeat or be "
                                   "skipped)") from None
        changed = [f"{k} {there[k]!r} saved, {here[k]!r} here" for k in _ORDER if there[k] != here[k]]
        if changed and not finished:  # (finished: the next epoch comes whole, in whichever order)
            raise DataReshardError(f"the data order changed ({'; '.join(changed)}): an unknown number of "
                                   "samples would repeat or be skipped")
        new_dp, per_rank, total = int(s.num_replicas), int(s.num_samples), int(s.total_size)
        whys = []
        try:
            consumed, repeat = dp * int(saved.value("samples")), 0
        except ValueError:  # the saved ranks stopped at different positions: resume at the slowest
            col = [int(v) for v in saved.column("samples")]
            consumed = dp * min(col)
            repeat = (sum(col) - min(col) * len(col)) * dp // len(col)
            whys.append(f"the saved ranks stopped at different positions ({min(col)} to {max(col)} samples each; "
                        f"resuming at the slowest, {repeat} sample(s) would be seen twice)")
        tpl = saved.state(saved.template_rank(rank))
        over = epoch_done(consumed, here["dataset_len"], total, self._saved_total(saved, there, dp))
        if finished:
            mine = 0
        elif over:
            mine = per_rank
        else:
            mine = consumed // new_dp
            if consumed % new_dp:
                repeat += consumed % new_dp
                whys.append(f"{consumed} samples of epoch {epoch} consumed by {dp} data-parallel ranks do not "
                            f"divide among {new_dp} ({consumed % new_dp} sample(s) would be seen twice)")
        if lay.batching == "batches" and mine % lay.batch_size and not finished and not over:
            repeat += (mine % lay.batch_size) * new_dp
            whys.append(f"torch's BatchSampler resumes at whole batches: {mine} samples per rank are not batches of "
                        f"{lay.batch_size} ({(mine % lay.batch_size) * new_dp} sample(s) would be seen twice)")
            mine -= mine % lay.batch_size
        after = self._epoch_setter(s, epoch)
        approx = Resharded(self._state(loader, lay, saved, (rank, world_size), tpl, mine, bool(finished),
                                       {"yielded": mine}, over=over and not finished),
                           after=after)
        note = None if finished or over else self._tail(saved, there, lay, new_dp, per_rank, mine)
        approx = dataclasses.replace(approx, note=note)
        if repeat:  # (approximated: with the epoch end's note too)
            raise DataReshardError("; ".join(whys) + (f": {repeat} sample(s) in all" if len(whys) > 1 else ""),
                                   repeat=repeat, approximate=approx)
        return approx

    @staticmethod
    def _saved_total(saved: SavedData, order: dict[str, Any], dp: int) -> int:
        """The samples the saved ranks' loaders yield in the epoch: the sampler's, less
        what a loader with ``drop_last`` leaves out of each rank's last batch."""
        per, _ = sampler_sizes(int(order["dataset_len"]), dp, bool(order["drop_last"]))
        try:
            size, drop = int(saved.value("batch_size") or 1), bool(saved.value("loader_drop_last"))
        except ValueError:  # (ranks batched differently: the sampler's count)
            return dp * per
        return dp * (per // size * size if drop else per)

    @staticmethod
    def _epoch_setter(sampler: Any, epoch: Any) -> Any:
        if epoch is None or not callable(getattr(sampler, "set_epoch", None)):
            return None

        def set_epoch() -> None:  # (apply phase) the position belongs to the saved epoch's order
            if getattr(sampler, "epoch", None) != epoch:
                sampler.set_epoch(epoch)

        return set_epoch

    @staticmethod
    def _tail(saved: SavedData, order: dict[str, Any], lay: _Layout, new_dp: int, per_rank: int,
              mine: int) -> str | None:
        """The epoch's end after the resume against the uninterrupted run's, in words (None: the same)."""
        try:
            dp, size, drop = int(saved.value("dp_size")), int(saved.value("batch_size") or 1), \
                bool(saved.value("loader_drop_last"))
        except ValueError:  # ranks batched differently: no one uninterrupted run to compare with
            return None
        n_old, _ = sampler_sizes(int(order["dataset_len"]), dp, bool(order["drop_last"]))
        old = dp * ((n_old // size) * size if drop else n_old)
        left = per_rank - mine
        new = new_dp * (mine + ((left // lay.batch_size) * lay.batch_size if lay.drop_last else left))
        if new == old:
            return None
        more = "more" if new > old else "fewer"
        return (f"the epoch ends as {new_dp} data-parallel ranks end it: {new} samples in all, {abs(new - old)} "
                f"{more} than the uninterrupted run on {dp} ranks ({old}): DistributedSampler pads the epoch "
                "(drop_last=False: repeating its first samples) or cuts it (drop_last=True) to a multiple of the "
                "ranks, and a loader with drop_last leaves out a last partial batch")

    # ------------------------------------------------------------------ samplers with a reshard method
    def _hooked(self, loader: Any, lay: _Layout, saved: SavedData, rank: int, world_size: int) -> Any:
        def sampler_state(r: int) -> Any:
            return _sampler_state(_main(saved.state(r))[0], lay)

        view = SavedData(saved.fqn, saved.world_size, saved.common, saved.varying, saved.ranks, sampler_state)
        new = lay.sampler.reshard(view, rank, world_size)
        tpl = saved.state(saved.template_rank(rank))
        return self._state(loader, lay, saved, (rank, world_size), tpl, 0, False, new)

    # ------------------------------------------------------------------ the new loader state
    def _state(self, loader: Any, lay: _Layout, saved: SavedData, where: tuple[int, int], tpl: dict[str, Any],
               samples: int, finished: bool, sampler_state: Any, *, over: bool = False) -> dict[str, Any]:
        """A ``StatefulDataLoader`` state for ``loader`` (its batching, its
        workers) at ``samples`` consumed by this rank (``over``: the whole
        epoch, its last partial batch included); seeds from ``tpl`` (the
        saved rank this one starts from), the dataset's state as saved."""
        stateful = lay.hook or lay.name == "StatefulDistributedSampler"
        batches = samples if lay.batching == "none" else samples // max(1, lay.batch_size)
        if over and lay.batching == "batches":  # torch's BatchSampler skips whole batches: every one of the epoch
            batches = len(loader.batch_sampler)
        tmain, _ = _main(tpl)
        main: dict[str, Any] = {
            "_index_sampler_state": sampler_state if stateful and lay.batching == "none" else None,
            "_sampler_iter_state": None,
            "_sampler_iter_yielded": batches,
            "_IterableDataset_len_called": None,
            "_shared_seed": tmain.get("_shared_seed"),
        }
        if lay.batching == "samples":
            main["_sampler_iter_state"] = {"samples_yielded": samples, **({"sampler_state": sampler_state}
                                                                          if stateful else {})}
        workers = int(loader.num_workers)
        datasets = self._datasets(loader, saved, where, tpl, max(1, workers))
        if workers == 0:
            return {**main, "_num_yielded": batches, "fetcher_state": None, "dataset_state": datasets[0],
                    "_iterator_finished": finished}
        seed = tmain.get("_base_seed")
        main.update(_num_workers=workers, _base_seed=seed if seed is not None else int.from_bytes(os.urandom(8)) >> 1)
        return {
            "_snapshot": {
                "_snapshot_step": batches,
                "_last_yielded_worker_id": (batches - 1) % workers,
                "_main_snapshot": main,
                "_worker_snapshots": {f"worker_{i}": {"worker_id": i, "dataset_state": datasets[i],
                                                      "fetcher_state": None} for i in range(workers)},
            },
            "_steps_since_snapshot": 0,
            "_iterator_finished": finished,
        }

    @staticmethod
    def _datasets(loader: Any, saved: SavedData, where: tuple[int, int], tpl: dict[str, Any], n: int) -> list[Any]:
        """The dataset's state for each of ``n`` workers: from its own
        ``reshard`` method (handed each saved rank's per-worker states), else
        as saved (a map-style dataset's state does not say which samples come next)."""
        ds = loader.dataset
        if has_hook(ds):
            view = SavedData(saved.fqn, saved.world_size, saved.common, saved.varying, saved.ranks,
                             lambda r: _dataset_states(saved.state(r)))
            new = ds.reshard(view, *where)
            return list(new) if isinstance(new, list) and len(new) == n else [new] * n
        mine = _dataset_states(tpl)
        if all(x is None for x in mine):
            return [None] * n
        if len(mine) == n:
            return mine
        if len({repr(x) for x in mine}) == 1:
            return [mine[0]] * n
        raise DataReshardError(f"its dataset ({type(loader.dataset).__name__}) keeps a different state in each of "
                               f"its {len(mine)} saved workers, which does not reshard to {n}: an unknown number "
                               "of samples would repeat or be skipped")
