"""Retention over a run whose checkpoints reference each other (format version 3).

Called by :meth:`bytecp.manager.CheckpointManager` after each commit
(coordinator) and usable by any tool that deletes whole checkpoints of a run.
It first computes the *live set* -- every file a kept checkpoint references
in another checkpoint of the run -- and only then deletes:

- a checkpoint nobody kept references goes whole (``metadata.json`` first,
  so it stops being a checkpoint before its data goes);
- a checkpoint a kept one references is *retired*: its metadata moves to
  ``base.json`` (:data:`~bytecp.format.references.BASE_FILE`; it is no
  longer listed, resumed from or loaded), the data files kept checkpoints
  name stay, every other file of it goes;
- a retired base that no kept checkpoint references any more goes whole.

A save in flight references only checkpoints that are committed when it
plans (the manager's own: the newest, always kept, and what that one
references), so retention run by the same job never deletes what it is
about to reference. Another process deleting checkpoints of the same run
(``bytecp gc``) is guarded by pins (:mod:`bytecp.tools.pins`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

from bytecp.format import metadata as fmt
from bytecp.format.references import (
    BASE_FILE,
    PIN_DIR,
    pinned,
    read_committed,
    retired_bytes,
    retired_names,
)
from bytecp.storage_api import Storage

__all__ = ["RetentionResult", "live_files", "retain"]

log = logging.getLogger("bytecp.manager")


@dataclasses.dataclass
class RetentionResult:
    deleted: list[str] = dataclasses.field(default_factory=list)  # checkpoints removed whole
    retired: list[str] = dataclasses.field(default_factory=list)  # kept only for their referenced files


def live_files(root: Storage, names: Sequence[str]) -> dict[str, set[str]]:
    """checkpoint name -> its files (relative to it) that the checkpoints ``names`` reference."""
    live: dict[str, set[str]] = {}
    for name in names:
        md = read_committed(root.child(name))
        if md is None:
            continue
        for ref in md.references:
            live.setdefault(ref, set()).update(md.files_of(ref))
    return live


def retain(root: Storage, kept: Sequence[str], doomed: Sequence[str],
           committed: Callable[[], Sequence[str]]) -> RetentionResult:
    """(coordinator) Keep the checkpoints ``kept`` and what they reference;
    delete or retire ``doomed`` and the retired bases nobody keeps.
    ``committed()`` lists the run's committed checkpoints now (asked again
    after the doomed ones stopped being checkpoints: a save that committed
    meanwhile keeps what it references)."""
    live = live_files(root, kept)
    candidates = [n for n in dict.fromkeys([*doomed, *retired_names(root)]) if n not in kept]
    metas: dict[str, fmt.Metadata] = {}
    for name in candidates:  # 1. each stops being a checkpoint; base.json says what it keeps
        ck = root.child(name)
        md = read_committed(ck)
        if md is None:
            continue
        metas[name] = md
        ck.commit(BASE_FILE, retired_bytes(md, live.get(name, set())))
        ck.delete([fmt.METADATA_FILE])
    # 2. then look again: pins of saves in flight, checkpoints committed meanwhile
    live = live_files(root, list(committed()) + list(kept))
    out = RetentionResult()
    for name, md in metas.items():
        ck = root.child(name)
        if pinned(ck):  # a save in flight references it: keep all of it, as a base
            ck.commit(BASE_FILE, retired_bytes(md, md.own_data_files))
            out.retired.append(name)
            continue
        keep = live.get(name, set())
        if not keep:
            ck.delete([BASE_FILE])
            root.delete_prefix(name)
            out.deleted.append(name)
            continue
        # what a save pinning from now on may reference: exactly what stays
        ck.commit(BASE_FILE, retired_bytes(md, keep))
        ck.delete([p for p in ck.list_files("")
                   if p not in keep and p != BASE_FILE and not p.startswith(PIN_DIR + "/")])
        out.retired.append(name)
    return out
