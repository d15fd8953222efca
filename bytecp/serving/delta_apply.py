"""A follower's boxes brought forward by serving deltas, checked, and put in place.

Called by :mod:`bytecp.serving.delta_update` on every rank of a follower
(and, without a state to check against, by ``iter_weights(scatter=True)``),
after :func:`bytecp.serving.deltas.choose` picked each tensor's way and
:func:`bytecp.serving.deltas.read_payloads` read the parts:

1. :func:`bring_forward` (local) -- each of this rank's boxes of a tensor
   taken by deltas: for ``chain``, a box held in one host tensor is changed
   in place, step after step, each value a step replaces read and kept as it
   is overwritten (one pass over the changed elements' memory, not two:
   they are far apart, so each comes from memory); other boxes (a device
   tensor, several live tensors) get the changes of every step merged into
   one set of positions and values, the box untouched (the values a step
   replaces read from it, or from an earlier step's changes); for
   ``whole``, a staging tensor filled from the serving copy, then changed in
   place by the later steps. Each step's change to each saved box's element
   checksum is summed over the pieces this rank *owns* (a box a lower rank
   of the group also holds is counted there);
2. :func:`verdict` (every rank, over every rank's sums: one all-gather) --
   a saved box whose pieces do not add up to its recorded change, or whose
   pieces do not cover it, condemns its tensor on every rank alike (read
   whole instead, reported); so does a part that failed its crc32c anywhere.
   :func:`undo` then puts back what step 1 changed in place of those
   tensors -- and of every tensor, when anything fails before the update is
   taken: the state is as it was;
3. :func:`scatter` -- once every rank agreed: the merged changes written into
   the live tensors in place (an interruption finishes them first), and the
   version of every tensor changed moved.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import signal
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.autograd.graph import increment_version

from bytecp.errors import CorruptCheckpointError
from bytecp.format import kernels
from bytecp.format import serving_wire as wire
from bytecp.serving import delta_batch
from bytecp.serving.deltas import Chain, Mode, Part, Step
from bytecp.tree.dtype_names import ITEMSIZES
from bytecp.tree.dtypes import host_memoryview
from bytecp.tree.pools import KeptPool
from bytecp.tree.regions import Region

__all__ = ["Target", "Brought", "Record", "parts_for", "bring_forward", "verdict", "undo", "interrupts_held", "scatter",
           "Sums"]

_M64 = (1 << 64) - 1
#: below this many changed elements in all, boxes are brought forward on the caller's thread alone
PARALLEL_ELEMENTS = 1 << 18
#: the process's apply threads (kept between updates; sized by the first update's ``threads``)
_POOL = KeptPool(4, "bytecp-apply")
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: a saved box's checksum change at one step: (save id, fqn, offsets)
SumKey = tuple[str, str, tuple[int, ...]]
#: key -> [sum of the pieces, elements in them, recorded change, the box's elements]
Sums = dict[SumKey, list[int]]
#: a change made in place: ((fqn, box), the live bits, positions, the values they held before)
Record = tuple[tuple[str, Region], np.ndarray, np.ndarray, np.ndarray]


@dataclasses.dataclass
class Target:
    """One box of a served tensor on this rank and the live tensors holding it."""

    fqn: str  # stored name
    box: Region
    shape: tuple[int, ...]
    #: the serving dtype
    dtype: torch.dtype
    #: the live tensors holding the box (none: ``iter_weights``, which holds nothing and checks no sums)
    dsts: list[torch.Tensor]
    #: counted in the group's checksum sums (no lower rank holds this box)
    owned: bool = True


@dataclasses.dataclass
class Brought:
    """What :func:`bring_forward` made: merged changes (``chain``) or staging
    tensors (``whole``) per (fqn, box), the sums, and tensors that failed here."""

    nets: dict[tuple[str, Region], tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=dict)
    staged: dict[tuple[str, Region], torch.Tensor] = dataclasses.field(default_factory=dict)
    sums: Sums = dataclasses.field(default_factory=dict)
    failed: dict[str, str] = dataclasses.field(default_factory=dict)
    changed_elements: int = 0


def _map(fn: Any, items: Sequence[Any], threads: int, elements: int, size: Callable[[Any], int], *,
         grouped: bool = False) -> list[Any]:
    """``fn`` over ``items`` (results in their order): on the caller's thread
    and the process's apply threads (kept between updates) when there are
    ``threads`` > 1 and enough ``elements`` to pay for them, the items dealt
    into one group a thread, about equal by ``size(item)`` (one hand-off a
    thread, not one an item). ``grouped``: ``fn`` takes a thread's group
    (a list of items) and returns their results, in order."""
    if threads <= 1 or len(items) <= 1 or elements < PARALLEL_ELEMENTS:
        return list(fn(list(items))) if grouped else [fn(x) for x in items]
    pool = _POOL.get(threads)
    groups: list[list[int]] = [[] for _ in range(min(threads, len(items)))]
    loads = [0] * len(groups)
    for i in sorted(range(len(items)), key=lambda i: -size(items[i])):  # largest first
        j = loads.index(min(loads))
        groups[j].append(i)
        loads[j] += size(items[i])
    out: list[Any] = [None] * len(items)

    def run(group: list[int]) -> None:
        if grouped:
            for i, got in zip(group, fn([items[i] for i in group]), strict=True):
                out[i] = got
            return
        for i in group:
            out[i] = fn(items[i])

    futures: list[concurrent.futures.Future[None]] = []
    try:
        futures += [pool.submit(run, g) for g in groups[1:]]
        run(groups[0])
        for f in futures:
            f.result()
        return out
    except BaseException:  # nothing is still writing when the caller puts things back
        while True:
            try:
                concurrent.futures.wait(futures)
                break
            except BaseException:  # a second interruption: keep waiting
                continue
        raise


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """SIGINT held while the block runs, then delivered (KeyboardInterrupt,
    or the handler that was there): :func:`~bytecp.serving.delta_update.update_served`
    takes an update inside it (the swap and the writes, CPU only, never a
    read from storage), so an interruption finds it taken whole or not at
    all. Python runs signal handlers in the main thread only: elsewhere
    there is nothing to hold."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    try:
        before = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    except (ValueError, OSError):  # (not settable here)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
        if got:
            if callable(before):
                before(signal.SIGINT, None)
            elif before == signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)


