"""One update of a follower holding its model in a serving dtype
(``bytecp.follow(..., dtype=torch.bfloat16)``): the changed tensors are
taken by the run's serving deltas where that reads fewer bytes, the rest
read whole and cast.

Called by :meth:`bytecp.serving.follow._Follower.update` on every rank of
the follower, once the coordinator chose the checkpoint. In order:

1. (every rank, local) open the checkpoint; for the floating tensors held in
   the serving dtype walk the chain of deltas from the held save and choose
   each tensor's way
   (:mod:`bytecp.serving.deltas`); read and bring forward this rank's boxes
   (:mod:`bytecp.serving.delta_apply`: a box in one host tensor changed in
   place, what it held kept); the deltas say which of those
   changed, the index rows (read only for the other tensors) which of the
   rest, read whole and cast (:func:`bytecp.serving.staging.stage`);
2. (one all-gather) every rank's element-checksum sums and failures: a
   tensor that does not add up, or failed anywhere, is put back as it was
   and read whole by every rank (a second local read and one more
   agreement), and reported; anything failing up to here (on any rank)
   puts back every box changed in place before it raises;
3. (every rank) swap the staged tensors in and scatter the changes into the
   others, in place.

In a follower group a box a lower rank also holds is not counted in the
sums (:func:`owned_boxes`: the ranks' boxes gathered once when it starts).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from bytecp.dist import DistContext
from bytecp.format import metadata as fmt
from bytecp.format import serving_wire as wire
from bytecp.loading.opened import Shared
from bytecp.serving.changes import changed_tensors
from bytecp.serving.delta_apply import (
    Record,
    Target,
    bring_forward,
    interrupts_held,
    parts_for,
    scatter,
    undo,
    verdict,
)
from bytecp.serving.deltas import Chain, Mode, choose, read_payloads, walk
from bytecp.serving.staging import Held, stage, swap_in
from bytecp.storage_api import Storage, open_storage
from bytecp.tree.dtype_names import ITEMSIZES
from bytecp.tree.dtypes import dtype_from_name, dtype_name
from bytecp.tree.regions import Region

__all__ = ["Served", "owned_boxes", "resolver", "update_served"]

log = logging.getLogger("bytecp")

#: threads that bring boxes forward and scatter them (NumPy releases the GIL for both)
_THREADS = int(os.environ.get("BYTECP_APPLY_THREADS", min(4, os.cpu_count() or 1)))


def owned_boxes(held: Mapping[str, Held], ctx: DistContext) -> tuple[dict[tuple[str, Region], bool], set[str]]:
    """(every rank, once; one all-gather in a group) Which of this rank's
    boxes it counts in the checksum sums -- those no lower rank also holds --
    and the tensors whose boxes overlap across ranks in part (never by deltas)."""
    mine = [(f, b) for f, h in held.items() for b, _ in h.boxes]
    if not ctx.enabled:
        return {k: True for k in mine}, set()
    every = ctx.all_gather("follow/boxes", lambda: mine)
    owned: dict[tuple[str, Region], bool] = {}
    partial: set[str] = set()
    for f, b in mine:
        own = True
        for q in range(ctx.rank):
            for g, other in every[q]:
                if g != f or other.intersect(b) is None:
                    continue
                if other.contains(b):
                    own = False
                else:
                    partial.add(f)
        owned[(f, b)] = own
    return owned, partial


@dataclasses.dataclass
class Served:
    """What an update by deltas reports (fields of :class:`~bytecp.serving.follow.FollowUpdate`)."""

    bytes_read: int = 0
    tensors_read: int = 0
    tensors_unchanged: int = 0
    unchanged_by_reference: int = 0
    tensors_by_delta: int = 0
    delta_steps: int = 0
    elements_changed: int = 0
    fallbacks: list[str] = dataclasses.field(default_factory=list)
    save_id: str = ""
    created: float = 0.0
    rows: dict[str, list[fmt.ChunkRecord]] = dataclasses.field(default_factory=dict)


def resolver(run_urls: Mapping[str, str], options: Mapping[str, Mapping[str, Any]]
             ) -> Any:
    """Where a ``previous`` link is looked for: the same tier's run first, then the others."""
    def resolve(link: wire.Link, tier: str) -> Iterator[tuple[str, str, Storage]]:
        for t in sorted(run_urls, key=lambda x: x != tier):
            url = f"{run_urls[t]}/{link.name}"
            yield url, t, open_storage(url, **options[t])
    return resolve


