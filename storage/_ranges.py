"""Pure planning of byte ranges: multipart parts from buffers, parallel
chunks of one read, and coalescing of nearby reads.

Called by the object-store backend (:mod:`bytecp.storage.s3`): on a store a
request costs milliseconds whatever its size, so uploads are cut into parts
along the buffers' edges and small reads are merged. No I/O here; the
limits (smallest part, most parts) are the caller's.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["plan_parts", "fixed_parts", "chunks", "coalesce"]

#: a span of one merged read: [start, end, [(offset, view), ...]]
Span = tuple[int, int, list[tuple[int, memoryview]]]


def plan_parts(
    views: Sequence[memoryview], part_size: int, *, min_part: int, max_parts: int
) -> list[list[memoryview]]:
    """Cut a file given as buffers into upload parts, zero-copy where possible.

    Each part is a list of slices of the buffers (concatenated, they are the
    file). A buffer of at least ``part_size`` bytes starts a part of its own
    (the current part is closed early when it already has ``min_part``, or
    topped up to that from the buffer's head) and is cut into slices of
    ``part_size``, a short tail going into the last slice or, from
    ``min_part`` up, into a part of its own: large tensors go up without a
    copy. Runs of small buffers are packed into parts of about ``part_size``
    (joined when sent). Every part but the last has at least ``min_part``
    bytes, and there are at most ``max_parts`` parts.
    """
    parts: list[list[memoryview]] = []
    cur: list[memoryview] = []
    cur_len = 0
    if len(views) > 4 * max_parts:  # keep planning cheap for absurd buffer counts
        return fixed_parts(views, part_size)

    def flush() -> None:
        nonlocal cur, cur_len
        if cur:
            parts.append(cur)
            cur, cur_len = [], 0

    for v in views:
        n = len(v)
        if n >= part_size and cur_len >= min_part:
            flush()
        pos = 0
        while pos < n:
            left = n - pos
            if cur_len == 0 and left >= min_part:
                take = part_size if left >= part_size else left
                if 0 < left - take < min_part:
                    take = left  # no tiny tail: the last slice grows a little
                parts.append([v[pos : pos + take]])
                pos += take
                continue
            if n >= part_size:  # top a short part up to the minimum, then go zero-copy
                take = min(left, min_part - cur_len)
            else:
                take = min(part_size - cur_len, left)
            cur.append(v[pos : pos + take])
            cur_len += take
            pos += take
            if cur_len >= part_size or (n >= part_size and cur_len >= min_part):
                flush()
    flush()
    # a short part may only be last: merge any short part into its successor
    merged: list[list[memoryview]] = []
    carry: list[memoryview] = []
    for p in parts:
        carry = carry + p
        if sum(len(x) for x in carry) >= min_part:
            merged.append(carry)
            carry = []
    if carry:
        merged.append(carry)  # the last part may be short
    if len(merged) > max_parts:  # many mid-sized buffers: fall back to fixed offsets
        return fixed_parts(views, part_size)
    return merged


def fixed_parts(views: Sequence[memoryview], part_size: int) -> list[list[memoryview]]:
    """The buffers cut at fixed offsets, ``part_size`` bytes a part."""
    parts: list[list[memoryview]] = [[]]
    room = part_size
    for v in views:
        pos = 0
        while pos < len(v):
            if room == 0:
                parts.append([])
                room = part_size
            take = min(room, len(v) - pos)
            parts[-1].append(v[pos : pos + take])
            pos += take
            room -= take
    return [p for p in parts if p]


def chunks(n: int, step: int) -> list[tuple[int, int]]:
    """``[0, n)`` as ``(lo, hi)`` pieces of at most ``step`` bytes (parallel reads of one range)."""
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


def coalesce(
    items: Sequence[tuple[int, memoryview]], *, gap: int, max_span: int
) -> tuple[list[Span], list[tuple[int, memoryview]]]:
    """Reads ``(offset, view)`` of one file merged into spans: ranges whose gap
    is at most ``gap`` share one span of at most ``max_span`` bytes (the gap
    bytes are read and dropped). Reads of ``max_span`` or more come back on
    their own (the caller splits them with :func:`chunks`); overlapping
    reads never share a span."""
    spans: list[list] = []  # [start, end, parts]
    large: list[tuple[int, memoryview]] = []
    for offset, v in sorted((it for it in items if len(it[1])), key=lambda it: it[0]):
        end = offset + len(v)
        if len(v) >= max_span:
            large.append((offset, v))
            continue
        last = spans[-1] if spans else None
        if last is not None and offset >= last[1] and offset - last[1] <= gap and end - last[0] <= max_span:
            last[1] = end
            last[2].append((offset, v))
        else:
            spans.append([offset, end, [(offset, v)]])
    return [(a, b, parts) for a, b, parts in spans], large
