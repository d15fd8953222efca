"""The position of a DeepSpeed engine's training data loader, saved per rank
and continued exactly under another data-parallel size.

``deepspeed.initialize(..., training_data=dataset)`` builds
``engine.training_dataloader``, a ``DeepSpeedDataLoader`` drawing with torch's
``DistributedSampler`` (``num_replicas`` the data-parallel size). It keeps
no position: every ``iter()`` starts the sampler's epoch over, and
DeepSpeed's own checkpoints save none (only the curriculum sampler's, which
:mod:`.engine` keeps). :class:`LoaderPosition` is what
:func:`.adapter.expand_engines` adds beside an engine that has one, under
``"training_dataloader"``:

- save (every rank): this rank's samples consumed in the sampler's epoch,
  read from the torch ``DataLoader`` iterator DeepSpeed's loader draws from
  (its count of batches handed out, so batches its workers prefetched do
  not count), plus the samples a resumed iteration skipped;
- load (every rank, apply phase): the sampler's epoch is set and the loader's
  next iteration (a current one is started again at once) skips the
  samples this rank already had: its sampler is wrapped for that one
  iteration by :class:`_Skip`, the first ``n`` indices left out.

Across a data-parallel size change the ``DistributedSampler`` arithmetic
(:mod:`bytecp.adapters.data.distributed`) continues the epoch:
:class:`DeepSpeedLoaderResharder` (kind ``"deepspeed"``) gives each new rank
``D*s / D'`` samples to skip; with the global batch unchanged every later
step holds the uninterrupted run's samples. Skipping is by samples, so no
batch alignment is needed; counts that do not divide among the new ranks
are refused (or, with ``data_reshard="approximate"``, rounded down, the
count named).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DistributedSampler

from bytecp.data import DataReshardError, Resharded, Resharder, SavedData

from ..data.distributed import ORDER, epoch_done, order_of, same_order, sampler_sizes

__all__ = ["LoaderPosition", "DeepSpeedLoaderResharder", "loader_of"]


def loader_of(engine: Any) -> Any:
    """The engine's training data loader whose position bytecp keeps: a
    ``DeepSpeedDataLoader`` over ``DistributedSampler`` (not the curriculum
    sampler's, kept by the engine state), else None."""
    loader = getattr(engine, "training_dataloader", None)
    if loader is None or type(loader).__name__ != "DeepSpeedDataLoader" or \
            getattr(loader, "curriculum_learning_enabled", False):
        return None
    return loader if isinstance(_base(loader.data_sampler), DistributedSampler) else None


class _Skip:
    """A sampler that leaves out the first ``skip`` indices of ``base``'s
    iteration (one epoch); everything else is ``base``'s."""

    def __init__(self, base: Any, skip: int) -> None:
        self.base, self.skip = base, skip

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.base), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.base) - self.skip)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)


def _base(sampler: Any) -> Any:
    return sampler.base if isinstance(sampler, _Skip) else sampler


class _Resume:
    """Stands for a ``DeepSpeedDataLoader``'s ``_create_dataloader`` (on the
    instance): a pending skip is applied to the iteration it creates, and
    the skip of the current iteration is remembered for the next save."""

    def __init__(self, loader: Any, create: Any) -> None:
        self.loader, self.create = loader, create
        self.pending = 0
        self.current: tuple[Any, int] = (None, 0)  # (DeepSpeed's generator of the iteration, its skip)

    def __call__(self) -> Any:
        skip, self.pending = self.pending, 0
        base = _base(self.loader.data_sampler)
        self.loader.data_sampler = _Skip(base, skip) if skip else base
        try:
            out = self.create()
        finally:
            self.loader.data_sampler = base
        self.current = (self.loader.data, skip)
        return out


def _resume_of(loader: Any) -> _Resume:
    hook = loader.__dict__.get("_create_dataloader")
    if not isinstance(hook, _Resume):
        hook = _Resume(loader, loader._create_dataloader)
        loader._create_dataloader = hook
    return hook