def _steps(mode: Mode, chain: Chain) -> range:
    """The steps whose deltas a mode applies."""
    return range(mode.start + (mode.kind == "whole"), len(chain.steps))


#: a whole serving copy's element costs about this fraction of a changed element's apply (a copy, not a scattered read and write)
_COPY_SHARE = 8


def _work(chain: Chain, t: Target, mode: Mode) -> int:
    """What applying ``mode`` to box ``t`` costs, for dealing boxes to apply
    threads: the changed elements expected in the box (each step's count
    spread evenly over its saved box), a whole copy's elements counted
    1/:data:`_COPY_SHARE` each. (A box's numel alone would give one thread
    the large tensors whose rows mostly do not change, an embedding's.)"""
    work = t.box.numel // _COPY_SHARE if mode.kind == "whole" else 0
    for i in _steps(mode, chain):
        for _, e in chain.steps[i].entries(t.fqn):
            inter = e.box.intersect(t.box) if e.delta is not None and e.box.numel else None
            if inter is not None and e.delta is not None:
                work += e.delta.count * inter.numel // e.box.numel
    return work + 1


def parts_for(chain: Chain, modes: Mapping[str, Mode], targets: Sequence[Target]) -> list[Part]:
    """The payload parts this rank's boxes need."""
    out: list[Part] = []
    for t in targets:
        mode = modes.get(t.fqn)
        if mode is None or mode.kind == "rows":
            continue
        if mode.kind == "whole":
            out += [Part(mode.start, r, "whole", e.whole.offset, e.whole.nbytes, e.whole.crc32c)
                    for r, e in chain.steps[mode.start].entries(t.fqn) if e.whole is not None and e.box.intersect(t.box)]
        for i in _steps(mode, chain):
            out += [Part(i, r, "delta", e.delta.offset, e.delta.nbytes, e.delta.crc32c)
                    for r, e in chain.steps[i].entries(t.fqn) if e.delta is not None and e.box.intersect(t.box)]
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT[t.element_size()])


