"""The coordinator's part of the commit: ``metadata.json`` and the index
from every rank's output.

Called by the save pipeline's commit step (coordinator only, after the
gather of every rank's :class:`~bytecp.saving.writer.RankOutput`): the state's
skeleton and tensor specs (merged with those of ranks whose state differs,
which must agree on every tensor they share), the object records, the data
files, and the index built and checked by :mod:`bytecp.format.index_build`. The
pipeline then writes the index and commits ``metadata.json``.

Also the coordinator's storage chores around it, called by the pipeline:
the target check of the plan phase (:func:`check_target`), and after the
commit the outcome storage shows (:func:`committed_after`), the removal of
a failed save's files (:func:`remove_files_of`) and of the files an
overwrite replaced (:func:`remove_replaced`; what it needs of the
replaced checkpoint remembered from this process's own commit there,
:func:`remember_committed`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import warnings
from collections.abc import Sequence
from typing import Any

from bytecp import recorder
from bytecp.data.positions import merge_positions
from bytecp.errors import (
    CheckpointExistsError,
    CommittedWithErrorsWarning,
    ConfigError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    StorageNotFoundError,
)
from bytecp.format import metadata as fmt
from bytecp.format.chunk_batch import ChunkBatch
from bytecp.format.header import committed_save_id, read_header
from bytecp.format.index_build import check_chunks
from bytecp.format.parts_build import build_directory
from bytecp.format.parts_schema import buckets_for
from bytecp.format.parts_wire import decode_all
from bytecp.format.references import BASE_FILE, referenced_by, run_url
from bytecp.plan.planner import check_replicas
from bytecp.saving.leases import Lease
from bytecp.saving.pins import Doom, live_pins
from bytecp.saving.union import DescribedUnion, described_union, tensor_specs
from bytecp.saving.writer import EXACT_CHECK_RANKS, RankOutput
from bytecp.storage_api import Storage, open_storage
from bytecp.tree.bulk import gc_paused
from bytecp.tree.recent import Recent
from bytecp.tree.state import FlatTree

__all__ = [
    "build_metadata", "tensor_specs", "check_target", "committed_after", "remove_files_of", "remove_failed",
    "remove_replaced", "late_commit_check", "Replaced", "remember_committed",
]

log = logging.getLogger("bytecp")


@gc_paused()  # a few objects per tensor and per rank: no collections of the training process's heap meanwhile
def build_metadata(
    outputs: Sequence[RankOutput],
    flat: FlatTree,
    coordinator: int,
    *,
    save_id: str,
    world_size: int,
    framework: str,
    parallelism: dict[str, Any],
    step: int | None,
    user_metadata: dict[str, Any],
    version: str,
    specs_key: str = "",
    union: DescribedUnion | None = None,
    slot: Any = None,
    verify_replicas: bool = False,
) -> tuple[fmt.Metadata, list[bytes]]:
    """(coordinator) ``metadata.json`` and the index directory's pages, from
    every rank's part entries (each rank wrote and checked its own part)
    and ``union``, the union of what the ranks describe for ``specs_key``
    (:mod:`bytecp.saving.union`: gathered and merged at the plan phase when
    the ranks' skeletons differ, or kept from the last save; else the
    coordinator's own, kept under ``slot``). With ``verify_replicas``,
    first every replica's checksums are compared. Raises
    :class:`ConfigError` when ranks describe a tensor differently or, up to
    :data:`EXACT_CHECK_RANKS` ranks (whose chunk records come along), their
    chunks do not make up the tensors exactly."""
    if verify_replicas:
        check_replicas([out.replica_crcs for out in outputs])
    if union is None:
        union = described_union(lambda: (flat.skeleton, tensor_specs(flat), flat.aliases), [], coordinator,
                                specs_key, slot)
    try:
        objects, per_rank, data_files, pages, directory = _gathered(outputs, union, coordinator, save_id, world_size)
        data = _data_positions(outputs, world_size)
    except Exception:
        union.skeleton  # noqa: B018 - a fault in the skeletons sent is the one to report (their merge ran meanwhile)
        raise
    md = fmt.Metadata(
        save_id=save_id,
        world_size=world_size,
        framework=framework,
        parallelism=parallelism,
        skeleton=union.skeleton,
        tensors=union.tensors,
        objects=objects,
        per_rank=per_rank,
        data=data,
        index_files=[],
        data_files=data_files,
        step=step,
        user_metadata=user_metadata,
        bytecp_version=version,
        index=directory,
        aliases=dict(union.aliases),
        encoded=union.encoded,
        # version 3: "../<checkpoint>/data/<save_id>/<file>" -> the checkpoint and its save
        references={p.split("/")[1]: p.split("/")[3] for p in data_files if p.startswith("../")},
    )
    return md, pages


def _gathered(outputs: Sequence[RankOutput], union: DescribedUnion, coordinator: int, save_id: str, world_size: int,
              ) -> tuple[dict[str, fmt.ObjectRecord], dict[str, dict[int, fmt.ObjectRecord]], dict[str, int],
                         list[bytes], Any]:
    """(:func:`build_metadata`) The objects, per-rank objects and data files of every rank's
    output, and the index directory's pages of their part entries, checked against the union's tensors."""
    objects: dict[str, fmt.ObjectRecord] = {}
    for r in [coordinator, *(r for r in range(len(outputs)) if r != coordinator)]:
        for fqn, rec in outputs[r].objects.items():
            objects.setdefault(fqn, rec)
    per_rank: dict[str, dict[int, fmt.ObjectRecord]] = {}
    data_files: dict[str, int] = {}
    for r, out in enumerate(outputs):
        for fqn, rec in out.per_rank.items():
            per_rank.setdefault(fqn, {})[r] = rec
        data_files.update(out.data_files)
    entries = decode_all([out.part for out in outputs if out.part is not None])  # vectorized, O(entries)
    if all(out.batch is not None for out in outputs):
        check_chunks([out.batch or ChunkBatch.empty() for out in outputs], union.tensors, data_files)
    else:  # each rank checked its own chunks; together they must hold every element once
        held, want = entries.elements, union.elements
        if held != want:
            raise ConfigError(f"the {len(outputs)} ranks' chunks hold {held} elements, the state's tensors {want}: "
                              "a tensor has a gap, or two ranks wrote the same elements; nothing is committed "
                              "(the exact check of every tensor runs on jobs of up to "
                              f"{EXACT_CHECK_RANKS} ranks, and names it)")
    pages, directory = build_directory(entries, save_id, buckets_for(world_size), union.tensors, union.hashes)
    return objects, per_rank, data_files, pages, directory


def _data_positions(outputs: Sequence[RankOutput], world_size: int) -> dict[str, dict[str, Any]]:
    """(:func:`build_metadata`) Every rank's data positions merged, per loader (O(W) text look-ups)."""
    texts: dict[str, dict[int, str]] = {}
    for r, out in enumerate(outputs):
        for fqn, text in out.data.items():
            texts.setdefault(fqn, {})[r] = text
    return {fqn: merge_positions(by_rank, world_size) for fqn, by_rank in texts.items()}


@dataclasses.dataclass(frozen=True)
class Replaced:
    """What an overwrite needs of the checkpoint it replaces: its save, world
    size and the files it needs (removed after the new commit unless the new
    one needs them too), and its own data files (doomed meanwhile)."""

    save_id: str
    world_size: int
    files: frozenset[str]
    own_data_files: dict[str, int]

    @classmethod
    def of(cls, md: fmt.Metadata) -> Replaced:
        return cls(md.save_id, md.world_size, frozenset(md.referenced_files()), md.own_data_files)


#: the checkpoints this process committed, by URL (coordinator; the last
#: 16): an overwrite of one of them whose ``metadata.json`` names the same
#: save reads its header, not the whole file (a 20,120-tensor state's parse
#: costs 0.1 s of the save's background thread)
_COMMITTED: Recent[str, Replaced] = Recent(16)
COMMITTED_MAX_FILES = 4096


def remember_committed(storage: Storage, md: fmt.Metadata) -> None:
    """(coordinator, after its commit) What an overwrite of this checkpoint
    will need of it; nothing for a job of more than :data:`COMMITTED_MAX_FILES`
    data files (its file lists would cost more to keep than its parse saves)."""
    if len(md.data_files) > COMMITTED_MAX_FILES:
        _COMMITTED.pop(storage.url)
    else:
        _COMMITTED.put(storage.url, Replaced.of(md))


def _replaced(storage: Storage) -> Replaced | None:
    """The committed checkpoint at ``storage``: this process's record of it
    when the header of its ``metadata.json`` names the save recorded (only
    the header read), else read whole (None: unreadable)."""
    try:
        known = _COMMITTED.get(storage.url)
        if known is not None:
            head = read_header(storage, committed=True)
            if head is not None and head.save_id == known.save_id:
                return known
        return Replaced.of(fmt.Metadata.from_bytes(fmt.read_metadata(storage), storage.url))
    except Exception:
        return None  # an unreadable (or oversized) old checkpoint is simply replaced: its files stay


def check_target(storage: Storage, overwrite: bool, lease: Lease | None = None,
                 skipped: Sequence[str] = ()) -> Replaced | None:
    """(coordinator, plan phase) Refuse a committed checkpoint unless
    overwriting, and always a base retention retired (``base.json``); the
    one replaced. An overwrite deletes the replaced save's data files after
    its commit, so it dooms them first (:class:`~bytecp.saving.pins.Doom`,
    its marker lifted when ``lease``, this save's, ends), then reads the
    pins of saves in flight, then the committed checkpoints of the run: it
    is refused if any references the checkpoint, but for those named in
    ``skipped`` (checkpoints of the run the manager's restore found they do
    not load: what they read is lost to them already)."""
    if not storage.exists(fmt.METADATA_FILE):
        if storage.exists(BASE_FILE):  # a save here would replace (and sweep) files kept checkpoints read
            raise CheckpointExistsError(
                f"{storage.url} is a checkpoint retired by retention whose data files kept checkpoints of "
                "the run reference; save to another directory (it goes once no kept checkpoint references it)"
            )
        return None
    if not overwrite:
        raise CheckpointExistsError(
            f"{storage.url} already holds a committed checkpoint; pass overwrite=True "
            "to replace it (the old one stays intact until the new one commits)"
        )
    old = _replaced(storage)
    in_flight: list[str] = []
    if old is not None and lease is not None:
        doom = Doom("overwrite", token=lease.save_id)
        doom.mark(storage, old.own_data_files)
        lease.on_stop(lambda: doom.lift(storage))
        with contextlib.suppress(CorruptCheckpointError):  # at a storage's root: no run, nothing pins it
            in_flight = live_pins(open_storage(run_url(storage.url), **storage.options()), storage)[0]
    readers = [r for r in referenced_by(storage) if r not in skipped]
    readers += [p.rpartition("/")[2].rpartition(".")[0] for p in in_flight]
    if readers:  # the overwrite would remove files they read
        raise CheckpointExistsError(
            f"{storage.url} is referenced by checkpoint(s) {', '.join(sorted(set(readers)))} of the run (committed, "
            "or saves in flight), which read its data files; save to another directory (overwrite=True cannot "
            "replace a checkpoint others reference)"
        )
    return old


def committed_after(
    storage: Storage, error: DistributedCheckpointError, save_id: str, committed_here: fmt.Metadata | None,
    *, coordinator: bool,
) -> fmt.Metadata | None:
    """(every rank, after the commit step broke) This save's metadata if it
    was committed (here, or by the coordinator as storage shows; a warning
    names the ranks lost after the commit and a ``save_committed_with_errors``
    event goes to the recorders), else None -- and the coordinator
    removes the failed save's files."""
    md = committed_here
    if md is None and save_id:
        mine = _commits(storage, save_id)
        if mine:  # this save's commit: read whole (its own file, without the readers' cap)
            try:
                md = fmt.Metadata.from_bytes(storage.read_bytes(fmt.METADATA_FILE), storage.url)
            except Exception as e:  # noqa: BLE001 - committed all the same: its files stay
                log.warning("bytecp: %s: metadata.json commits save %s but did not read (%s); its files are "
                            "kept", storage.url, save_id, e)
                return None
        elif mine is None:  # cannot tell: never remove what may be a committed checkpoint's
            return None
    if md is None:
        if coordinator and save_id:
            remove_files_of(storage, save_id)
        return None
    lost = ", ".join(f"rank {r}: {msg}" for r, msg in error.failures.items())
    text = (f"checkpoint {storage.url} is committed (save {save_id}); after the commit "
            f"the {error.operation} step broke: {lost}")
    log.warning("bytecp: %s", text)
    recorder.emit_event(recorder.SAVE_COMMITTED_WITH_ERRORS, 1, operation=error.operation)
    warnings.warn(CommittedWithErrorsWarning(text), stacklevel=2)
    return md


def remove_files_of(storage: Storage, save_id: str) -> None:
    """(coordinator) Remove a failed save's files (never a committed checkpoint's)."""
    for prefix in (f"data/{save_id}/", f"index/{save_id}/", f"serving/{save_id}/"):
        try:
            storage.delete_prefix(prefix)
        except Exception as e:
            log.warning("bytecp: could not remove files of the failed save %s: %s", save_id, e)


#: seconds before the deadline after which the coordinator no longer commits (the other
#: ranks give up at the deadline and read storage to learn the outcome)
COMMIT_MARGIN_S = 1.0


def late_commit_check(deadline: float | None) -> None:
    """(coordinator, just before writing the index and ``metadata.json``) Refuse
    to commit a save whose deadline is (almost) past: a rank late by then may
    have made the others give up, and a commit now would contradict them."""
    if deadline is not None and time.monotonic() > deadline - COMMIT_MARGIN_S:
        raise TimeoutError("the save's deadline (save_timeout_s) passed before its commit: not committed; "
                           "raise save_timeout_s if saves this large need longer")


def _commits(storage: Storage, save_id: str) -> bool | None:
    """Whether the ``metadata.json`` at ``storage`` commits ``save_id``, from
    its first bytes alone (:func:`~bytecp.format.header.committed_save_id`:
    whatever its size); False when there is none or it names another save (or
    none: a damaged or foreign file); None when storage did not answer (a
    warning: the failed save's files are then kept, never a committed one's removed)."""
    try:
        return committed_save_id(storage) == save_id
    except CorruptCheckpointError:
        return False
    except Exception as e:  # noqa: BLE001 - a storage error: cannot tell
        log.warning("bytecp: %s: could not tell whether save %s committed (%s); its files are kept (`bytecp gc` "
                    "removes them once it is known)", storage.url, save_id, e)
        return None


def remove_failed(storage: Storage, save_id: str, rank: int, *, coordinator: bool) -> list[str]:
    """(every rank, a save that failed, on its way out) Remove what it wrote:
    the coordinator every file of the save (``data/<id>/``, ``index/<id>/``),
    the other ranks their own data files and index part (storage may be
    local to each node).
    Nothing when ``metadata.json`` is this save's (it committed after all).
    -> the files that could not be removed (a read-only file system)."""
    if _commits(storage, save_id) is not False:  # committed after all, or cannot tell: nothing removed
        return []
    data = f"data/{save_id}/"
    try:
        storage.abort_incomplete_uploads(data)
        files = storage.list_files(data)
        mine = files if coordinator else [f for f in files if f.rsplit("/", 1)[-1].startswith(f"{rank}-")]
        index = storage.list_files(f"index/{save_id}/")
        mine = mine + (index if coordinator else [f for f in index if f.rsplit("/", 1)[-1] == f"{rank}.bin"])
        serving = storage.list_files(f"serving/{save_id}/")  # its serving deltas (bytecp.saving.serving)
        mine = mine + (serving if coordinator else [f for f in serving if f.rsplit("/", 1)[-1].split(".")[0] == str(rank)])
    except StorageNotFoundError:  # no bucket, no directory: the save wrote nothing there
        return []
    except Exception as e:  # cannot even list: say where the files are
        log.warning("bytecp: could not list the files of the failed save %s at %s: %s", save_id, storage.url, e)
        return [data]
    try:
        if mine:
            storage.delete(sorted(mine))
        return []
    except Exception as e:
        log.warning("bytecp: could not remove the files of the failed save %s at %s: %s", save_id, storage.url, e)
    left = []
    for f in mine:
        try:
            if storage.exists(f):
                left.append(f)
        except Exception:
            left.append(f)
    return left


def remove_replaced(storage: Storage, old: Replaced, md: fmt.Metadata, world_size: int) -> None:
    """(coordinator, after an overwrite committed) The replaced checkpoint's files."""
    stale = set(old.files - md.referenced_files())
    stale |= {fmt.report_file(r) for r in range(world_size, old.world_size)}
    try:
        if old.save_id != md.save_id:
            storage.delete_prefix(f"serving/{old.save_id}/")  # its serving deltas, if it had any
        storage.delete(sorted(stale))
    except Exception as e:  # the new checkpoint is committed; leftovers are only garbage
        log.warning("bytecp: could not delete files of the replaced checkpoint at %s: %s", storage.url, e)