class LoaderPosition:
    """A ``Stateful`` for one engine's training data loader (per rank):
    ``{"epoch", "samples", "finished"}`` of this data-parallel rank."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    @property
    def sampler(self) -> DistributedSampler[Any]:
        s = _base(self.loader.data_sampler)
        assert isinstance(s, DistributedSampler)
        return s

    def consumed(self) -> tuple[int, bool]:
        """(samples this rank consumed in the epoch, whether its iteration ended)."""
        loader, per_rank = self.loader, int(self.sampler.num_samples)
        hook = loader.__dict__.get("_create_dataloader")
        gen = getattr(loader, "data", None)
        if gen is None:
            return (hook.pending if isinstance(hook, _Resume) else 0), False
        if getattr(gen, "gi_frame", None) is None:  # DeepSpeed's generator ran out: the epoch is done
            return per_rank, True
        it = gen.gi_frame.f_locals.get(".0")
        yielded = getattr(it, "_num_yielded", None)
        if not isinstance(yielded, int):
            raise DataReshardError("DeepSpeed's training loader draws from an iterator bytecp cannot read "
                                   f"({type(it).__name__}): its position is unknown")
        skip = hook.current[1] if isinstance(hook, _Resume) and hook.current[0] is gen else 0
        return min(per_rank, skip + yielded * int(loader.batch_size)), False

    def state_dict(self) -> dict[str, Any]:
        samples, finished = self.consumed()
        return {"epoch": int(self.sampler.epoch), "samples": samples, "finished": finished}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """(apply phase) The sampler's epoch, and the skip for the loader's next
        iteration; an iteration already under way starts again from there."""
        sampler = self.sampler
        if sd.get("epoch") is not None and sampler.epoch != int(sd["epoch"]):
            sampler.set_epoch(int(sd["epoch"]))
        hook = _resume_of(self.loader)
        hook.pending = 0 if sd.get("finished") else int(sd.get("samples") or 0)
        if getattr(self.loader, "data", None) is not None:
            hook()


class DeepSpeedLoaderResharder(Resharder):
    """:class:`LoaderPosition` (registered as ``"deepspeed"``)."""

    kind = "deepspeed"

    def detect(self, obj: Any) -> bool:
        return isinstance(obj, LoaderPosition)

    def position(self, obj: Any, state: Any) -> dict[str, Any]:
        s, loader = obj.sampler, obj.loader
        return {"sampler": "DistributedSampler", "epoch": state["epoch"], "samples": state["samples"],
                "finished": state["finished"], "dp_size": int(s.num_replicas), "dataset_len": len(s.dataset),
                "shuffle": bool(s.shuffle), "seed": int(s.seed), "drop_last": bool(s.drop_last),
                "batch_size": int(loader.batch_size), "loader_drop_last": bool(loader.dataloader_drop_last)}

    def same_layout(self, obj: Any, position: dict[str, Any]) -> bool:
        return position.get("dp_size") == int(obj.sampler.num_replicas) and same_order(obj.sampler, position)

    def reshard(self, obj: Any, saved: SavedData, rank: int, world_size: int) -> Any:
        s = obj.sampler
        here = order_of(s)
        try:
            there = {k: saved.value(k) for k in ORDER}
            dp, epoch, finished = int(saved.value("dp_size")), saved.value("epoch"), saved.value("finished")
        except ValueError as e:
            raise DataReshardError(f"the saved ranks differ in {e}: an unknown number of samples would repeat or "
                                   "be skipped") from None
        changed = [f"{k} {there[k]!r} saved, {here[k]!r} here" for k in ORDER if there[k] != here[k]]
        if changed and not finished:  # (finished: the next epoch comes whole, in whichever order)
            raise DataReshardError(f"the data order changed ({'; '.join(changed)}): an unknown number of samples "
                                   "would repeat or be skipped")
        new_dp, per_rank = int(s.num_replicas), int(s.num_samples)
        try:  # alike on every saved rank (a synchronous run): O(1) of the record
            consumed, repeat, whys = dp * int(saved.value("samples")), 0, []
        except ValueError:  # the saved ranks stopped at different positions: resume at the slowest
            col = [int(v) for v in saved.column("samples")]
            consumed = dp * min(col)
            repeat = (sum(col) - min(col) * len(col)) * dp // len(col)
            whys = [f"the saved ranks stopped at different positions ({min(col)} to {max(col)} samples each; "
                    f"resuming at the slowest, {repeat} sample(s) would be seen twice)"]
        _, total = sampler_sizes(int(there["dataset_len"]), new_dp, bool(there["drop_last"]))
        old_n, saved_total = sampler_sizes(int(there["dataset_len"]), dp, bool(there["drop_last"]))
        over = epoch_done(consumed, int(here["dataset_len"]), total, saved_total)  # (saved after its last batch)
        mine = 0 if finished else per_rank if over else consumed // new_dp
        if not finished and not over and consumed % new_dp:
            repeat += consumed % new_dp
            whys.append(f"{consumed} samples of epoch {epoch} consumed by {dp} data-parallel ranks do not divide "
                        f"among {new_dp} ({consumed % new_dp} sample(s) would be seen twice)")
        state = {"epoch": epoch, "samples": mine, "finished": bool(finished)}
        new_n = new_dp * per_rank
        note = None if finished or over or new_n == dp * old_n else (
            f"epoch {epoch} ends as {new_dp} data-parallel ranks end it: {new_n} samples, {abs(new_n - dp * old_n)} "
            f"{'more' if new_n > dp * old_n else 'fewer'} than the uninterrupted run on {dp} ranks "
            f"({dp * old_n}): DistributedSampler pads the epoch (drop_last=False: repeating its first samples) or "
            "cuts it (drop_last=True) to a multiple of the ranks")
        if repeat:  # (approximated: with the epoch end's note too)
            raise DataReshardError("; ".join(whys), repeat=repeat, approximate=Resharded(state, note=note))
        return Resharded(state, note=note)
