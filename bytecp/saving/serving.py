"""Serving deltas, written with a save that asks for them
(``serving_dtype=torch.bfloat16``): for every floating box this rank writes,
the elements whose value *in the serving dtype* changed since the previous
checkpoint of the run, so that followers holding the model in that dtype
read only those (FORMAT.md §13; :mod:`bytecp.format.serving_wire`).

Who calls what (every rank, on the thread that writes the save's data: the
caller's for ``bytecp.save``, the background thread for ``async_save``, so
an async save blocks training no longer than without deltas):

1. :meth:`ServingWriter.add` -- the save pipeline's write, each batch just
   before its data files are written: the staged copy of each box is cast to
   the serving dtype and compared with this rank's *base* -- its own
   serving-dtype copy of the boxes it wrote (or referenced) in its last
   committed save of the run (:data:`SERVING_BASES`) -- into the changed
   positions and values, and the box's element checksum moved by them; a
   box without a base (the first save, a new plan), or whose changes would
   cost a reader more than the box (:func:`bytecp.format.serving_wire.delta_cost`),
   goes whole;
2. :meth:`ServingWriter.finish` -- the end of the write: this rank's
   ``serving/<save_id>/<rank>.json`` (entries, also for the boxes it
   references unchanged), ``.bin`` (the changes) and, on a whole save,
   ``.whole.bin``; the coordinator's ``serving.json``;
3. :meth:`ServingWriter.committed` -- once the save has committed: the new
   values become the base of the next save (a failed save leaves it as it was).

Deltas never fail a save: a rank that cannot compute or write them logs a
warning, writes none (followers read those tensors whole) and forgets its
base, so its next save writes whole boxes. Its files go with the save's
(``serving/<save_id>/``: removed with a failed save, a checkpoint, a replaced one).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from bytecp.format import serving_wire as wire
from bytecp.format.checksum import crc32c
from bytecp.format.references import name_of, run_url
from bytecp.storage_api import Storage
from bytecp.tree.dtypes import dtype_from_name
from bytecp.tree.regions import Region

__all__ = ["SERVING_BASES", "ServingWriter", "default_prefixes", "floating"]

log = logging.getLogger("bytecp")

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def floating(dtype: str) -> bool:
    """Whether tensors of the stored dtype ``dtype`` get serving deltas."""
    return dtype.startswith(("float", "bfloat"))


def default_prefixes(state: Mapping[str, Any]) -> tuple[str, ...]:
    """The state's entries whose tensors get deltas when the save names none:
    its modules, or when it has none every entry but its optimizers and LR schedulers."""
    modules = tuple(k for k, v in state.items() if isinstance(v, nn.Module))
    if modules:
        return modules
    skip = (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)
    return tuple(k for k, v in state.items() if not isinstance(v, skip))


@dataclasses.dataclass
class _Box:
    """A box's serving-dtype values as this rank last committed them, and their element checksum."""

    values: torch.Tensor  # flat, the serving dtype
    checksum: int


@dataclasses.dataclass
class _Base:
    """This rank's serving copy of its boxes at the checkpoint ``link``."""

    link: wire.Link
    boxes: dict[tuple[str, Region], _Box]


class _Bases:
    """Per (run, world size, rank, serving dtype): the base of the next save's deltas."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[tuple[Any, ...], _Base] = {}

    def get(self, key: tuple[Any, ...]) -> _Base | None:
        with self._lock:
            return self._by_key.get(key)

    def put(self, key: tuple[Any, ...], base: _Base | None) -> None:
        with self._lock:
            if base is None:
                self._by_key.pop(key, None)
            else:
                self._by_key[key] = base

    def clear(self) -> None:
        with self._lock:
            self._by_key.clear()


SERVING_BASES = _Bases()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT[t.element_size()])


def _np_bits(t: torch.Tensor) -> np.ndarray:
    return _bits(t).numpy().view(wire.bits_dtype(t.element_size()))


@dataclasses.dataclass
class _Pending:
    """(add -> committed) A box's new base: its new values whole, or the changes to the old."""

    entry: wire.Entry
    #: the box's new values whole (a box written whole, or with no base)
    whole: torch.Tensor | None = None
    #: else the positions that changed and their new values' bits
    positions: np.ndarray | None = None
    values: np.ndarray | None = None


