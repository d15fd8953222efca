"""Zero-redundancy loading: boxes every rank needs are read once, in pieces
spread over the ranks, and exchanged over the process group.

Called by the load pipeline on every rank (when ``zero_redundancy`` is on,
the default for remote storage): :func:`shared_candidates` lists this rank's
whole-tensor targets (only whole tensors can be wanted by every rank: DDP,
plain values -- sharded targets are never gathered), the ranks all-gather
a digest of them (:func:`candidates_digest`) and, when every rank wants the
same, :func:`~bytecp.plan.planner.assign_shared` assigns the pieces alike on
every rank without any list being exchanged; :func:`split_targets` turns that into this rank's own reads;
after the reads, :func:`exchange` broadcasts each rank's pieces.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from bytecp.dist import DistContext
from bytecp.format import metadata as fmt
from bytecp.format.tensor_table import spec_of
from bytecp.loading.reader import Target
from bytecp.recorder import Trace
from bytecp.tree.dtypes import byte_view
from bytecp.tree.regions import Region

__all__ = ["SharedPlan", "shared_candidates", "candidates_digest", "split_targets", "exchange"]

#: per rank, ``(fqn, box, piece)``: read ``piece`` of the shared ``box`` and send it to every rank
SharedPlan = list[list[tuple[str, Region, Region]]]
_Views = dict[tuple[str, Region], list[torch.Tensor]]


def shared_candidates(targets: Sequence[Target], md: fmt.Metadata) -> list[tuple[str, Region]]:
    """(every rank) This rank's targets that are whole, non-empty tensors (each once, sorted)."""
    return sorted({(t.fqn, t.box) for t in targets
                   if t.box.lengths == spec_of(md.tensors, t.fqn)[1] and t.box.numel})


def candidates_digest(candidates: Sequence[tuple[str, Region]]) -> str:
    """(every rank) One digest of the whole tensors this rank wants: equal
    digests on every rank mean the same boxes, so the assignment can be
    computed locally."""
    h = hashlib.blake2b(digest_size=16)
    for fqn, box in candidates:
        h.update(f"{fqn}|{box.lengths};".encode())
    return h.hexdigest()


def split_targets(targets: list[Target], shared: SharedPlan, rank: int) -> tuple[list[Target], _Views]:
    """(every rank) This rank's own reads -- the targets nobody shares, plus its
    pieces of the shared boxes -- and the views every shared box is copied to."""
    if not shared:
        return targets, {}
    keys = {(fqn, box) for per in shared for fqn, box, _ in per}
    views: _Views = {}
    own: list[Target] = []
    for t in targets:
        k = (t.fqn, t.box)
        if k in keys:
            views.setdefault(k, []).append(t.view)
        else:
            own.append(t)
    for fqn, box, piece in shared[rank]:
        own.append(Target(fqn, piece, views[(fqn, box)][0][piece.relative_to(box).slices()]))
    return own, views


def exchange(ctx: DistContext, shared: SharedPlan, views: _Views, trace: Trace) -> None:
    """(every rank; one broadcast per rank with pieces) Every rank broadcasts
    the pieces it read, packed in one buffer, 16-byte aligned."""
    with trace.span("exchange") as sp:
        for src, pieces in enumerate(shared):
            parts = [views[(fqn, box)][0][piece.relative_to(box).slices()] for fqn, box, piece in pieces]
            sizes = [p.numel() * p.element_size() for p in parts]
            slots = [(n + 15) // 16 * 16 for n in sizes]
            total = sum(slots)
            if total == 0:
                continue
            buf = torch.empty(total, dtype=torch.uint8)
            pos = 0
            if ctx.rank == src:
                for part, n, slot in zip(parts, sizes, slots, strict=True):
                    buf[pos : pos + n].copy_(byte_view(part.contiguous()))
                    pos += slot
            ctx.broadcast_tensor("load/exchange", buf, src)
            sp.nbytes += total
            if ctx.rank != src:
                for part, n, slot in zip(parts, sizes, slots, strict=True):
                    if n:
                        part.copy_(buf[pos : pos + n].view(part.dtype).view(part.shape))
                    pos += slot
        # a rank that targets the same box twice gets the copies too
        for vs in views.values():
            for extra in vs[1:]:
                extra.copy_(vs[0])
