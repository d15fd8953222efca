"""Which tensors of a checkpoint differ from an older checkpoint of the same
run, from their index rows alone: no data byte is read.

Called by :func:`bytecp.serving.follow.follow` (each update: the newest
checkpoint against the one the process holds) and by
:func:`bytecp.serving.weights.iter_weights` (``changed_since=``), in one
process, after both checkpoints were opened
(:func:`bytecp.loading.opened.open_checkpoint`) and their rows read.

A tensor is **unchanged** when both checkpoints hold it with the same dtype
and shape, cut into the same boxes, and every box of the newer one is

1. the *same stored bytes*: the row names the same data file of the run
   (a format-version-3 reference ``../<name>/data/...`` to the file the
   older one read, or wrote itself) at the same offset and length -- exact;
   or
2. bytes with the *same crc32c* and length -- equal checksums of equal boxes
   are taken for equal bytes (a collision: about 2^-32 per box; pass
   ``checksums=False`` for references only).

Anything else (a box missing, cut differently, another dtype) is changed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from bytecp.format import metadata as fmt
from bytecp.format.references import name_of

__all__ = ["Changes", "changed_tensors", "rows_by_tensor", "run_file"]


def run_file(checkpoint: str, path: str) -> str:
    """A row's data file named from the run's root: ``data/...`` of
    checkpoint ``checkpoint`` is ``<checkpoint>/data/...``, a reference
    ``../<name>/data/...`` is ``<name>/data/...``."""
    return path[3:] if path.startswith("../") else f"{checkpoint}/{path}"


def rows_by_tensor(rows: Iterable[fmt.ChunkRecord]) -> dict[str, list[fmt.ChunkRecord]]:
    """FQN -> its rows, in index order."""
    out: dict[str, list[fmt.ChunkRecord]] = {}
    for r in rows:
        out.setdefault(r.fqn, []).append(r)
    return out


@dataclasses.dataclass(frozen=True)
class Changes:
    """The tensors asked about, split: ``changed`` to read, ``unchanged``
    (``by_reference``: of them, proven by references alone)."""

    changed: tuple[str, ...]
    unchanged: tuple[str, ...]
    by_reference: int


def _same(new: fmt.ChunkRecord, new_ck: str, old: fmt.ChunkRecord, old_ck: str, checksums: bool) -> int:
    """2: the same stored bytes; 1: equal checksums; 0: changed."""
    if new.nbytes != old.nbytes:
        return 0
    if (run_file(new_ck, new.file), new.byte_offset) == (run_file(old_ck, old.file), old.byte_offset):
        return 2
    return 1 if checksums and new.crc32c == old.crc32c else 0


def changed_tensors(
    names: Iterable[str], new: Mapping[str, list[fmt.ChunkRecord]], new_url: str,
    old: Mapping[str, list[fmt.ChunkRecord]], old_url: str, *, checksums: bool = True,
) -> Changes:
    """The tensors ``names`` (FQNs the newer checkpoint ``new_url`` holds)
    split into changed and unchanged since ``old_url``; ``new`` and ``old``
    are each checkpoint's :func:`rows_by_tensor`."""
    new_ck, old_ck = name_of(new_url), name_of(old_url)
    changed: list[str] = []
    unchanged: list[str] = []
    by_ref = 0
    for fqn in names:
        rows, before = new.get(fqn, []), {(r.offsets, r.lengths): r for r in old.get(fqn, [])}
        verdicts = []
        for r in rows:
            o = before.get((r.offsets, r.lengths))
            ok = o is not None and o.dtype == r.dtype and o.global_shape == r.global_shape
            verdicts.append(_same(r, new_ck, o, old_ck, checksums) if ok and o is not None else 0)
        if rows and len(rows) == len(before) and all(verdicts):
            unchanged.append(fqn)
            by_ref += all(v == 2 for v in verdicts)
        else:
            changed.append(fqn)
    return Changes(tuple(changed), tuple(unchanged), by_ref)