class _Decoded:
    """Each delta part decoded once: (positions in its box, the new values' bits)."""

    def __init__(self, payloads: Mapping[Part, memoryview], dtype: str) -> None:
        self.payloads, self.size = payloads, ITEMSIZES[dtype]
        self.bits = wire.bits_dtype(self.size)
        self._done: dict[Part, tuple[np.ndarray, np.ndarray]] = {}

    def delta(self, part: Part, e: wire.Entry, step: Step) -> tuple[np.ndarray, np.ndarray]:
        got = self._done.get(part)
        if got is None:
            assert e.delta is not None
            n = e.delta.count
            if n == 0:
                got = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=self.bits))
            else:
                raw = self.payloads.get(part)
                if raw is None:
                    raise _Missing(part)
                values = np.frombuffer(raw[: n * self.size], dtype=self.bits)
                try:
                    got = (wire.decode_positions(raw[n * self.size:], n, e.box.numel, ""), values)
                except CorruptCheckpointError as err:  # named here: the message is built only when needed
                    raise CorruptCheckpointError(f"{step.where(part.rank, e)}{err}") from None
            self._done[part] = got
        return got

    def whole(self, part: Part, e: wire.Entry) -> np.ndarray:
        raw = self.payloads.get(part)
        if raw is None:
            raise _Missing(part)
        return np.frombuffer(raw, dtype=self.bits).reshape(e.box.lengths)


class _Missing(Exception):
    def __init__(self, part: Part) -> None:
        self.part = part