class ServingWriter:
    """One save's serving deltas on one rank (see the module's docstring)."""

    def __init__(self, url: str, dtype: str, prefixes: Sequence[str], whole: bool, world_size: int, rank: int,
                 coordinator: bool) -> None:
        self.dtype, self.torch_dtype = dtype, dtype_from_name(dtype)
        self.prefixes = tuple(prefixes)
        self.whole, self.world_size, self.rank, self.coordinator = whole, world_size, rank, coordinator
        self.name = name_of(url)
        try:
            run = run_url(url)
        except Exception:  # noqa: BLE001 - a checkpoint at a storage's root: no run, no deltas between saves
            run = url
        self.key = (run, world_size, rank, dtype)
        #: read at the first batch: the previous save (in flight when this one was asked for) has committed by then
        self._base: _Base | None = None
        self._base_read = False
        self.pending: dict[tuple[str, Region], _Pending] = {}
        self.delta_pieces: list[Any] = []
        self.whole_pieces: list[Any] = []
        self.delta_nbytes = self.whole_nbytes = 0
        self.failed: BaseException | None = None
        self.entries: list[wire.Entry] = []

    @property
    def base(self) -> _Base | None:
        if not self._base_read:
            self._base, self._base_read = SERVING_BASES.get(self.key), True
        return self._base

    def wants(self, fqn: str, dtype: str) -> bool:
        return floating(dtype) and any(fqn == p or fqn.startswith(p + ".") for p in self.prefixes)

    # -- 1. each batch ---------------------------------------------------------
    def add(self, staged: Iterable[Any]) -> None:
        """(the write phase, each batch before it is written) Entries for the
        staged boxes (:class:`~bytecp.saving.writer.Staged`) this save serves."""
        if self.failed is not None:
            return
        try:
            for s in staged:
                it = s.item
                if self.wants(it.fqn, it.dtype) and it.region.numel:
                    self._add(it.fqn, it.region, it.global_shape, dtype_from_name(it.dtype), s.data)
        except Exception as e:  # noqa: BLE001 - deltas never fail the save
            self._fail(e)

    def _add(self, fqn: str, box: Region, shape: tuple[int, ...], stored: torch.dtype, data: memoryview) -> None:
        raw = np.frombuffer(data, dtype=np.uint8)
        src = torch.from_numpy(raw if not data.readonly else raw.copy()).view(stored)
        new = src.to(self.torch_dtype) if stored != self.torch_dtype else src.clone()
        bits = _np_bits(new)
        old = self.base.boxes.get((fqn, box)) if self.base is not None else None
        delta = pos = values = None
        if old is not None and old.values.numel() == new.numel():  # (NumPy: torch's indexing is slower here)
            was = _np_bits(old.values)
            diff = bits != was
            count = int(np.count_nonzero(diff))
            before = old.checksum
            # a position takes a byte at least: past this many changes no delta costs a reader less than the box,
            # which is then written whole, its checksum summed afresh (fewer passes than summing dense changes)
            if wire.delta_cost(count * (bits.itemsize + 1), count) < bits.nbytes:
                pos = np.flatnonzero(diff)
                values = bits[pos]
                g = wire.relocate(pos, box, Region((0,) * len(shape), shape))[1]
                checksum = (old.checksum + wire.change_sum(g, values, was[pos])) & ((1 << 64) - 1)
                pbytes = wire.encode_positions(pos)
                if wire.delta_cost(len(pbytes) + values.nbytes, len(pos)) < bits.nbytes:  # else written whole:
                    delta = self._delta_part(values, pbytes)  # a reader takes it for less (FORMAT.md §13)
            else:
                checksum = wire.box_checksum(bits, box, shape)
        else:
            checksum, before = wire.box_checksum(bits, box, shape), None
        whole = self._whole_part(new) if self.whole or delta is None else None
        entry = wire.Entry(fqn, box, checksum, before if delta is not None else None, delta, whole)
        if whole is not None:
            self.pending[(fqn, box)] = _Pending(entry, whole=new)
        else:
            self.pending[(fqn, box)] = _Pending(entry, positions=pos, values=values)

    def _delta_part(self, values: np.ndarray, pbytes: bytes) -> wire.DeltaPart:
        vbytes = values.tobytes()
        at = self.delta_nbytes
        crc = crc32c(pbytes, crc32c(vbytes)) if len(values) else 0
        n = len(vbytes) + len(pbytes)
        if n:
            self.delta_pieces += [vbytes, pbytes, bytes(-n % wire.ALIGN)]
            self.delta_nbytes += n + (-n % wire.ALIGN)
        return wire.DeltaPart(at if n else 0, len(values), len(pbytes), n, crc)

    def _whole_part(self, new: torch.Tensor) -> wire.WholePart:
        view = _np_bits(new).data.cast("B")
        at = self.whole_nbytes
        self.whole_pieces += [view, bytes(-len(view) % wire.ALIGN)]
        self.whole_nbytes += len(view) + (-len(view) % wire.ALIGN)
        return wire.WholePart(at, len(view), crc32c(view))

    # -- 2. the end of the write -------------------------------------------------
    def finish(self, storage: Storage, save_id: str, step: int | None, referenced: Iterable[Any]) -> None:
        """(the write phase, after the last batch) This rank's files, and the
        coordinator's manifest; ``referenced``: the rows this rank references
        unchanged (their boxes keep their base: entries of no change)."""
        if self.failed is not None:
            return
        try:
            previous = self.base.link if self.base is not None else None
            for r in referenced:
                box = Region(tuple(r.offsets), tuple(r.lengths))
                old = self.base.boxes.get((r.fqn, box)) if self.base is not None else None
                if old is not None and self.wants(r.fqn, r.dtype):
                    self.pending[(r.fqn, box)] = _Pending(wire.Entry(
                        r.fqn, box, old.checksum, old.checksum, wire.DeltaPart(0, 0, 0, 0, 0)))
            entries = tuple(p.entry for p in self.pending.values())
            if self.delta_nbytes:
                storage.write_file(wire.delta_path(save_id, self.rank), self.delta_pieces)
            if self.whole_nbytes:
                storage.write_file(wire.whole_path(save_id, self.rank), self.whole_pieces)
            storage.write_file(wire.entries_path(save_id, self.rank), [wire.RankEntries(
                save_id, self.rank, self.dtype, step, previous, entries, self.delta_nbytes,
                self.whole_nbytes).to_bytes()])
            if self.coordinator:
                storage.write_file(wire.manifest_path(save_id), [wire.Manifest(
                    save_id, self.dtype, self.world_size, step, previous).to_bytes()])
            self.step, self.save_id = step, save_id
        except Exception as e:  # noqa: BLE001 - deltas never fail the save
            self._fail(e)
        finally:
            self.delta_pieces, self.whole_pieces = [], []

    # -- 3. after the commit ---------------------------------------------------
    def committed(self, save_id: str, step: int | None) -> None:
        """(after the commit) This save's values are the next save's base:
        every box it wrote or referenced; others are forgotten."""
        if self.failed is not None:
            SERVING_BASES.put(self.key, None)
            return
        boxes: dict[tuple[str, Region], _Box] = {}
        for key, p in self.pending.items():
            old = self.base.boxes.get(key) if self.base is not None else None
            if p.whole is not None:
                boxes[key] = _Box(p.whole, p.entry.checksum)
            elif old is not None:
                if p.positions is not None and p.values is not None and len(p.positions):
                    _np_bits(old.values)[p.positions] = p.values
                boxes[key] = _Box(old.values, p.entry.checksum)
        SERVING_BASES.put(self.key, _Base(wire.Link(self.name, save_id, step), boxes))
        self.pending = {}

    def _fail(self, e: BaseException) -> None:
        self.failed = e
        self.pending = {}
        log.warning("bytecp: rank %d wrote no serving deltas for %s (%s: %s); followers read its boxes whole, "
                    "and its next save writes them whole", self.rank, self.name, type(e).__name__, e)