def update_served(f: Any, url: str, tier: str, shared: Shared, dtype: str,
                  owned: Mapping[tuple[str, Region], bool], partial: set[str], run_urls: Mapping[str, str]) -> Served:
    """(every rank) Take checkpoint ``url`` of ``tier`` (``shared``: opened by
    the coordinator, :meth:`~bytecp.serving.follow._Follower.opened_for_ranks`)
    into the follower ``f`` (a :class:`~bytecp.serving.follow._Follower`);
    raises, with the state untouched, when it cannot (see the module's docstring)."""
    ctx: DistContext = f.ctx
    sdtype = dtype
    options = {t: f.sources.options_for(t) for t in run_urls}
    kept: dict[str, Any] = {}
    journal: list[list[Record]] = []  # the changes made in place, put back unless the update is taken

    def local() -> tuple[Any, Mapping[str, str]]:
        storage = open_storage(url, **options[tier])
        opened = f.received(url, tier, shared)
        md = opened.metadata
        wanted = f._wanted(md, url)
        names = list(dict.fromkeys(wanted.values()))
        served = [s for s in names if _serves(f.held, wanted, s, md, sdtype) and
                  not any(w in partial for w, s2 in wanted.items() if s2 == s)]
        chain = Chain([], False, [])
        modes: dict[str, Mode] = {}
        if served:
            numel = {s: _numel(md, s) for s in served}
            budget = sum(numel[s] * ITEMSIZES[md.tensors[s]["dtype"]] for s in served)
            chain = walk((url, tier, storage), md.save_id, f.save_id, sdtype, resolver(run_urls, options), budget,
                         [(s, numel[s]) for s in served], threads=f.io_threads)
            modes = {s: m for s in served if (m := choose(chain, s, numel[s], md.tensors[s]["dtype"])).kind != "rows"}
        # the deltas say what changed of the tensors they take; the index rows, of the rest (read only for those)
        same = [s for s, m in modes.items() if m.kind == "chain" and not _changes(chain, s)]
        rest = [s for s in names if s not in modes]
        rows = f._rows(opened, {w: s for w, s in wanted.items() if s in rest}) if rest else {}
        changes = (changed_tensors(rest, rows, url, {}, url) if f.url is None else
                   changed_tensors(rest, rows, url, f.rows, f.url, checksums=f.checksums))
        if changes.changed and ctx.is_coordinator:
            opened.check_sizes()
        targets = _targets(f.held, wanted, [s for s in modes if s not in same], md, owned)
        payloads, bad = read_payloads(chain, parts_for(chain, modes, targets), threads=f.io_threads)
        brought = bring_forward(chain, modes, targets, payloads, bad, sdtype, f.spare, threads=_THREADS,
                                journal=journal)
        staged, nbytes = stage(opened, f.held, wanted, list(changes.changed), rows, f.spare, f.io_threads)
        # tensors deltas could have served, read whole because the chain has problems (reported with them)
        unserved = [s for s in served if s not in modes and s in changes.changed] if chain.problems else []
        kept.update(opened=opened, wanted=wanted, rows=rows, changes=changes, chain=chain, modes=modes, same=same,
                    targets=targets, brought=brought, staged=staged, nbytes=nbytes + chain.bytes_read, md=md,
                    unserved=unserved)
        return brought.sums, brought.failed

    taken = False
    try:
        gathered = ctx.all_gather("follow/stage", local)
        chain, brought, staged, rows = kept["chain"], kept["brought"], kept["staged"], kept["rows"]
        bad = verdict(gathered, {s.save_id: s.url for s in chain.steps})
        undo(journal, bad)
        nbytes = kept["nbytes"]
        if bad:  # every rank reads those whole, alike
            def again() -> tuple[dict[Any, torch.Tensor], int]:
                if ctx.is_coordinator:
                    kept["opened"].check_sizes()
                more = f._rows(kept["opened"], {w: s for w, s in kept["wanted"].items() if s in bad})
                return stage(kept["opened"], f.held, kept["wanted"], sorted(bad), more, {}, f.io_threads)

            more, n2 = ctx.run("follow/stage", again)
            for k in [k for k in brought.nets if k[0] in bad]:
                del brought.nets[k]
            for k in [k for k in staged if k[0] in bad]:
                del staged[k]
            staged.update(more)
            nbytes += n2
        staged.update({k: v for k, v in brought.staged.items() if k[0] not in bad})
        in_place = {rec[0] for recs in journal for rec in recs}
        with interrupts_held():  # taken: from here the update is finished, never half put back
            taken = True
            try:
                f.spare = swap_in(f.held, kept["wanted"], staged, f.swap)
            finally:
                scatter(kept["targets"], brought.nets, dtype_from_name(sdtype), threads=_THREADS,
                        changed=in_place)
    except BaseException:  # not taken (here or on another rank): what was changed in place goes back
        if not taken:
            undo(journal)
        raise
    modes, md, changes, same = kept["modes"], kept["md"], kept["changes"], kept["same"]
    by_delta = [s for s in modes if s not in bad and s not in same]
    fallbacks = [f"{s}: {why}" for s, why in sorted(bad.items())] + list(dict.fromkeys(chain.problems))
    # a trainer writing another serving dtype than the follower's is said once, not at every update
    told = chain.other_dtype is not None and not bad and len(fallbacks) == 1 and f.told_dtype
    f.told_dtype = f.told_dtype or chain.other_dtype is not None
    if fallbacks and not told:
        log.warning("bytecp.follow: %s: %d tensor(s) read whole instead of by serving deltas: %s", url,
                    len(bad) + len(kept["unserved"]), "; ".join(fallbacks[:3]) + (" ..." if len(fallbacks) > 3 else ""))
    return Served(bytes_read=nbytes, tensors_read=len(changes.changed) + len(modes) - len(same),
                  tensors_unchanged=len(changes.unchanged) + len(same), unchanged_by_reference=changes.by_reference,
                  tensors_by_delta=len(by_delta),
                  delta_steps=max((len(chain.steps) - m.start - (m.kind == "whole") for s, m in modes.items()
                                   if s in by_delta), default=0),
                  elements_changed=brought.changed_elements, fallbacks=fallbacks, save_id=md.save_id,
                  created=md.created, rows=rows)


