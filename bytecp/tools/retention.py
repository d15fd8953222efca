"""Retention over a run whose checkpoints reference each other (format version 3).

Called by :meth:`bytecp.manager.CheckpointManager` after each commit
(coordinator) and usable by any tool that deletes whole checkpoints of a run.
It first dooms each checkpoint it may delete and stops it from being one
(its metadata moves to ``base.json``, every file kept for now), then reads
the pins of saves in flight and computes the *live set* -- every file a
kept or committed checkpoint references in another checkpoint of the run --
and only then deletes:

- a checkpoint nobody kept references goes whole (``metadata.json`` first,
  so it stops being a checkpoint before its data goes);
- a checkpoint a kept one references is *retired*: its metadata moves to
  ``base.json`` (:data:`~bytecp.format.references.BASE_FILE`; it is no
  longer listed, resumed from or loaded), the data files kept checkpoints
  name stay, every other file of it goes;
- a retired base that no kept checkpoint references any more goes whole.

Serving deltas (:mod:`bytecp.saving.serving`) go with their checkpoint,
except while a live serving follower of the run holds an older step
(``<run>/.followers/held/<id>.json`` under its lease,
:func:`followed_from`): a checkpoint after that step is retired instead,
keeping its deltas (not its whole serving copies) for the follower's chain,
and goes whole at a later retention once no live follower holds a step
before it.

A save in flight references only checkpoints that are committed when it
plans (the manager's own: the newest, always kept, and what that one
references), so retention run by the same job never deletes what it is
about to reference. Another process deleting checkpoints of the same run
(another job's retention, a tool) races saves through files alone: a
checkpoint is *doomed* (a marker) before its pins are read, pins are read
before the committed checkpoints, and a save checks for markers after
pinning (:mod:`bytecp.saving.pins` has the protocol and why it holds).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from collections.abc import Callable, Sequence

from bytecp.format import metadata as fmt
from bytecp.format import serving_wire
from bytecp.format.header import Files, read_files, read_header
from bytecp.format.references import BASE_FILE, PIN_DIR, retired_bytes, retired_names
from bytecp.saving import leases
from bytecp.saving.pins import DOOM_DIR, Doom, live_pins
from bytecp.storage_api import Storage

#: a step directory of a run
_STEP = re.compile(r"^step-(\d+)$")

__all__ = ["RetentionResult", "followed_from", "live_files", "retain", "sweep_uncommitted", "LEFT_BEHIND",
           "only_left_behind"]

log = logging.getLogger("bytecp.manager")


@dataclasses.dataclass
class RetentionResult:
    deleted: list[str] = dataclasses.field(default_factory=list)  # checkpoints removed whole
    retired: list[str] = dataclasses.field(default_factory=list)  # kept only for their referenced files


def live_files(root: Storage, names: Sequence[str]) -> dict[str, set[str]]:
    """checkpoint name -> its files (relative to it) that the checkpoints ``names``
    reference (the data files of only those whose header lists references)."""
    live: dict[str, set[str]] = {}
    for name in names:
        ck = root.child(name)
        head = read_header(ck)
        files = read_files(ck) if head is not None and head.references else None
        if files is None:
            continue
        for ref in files.header.references:
            live.setdefault(ref, set()).update(files.files_of(ref))
    return live


def followed_from(root: Storage, now: float | None = None) -> int | None:
    """The lowest step a live serving follower of the run ``root`` holds
    (its marker, its lease not lapsed); None: no such follower."""
    fol = root.child(serving_wire.FOLLOWERS_DIR)
    try:
        paths = fol.list_files("held")
    except Exception:  # noqa: BLE001 - no folder, or unreadable: nothing kept for followers
        return None
    now = time.time() if now is None else now
    steps = []
    for path in paths:
        fid = path.rsplit("/", 1)[-1].removesuffix(".json")
        try:
            step = json.loads(fol.read_bytes(path))["step"]
        except Exception:  # noqa: BLE001 - removed meanwhile, or half written: not a follower to keep for
            continue
        if type(step) is int and leases.may_be_running(fol, fid, now):
            steps.append(step)
    return min(steps) if steps else None


def retain(root: Storage, kept: Sequence[str], doomed: Sequence[str],
           committed: Callable[[], Sequence[str]]) -> RetentionResult:
    """(coordinator) Keep the checkpoints ``kept`` and what they reference;
    delete or retire ``doomed`` and the retired bases nobody keeps.
    ``committed()`` lists the run's committed checkpoints now (asked after
    the doomed ones stopped being checkpoints: a save that committed
    meanwhile keeps what it references)."""
    candidates = [n for n in dict.fromkeys([*doomed, *retired_names(root)]) if n not in kept]
    sure = live_files(root, kept)  # what stays whatever happens: never doomed
    doom = Doom("retention")
    metas: dict[str, Files] = {}
    try:
        for name in candidates:  # 1. doomed, then no longer a checkpoint (base.json keeps all it holds)
            ck = root.child(name)
            md = read_files(ck)
            if md is None:
                continue
            metas[name] = md
            doom.mark(ck, set(md.own_data_files) - sure.get(name, set()))
            if ck.exists(fmt.METADATA_FILE):
                ck.commit(BASE_FILE, retired_bytes(md, md.own_data_files))
                ck.delete([fmt.METADATA_FILE])
        # 2. once every marker is written: pins of saves in flight, THEN the
        # checkpoints committed meanwhile (a save that unpinned has committed)
        pins = {name: live_pins(root, root.child(name)) for name in metas}
        live = live_files(root, list(committed()) + list(kept))
        return _prune(root, doom, metas, pins, live, followed_from(root) if metas else None)
    finally:
        doom.lift_all()


def _prune(root: Storage, doom: Doom, metas: dict[str, Files],
           pins: dict[str, tuple[list[str], list[str]]], live: dict[str, set[str]],
           followed: int | None = None) -> RetentionResult:
    """(retention, step 3) Delete or retire each doomed checkpoint; only
    data files its marker names go; the marker goes after the last. A
    checkpoint after the step ``followed`` keeps its serving deltas."""
    out = RetentionResult()
    for name, md in metas.items():
        ck = root.child(name)
        in_flight, dead_pins = pins[name]
        doom.lift_dead(ck)  # a killed deleter's marker would fail saves on its files for good
        if not ck.exists(doom.path):  # taken for a dead deleter's (stalled over STALE_MARKER_SECONDS):
            log.warning("bytecp: retention's doom marker in %s was removed meanwhile; nothing deleted there "
                        "(the next retention prunes it)", ck.url)  # a save may have pinned it since
            doom.marked.pop(ck.url, None)
            continue
        files = set(ck.list_files(""))
        own = set(md.own_data_files) & files
        # a save in flight references it: keep everything it holds, as a base
        gone = set() if in_flight else (own - live.get(name, set())) & doom.files(ck)
        step = md.header.step
        serving = set(serving_wire.kept_files(sorted(files), md.header.save_id)) \
            if followed is not None and step is not None and step > followed else set()
        if own == gone and not in_flight and not serving:
            ck.delete([BASE_FILE])  # first: from here on it is nothing a save may reference
            ck.delete(sorted(p for p in files if p != BASE_FILE and not p.startswith(DOOM_DIR + "/")))
            doom.lift(ck, root)  # last (another deleter's marker, if any, stays)
            out.deleted.append(name)
            continue
        keep = own - gone
        # what a save pinning from now on may reference: exactly what stays
        ck.commit(BASE_FILE, retired_bytes(md, keep))
        ck.delete(sorted(p for p in files if p not in keep and p not in serving and p != BASE_FILE and (
            p in dead_pins or (not in_flight and not p.startswith((PIN_DIR + "/", DOOM_DIR + "/"))))))
        doom.lift(ck)
        out.retired.append(name)
    return out


#: what outlives a checkpoint whose metadata.json and data went first (a retention, a gc or a hand cut
#: short): its reports and a doom marker; a step directory holding only them is no checkpoint of any
#: format, and a resume refuses to decide about it
LEFT_BEHIND = ("reports/", f"{DOOM_DIR}/")


def only_left_behind(files: Sequence[str]) -> bool:
    """Whether ``files`` (paths below a step directory) are some, and only, what :data:`LEFT_BEHIND` names."""
    return bool(files) and all(f.startswith(LEFT_BEHIND) for f in files)


def sweep_uncommitted(root: Storage, newest: int, committed: set[str], run_url: str) -> None:
    """(the manager's retention, coordinator) Remove what killed saves left
    in ``step-<N>`` directories of the run ``root`` with no ``metadata.json``
    and N below the newest committed step (a restarted job may never save
    that step again), unless a save there may still be running (:mod:`bytecp.saving.leases`), and doom markers left
    alone by a retention cut short (nothing left to protect). Never raises."""
    from bytecp.saving.leases import orphans

    try:
        for name in root.list_children(""):
            m = _STEP.match(name)
            if m is None or name in committed or int(m.group(1)) >= newest or root.exists(
                    f"{name}/{fmt.METADATA_FILE}") or root.exists(f"{name}/{BASE_FILE}"):
                continue  # (a retired base holds files kept checkpoints reference)
            dead, _ = orphans(root.child(name), None)
            left = root.child(name).list_files("")  # a retention cut short: its marker, reports
            dead = left if only_left_behind(left) else dead
            if dead:
                root.delete([f"{name}/{f}" for f in dead])
                log.info("bytecp: removed %d file(s) of a save to %s/%s that never committed",
                         len(dead), run_url, name)
    except Exception as e:  # noqa: BLE001 - only garbage is at stake
        log.warning("bytecp: could not remove files of killed saves below %s: %s", run_url, e)