def _merge(net_p: np.ndarray, net_b: np.ndarray, p: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Changes ``(p, b)`` over the changes ``(net_p, net_b)``: the later value wins; sorted by position."""
    if len(net_p) == 0 and (len(p) < 2 or bool((p[1:] > p[:-1]).all())):
        return p, b
    allp, allb = np.concatenate([net_p, p]), np.concatenate([net_b, b])
    order = np.argsort(allp, kind="stable")
    sp, sb = allp[order], allb[order]
    keep = np.ones(len(sp), dtype=bool)
    keep[:-1] = sp[1:] != sp[:-1]
    return sp[keep], sb[keep]


def _lookup(net_p: np.ndarray, net_b: np.ndarray, q: np.ndarray, held: Any) -> np.ndarray:
    """The bits at positions ``q``: from the changes so far, else from ``held()`` (the box)."""
    old = held(q)
    if len(net_p) and len(q):
        idx = np.searchsorted(net_p, q)
        idx_c = np.minimum(idx, len(net_p) - 1)
        hit = net_p[idx_c] == q
        old = np.where(hit, net_b[idx_c], old)
    return old


def _host_bits(t: torch.Tensor, bits: Any) -> np.ndarray | None:
    """A host tensor's elements as a flat NumPy array of their bits, sharing
    its memory (made from its address, no torch operation); None on a device
    or for a tensor that is not contiguous."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
        return None
    return np.frombuffer(host_memoryview(t), dtype=bits)


def _held_bits(dst: torch.Tensor, bits: Any) -> Any:
    """The bits of ``dst`` at positions ``q``: a function of ``q``."""
    arr = _host_bits(dst, bits)
    if arr is not None:
        return lambda q: np.take(arr, q)
    flat = _bits(dst.reshape(-1))
    return lambda q: flat[torch.from_numpy(q).to(flat.device)].cpu().numpy().view(bits)


def bring_forward(chain: Chain, modes: Mapping[str, Mode], targets: Sequence[Target],
                  payloads: Mapping[Part, memoryview], bad: Mapping[Part, str], dtype: str,
                  spare: dict[tuple[str, Region], torch.Tensor], threads: int = 4,
                  journal: list[list[Record]] | None = None) -> Brought:
    """(every rank, local) Step 1 of the module's docstring, for ``targets``,
    on up to ``threads`` threads (the kernels and NumPy's passes release the
    GIL). The changes made in place go into ``journal`` (the caller's, so
    that it can put them back whatever happens after; else a new one) as
    they are made; a failure here puts every one back before it raises."""
    dec = _Decoded(payloads, dtype)
    todo = [(t, modes[t.fqn]) for t in targets if t.fqn in modes and modes[t.fqn].kind != "rows"]
    journal = [] if journal is None else journal

    def one(job: tuple[Target, Mode]) -> tuple[Target, Brought | str]:
        t, mode = job
        part = Brought()
        recs: list[Record] = []
        journal.append(recs)  # before any change: each is recorded as it is made
        try:
            _one(chain, mode, t, dec, part, spare, dtype, recs)
        except _Missing as m:
            undo([recs])
            return t, bad.get(m.part, f"{chain.steps[m.part.step].url}: a serving part was not read")
        except CorruptCheckpointError as e:
            undo([recs])
            return t, str(e)
        except BaseException:
            undo([recs])
            raise
        return t, part

    kernel = kernels.compiled()
    plans = [_plan(chain, t, mode, dec, payloads) if kernel is not None else None for t, mode in todo]

    def group(jobs: list[tuple[Target, Mode, delta_batch.Plan | None]]) -> list[tuple[Target, Brought | str]]:
        """A thread's boxes: those planned in one kernel call, the others one by one."""
        batch: list[tuple[Target, delta_batch.Plan, list[Record]]] = [(t, pl, []) for t, _, pl in jobs if pl is not None]
        journal.extend(recs for _, _, recs in batch)  # before any change
        applied = iter(delta_batch.apply(kernel, [(pl, recs, (t.fqn, t.box)) for t, pl, recs in batch], chain,
                                         payloads, dec.bits) if batch else [])
        got: list[tuple[Target, Brought | str]] = []
        for t, mode, pl in jobs:
            if pl is None:
                got.append(one((t, mode)))
                continue
            a = next(applied)
            if a.failed is not None:
                undo([recs for t2, _, recs in batch if t2 is t])
                got.append((t, a.failed))
                continue
            part = Brought(changed_elements=a.changed)
            for step, e, change in a.sums if t.owned else ():
                _add_sum(part.sums, step, e, change, t.box.numel)
            got.append((t, part))
        return got

    elements = sum(p.nbytes for p in payloads) // max(1, dec.size)
    out = Brought()
    try:
        done = _map(group, [(t, mode, pl) for (t, mode), pl in zip(todo, plans, strict=True)], threads, elements,
                    lambda job: _work(chain, job[0], job[1]), grouped=True)
        for t, got in done:
            if isinstance(got, str):
                out.failed.setdefault(t.fqn, got)
                continue
            out.nets.update(got.nets)
            out.staged.update(got.staged)
            out.changed_elements += got.changed_elements
            for k, (sm, n, want, numel) in got.sums.items():
                cur = out.sums.setdefault(k, [0, 0, want, numel])
                cur[0] = (cur[0] + sm) & _M64
                cur[1] += n
        if out.failed:  # nothing of a failed tensor goes in
            undo(journal, out.failed)
            out.nets = {k: v for k, v in out.nets.items() if k[0] not in out.failed}
            out.staged = {k: v for k, v in out.staged.items() if k[0] not in out.failed}
            out.sums = {k: v for k, v in out.sums.items() if k[1] not in out.failed}
    except BaseException:  # (_map waited for every thread)
        undo(journal)
        raise
    return out


def _plan(chain: Chain, t: Target, mode: Mode, dec: _Decoded, payloads: Mapping[Part, memoryview]
          ) -> delta_batch.Plan | None:
    """Box ``t`` as :func:`bytecp.serving.delta_batch.apply` takes it (None: :func:`_one` does)."""
    if mode.kind != "chain" or not t.dsts or len({d.data_ptr() for d in t.dsts}) != 1:
        return None
    full = Region((0,) * len(t.shape), t.shape)
    return delta_batch.plan(chain, t.fqn, t.box, _steps(mode, chain), _host_bits(t.dsts[0], dec.bits),
                            wire.run_start(t.box, full), payloads)


def undo(journal: Sequence[list[Record]], fqns: Collection[str] | None = None) -> None:
    """Put back the changes :func:`bring_forward` made in place (of the
    tensors ``fqns``; None: all), the latest first; what is put back is
    forgotten, so a second call does nothing. Called once no thread is
    changing anything (or, for its own box's list, by the thread changing it)."""
    for recs in reversed(journal):
        keep = []
        for rec in reversed(recs):
            if fqns is None or rec[0][0] in fqns:
                wire.scatter_bits(rec[1], rec[2], rec[3])
            else:
                keep.append(rec)
        recs[:] = keep[::-1]


def _one(chain: Chain, mode: Mode, t: Target, dec: _Decoded, out: Brought,
         spare: dict[tuple[str, Region], torch.Tensor], dtype: str, recs: list[Record]) -> None:
    full = Region((0,) * len(t.shape), t.shape)
    key = (t.fqn, t.box)
    dst = t.dsts[0] if t.dsts else None
    held: Any = None
    live: np.ndarray | None = None  # the bits changed in place, step after step
    if mode.kind == "whole":
        st = spare.pop(key, None)
        if st is None or tuple(st.shape) != t.box.lengths or st.dtype != t.dtype or st.device.type != "cpu":
            st = torch.empty(t.box.lengths, dtype=t.dtype)
        view = _bits(st).numpy().view(dec.bits)
        filled = 0
        start = chain.steps[mode.start]
        for r, e in start.entries(t.fqn):
            inter = e.box.intersect(t.box) if e.whole is not None else None
            if inter is None:
                continue
            w = e.whole
            assert w is not None
            src = dec.whole(Part(mode.start, r, "whole", w.offset, w.nbytes, w.crc32c), e)
            view[inter.relative_to(t.box).slices()] = src[inter.relative_to(e.box).slices()]
            filled += inter.numel
        if filled != t.box.numel:
            raise CorruptCheckpointError(f"{start.url}: the serving copies of {t.fqn} cover {filled} of the "
                                         f"{t.box.numel} elements of box {t.box}")
        live = view.reshape(-1)
        out.staged[key] = st
    else:
        if dst is not None and not dst.is_contiguous():
            raise CorruptCheckpointError(f"{t.fqn}: this rank's box {t.box} is not contiguous in memory; read whole")
        arr = _host_bits(dst, dec.bits) if dst is not None else None
        if arr is not None and len({d.data_ptr() for d in t.dsts}) == 1:
            live = arr
        elif dst is not None:
            held = _held_bits(dst, dec.bits)
    kept = live is not None and mode.kind != "whole"  # the live tensor: what it held is kept for undo()
    qs = wire.run_start(t.box, full)
    net_p, net_b = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=dec.bits)
    for i in _steps(mode, chain):
        step = chain.steps[i]
        ps: list[np.ndarray] = []
        bs: list[np.ndarray] = []
        for r, e in step.entries(t.fqn):
            d = e.delta
            inter = None if d is None else t.box if e.box == t.box else e.box.intersect(t.box)
            if inter is None or d is None:
                continue
            pos, bits = dec.delta(Part(i, r, "delta", d.offset, d.nbytes, d.crc32c), e, step)
            mask, q = wire.relocate(pos, e.box, t.box)
            b = bits if mask is None else bits[mask]
            # linear indices in the tensor: q moved by where this rank's box starts, when it is a run of it
            g, g_add = ((None, qs) if qs is not None else
                        (wire.relocate(pos if mask is None else pos[mask], e.box, full)[1], 0))
            change = 0
            if live is not None:  # (the live tensor's change recorded as it is made)
                change, _ = wire.swap_bits(live, q, b, g, g_add, recs if kept else None, key)
            else:
                if t.owned:
                    change = wire.change_sum(q + g_add if g is None else g, b, _lookup(net_p, net_b, q, held))
                ps.append(q)
                bs.append(b)
            if t.owned:
                _add_sum(out.sums, step, e, change, inter.numel)
            out.changed_elements += len(q)
        if ps:
            net_p, net_b = _merge(net_p, net_b, np.concatenate(ps), np.concatenate(bs))
    if live is None:
        out.nets[key] = (net_p, net_b)