def _changes(chain: Chain, fqn: str) -> bool:
    """Whether any step of ``chain`` changes an element of ``fqn``."""
    return any(e.delta is None or e.delta.count for st in chain.steps for _, e in st.entries(fqn))


def _numel(md: fmt.Metadata, fqn: str) -> int:
    n = 1
    for d in md.tensors[fqn]["shape"]:
        n *= int(d)
    return n


def _serves(held: Mapping[str, Held], wanted: Mapping[str, str], stored: str, md: fmt.Metadata, dtype: str) -> bool:
    """A tensor taken by deltas: stored floating and held in the serving dtype."""
    from bytecp.saving.serving import floating

    if not floating(md.tensors[stored]["dtype"]):
        return False
    return all(dtype_name(held[w].dtype) == dtype for w, s in wanted.items() if s == stored)


def _targets(held: Mapping[str, Held], wanted: Mapping[str, str], names: Sequence[str], md: fmt.Metadata,
             owned: Mapping[tuple[str, Region], bool]) -> list[Target]:
    """This rank's boxes of the tensors ``names`` (stored FQNs), each once with every live tensor holding it."""
    want = set(names)
    out: dict[tuple[str, Region], Target] = {}
    for w, s in wanted.items():
        if s not in want:
            continue
        for box, t in held[w].boxes:
            tgt = out.get((s, box))
            if tgt is None:
                tgt = out[(s, box)] = Target(s, box, tuple(int(d) for d in md.tensors[s]["shape"]), t.dtype, [],
                                             owned.get((w, box), True))
            tgt.dsts.append(t)
    return list(out.values())
