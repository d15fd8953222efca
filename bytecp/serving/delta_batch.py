"""A follower's boxes applied by the compiled kernel in one call a thread.

Called by :func:`bytecp.serving.delta_apply.bring_forward` (every rank of a
follower, each update of ``bytecp.follow(..., dtype=)``), on each apply
thread's share of the boxes, when the compiled kernels are there
(:func:`bytecp.format.kernels.compiled`).

The usual box of a full fine-tune's follower -- taken by a ``chain`` of
deltas, held in one contiguous host tensor, saved as the same box it holds
(no relocation) and a run of its tensor's elements -- needs no Python
between its steps: :func:`plan` says whether a box is one, and
:func:`apply` hands every such box of the thread's share to
``apply_deltas``, which decodes each step's positions, reads, sums and
writes the changed elements in place, and records each change in the
box's journal list (``delta_apply.Record``) before it returns, with the GIL
released once. Box by box through Python, the two apply threads of a 2-core
host handed the GIL back and forth twice a box and waited on each other's
Python: 3.7 ms of the 9 ms an update's boxes took, 1.3 ms of it their own
work. Any other box (on a device, held by several tensors, cut differently
from the saved boxes, a part missing) goes through ``delta_apply._one``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from bytecp.format import serving_wire as wire
from bytecp.format.serving_elements import position_problem
from bytecp.serving.deltas import Chain, Part, Step

__all__ = ["Plan", "Applied", "plan", "apply"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """A box :func:`apply` takes: its live bits, where the box starts in its
    tensor's linear index, and each step's delta of it, in order."""

    live: np.ndarray
    g_add: int
    deltas: tuple[tuple[int, int, wire.Entry, Part], ...]  # (step, rank, entry, part)


def plan(chain: Chain, fqn: str, box: Any, steps: range, live: np.ndarray | None, g_add: int | None,
         payloads: Mapping[Part, memoryview]) -> Plan | None:
    """(an apply thread's caller) The box ``box`` of ``fqn`` as :func:`apply`
    takes it, or None: when it is not held in one host tensor (``live``),
    not a run of its tensor (``g_add`` None), or a step's delta of it is of
    another box or was not read."""
    if live is None or g_add is None:
        return None
    deltas = []
    for i in steps:
        for r, e in chain.steps[i].entries(fqn):
            d = e.delta
            if d is None:
                continue
            if e.box != box:
                if e.box.intersect(box) is not None:
                    return None
                continue
            part = Part(i, r, "delta", d.offset, d.nbytes, d.crc32c)
            if d.count and part not in payloads:
                return None
            deltas.append((i, r, e, part))
    return Plan(live, g_add, tuple(deltas))


@dataclasses.dataclass
class Applied:
    """What :func:`apply` did to one box: each step's delta with the change it
    made to its saved box's checksum, the changed elements, or why it failed."""

    sums: list[tuple[Step, wire.Entry, int]]
    changed: int = 0
    failed: str | None = None


def apply(kernel: Any, boxes: Sequence[tuple[Plan, list[Any], Any]], chain: Chain, payloads: Mapping[Part, memoryview],
          bits: Any) -> list[Applied]:
    """(an apply thread) Every step of every box of ``boxes`` ((plan, the
    box's journal list, its tag)) applied in place by ``kernel.apply_deltas``
    in one call; each change is in the box's list when this returns. A box
    whose delta fails to decode has its earlier steps put back by the
    caller (from its list) and is reported failed; the others are applied."""
    size = np.dtype(bits).itemsize
    jobs = [(p.live, payloads[part], e.delta.count, e.box.numel, size, 0, p.g_add,
             np.empty(e.delta.count, dtype=np.int64), np.empty(e.delta.count, dtype=bits), recs, tag, b)
            for b, (p, recs, tag) in enumerate(boxes) for _, _, e, part in p.deltas if e.delta and e.delta.count]
    results = iter(kernel.apply_deltas(jobs) if jobs else [])
    out = []
    for p, _recs, _tag in boxes:  # the results in the jobs' order; a delta of no change made no job
        got = Applied([])
        for i, r, e, _ in p.deltas:
            count = e.delta.count if e.delta else 0
            code, change = next(results) if count else (0, 0)
            if code not in (0, 6) and got.failed is None:  # (6: a later step of a box that failed)
                got.failed = f"{chain.steps[i].where(r, e)}: {position_problem(code, count, e.box.numel)}"
            got.sums.append((chain.steps[i], e, change or 0))
            got.changed += count
        out.append(got)
    return out