def _add_sum(sums: Sums, step: Step, e: wire.Entry, change: int, elements: int) -> None:
    """Count into ``sums`` a piece of ``elements`` elements of the saved box of
    entry ``e`` (step ``step``) whose checksum moved by ``change``."""
    s = sums.setdefault((step.save_id, e.fqn, e.box.offsets), [0, 0, (e.checksum - (e.before or 0)) & _M64, e.box.numel])
    s[0] = (s[0] + change) & _M64
    s[1] += elements


def verdict(gathered: Sequence[tuple[Sums, Mapping[str, str]]], names: Mapping[str, str] | None = None
            ) -> dict[str, str]:
    """(every rank, alike) The tensors to read whole instead: those a rank
    failed, and those a saved box of which does not add up (see the
    module's docstring). ``names``: save id -> the checkpoint's URL, for the message."""
    bad: dict[str, str] = {}
    total: dict[SumKey, list[int]] = {}
    for sums, failed in gathered:
        for fqn, why in failed.items():
            bad.setdefault(fqn, why)
        for k, (s, n, want, numel) in sums.items():
            cur = total.setdefault(k, [0, 0, want, numel])
            if cur[2] != want or cur[3] != numel:
                cur[2] = -1
            cur[0] = (cur[0] + s) & _M64
            cur[1] += n
    for (sid, fqn, offsets), (s, n, want, numel) in total.items():
        if fqn in bad:
            continue
        where = (names or {}).get(sid, f"save {sid}")
        if n != numel:
            bad[fqn] = f"{where}: the follower's boxes hold {n} of the {numel} elements of {fqn} at {list(offsets)}"
        elif s != want:
            bad[fqn] = (f"{where}: {fqn} at {list(offsets)}: the changed elements do not add up to the "
                        "recorded element checksum (a damaged delta, or a state that is not the checkpoint held)")
    return bad


def scatter(targets: Sequence[Target], nets: Mapping[tuple[str, Region], tuple[np.ndarray, np.ndarray]],
            dtype: torch.dtype, threads: int = 4, changed: Collection[tuple[str, Region]] | None = None) -> None:
    """(every rank, once the group agreed) Write each box's merged changes into
    its live tensors, in place; an interruption finishes every write first.
    The boxes ``changed`` in place already only have their tensors' versions moved."""
    jobs: list[tuple[torch.Tensor, np.ndarray, np.ndarray]] = []
    for t in targets:
        if changed is not None and (t.fqn, t.box) in changed:  # changed in place by bring_forward
            for dst in {d.data_ptr(): d for d in t.dsts}.values():
                increment_version(dst)
            continue
        got = nets.get((t.fqn, t.box))
        if got is None or not len(got[0]):
            continue
        seen: set[int] = set()
        for dst in t.dsts:
            if dst.data_ptr() not in seen:
                seen.add(dst.data_ptr())
                jobs.append((dst, got[0], got[1]))
    done: set[int] = set()

    def write(i: int) -> None:
        dst, pos, bits = jobs[i]
        _write(dst, pos, bits, dtype)
        done.add(i)

    try:
        _map(write, range(len(jobs)), threads, sum(len(j[1]) for j in jobs), lambda i: len(jobs[i][1]))
    except BaseException:
        for i in range(len(jobs)):
            if i not in done:
                _write(*jobs[i], dtype)
        raise


def _write(dst: torch.Tensor, pos: np.ndarray, bits: np.ndarray, dtype: torch.dtype) -> None:
    """``bits`` (the serving dtype's) at flat (row-major) positions ``pos`` of
    ``dst``, a device or a strided tensor too; its version moves."""
    arr = _host_bits(dst, bits.dtype)
    if arr is not None:
        wire.scatter_bits(arr, pos, bits)
    else:
        vals = torch.from_numpy(np.ascontiguousarray(bits).view(_np_int(dtype))).view(dtype)
        with torch.no_grad():  # put_: row-major positions whatever the strides
            dst.put_(torch.from_numpy(pos).to(dst.device), vals.to(dst.device))
    increment_version(dst)  # incremental saves of the follower's state must see the change


def _np_int(dtype: torch.dtype) -> Any:
    return {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[dtype.itemsize]
