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
overwrite replaced (:func:`remove_replaced`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from bytecp.errors import (
    CheckpointExistsError,
    CommittedWithErrorsWarning,
    ConfigError,
    CorruptCheckpointError,
    DistributedCheckpointError,
)
from bytecp.format import metadata as fmt
from bytecp.format.chunk_batch import ChunkBatch
from bytecp.format.index_build import check_chunks
from bytecp.format.member_text import EncodedMembers, dumps, encode_members
from bytecp.format.parts_build import build_directory
from bytecp.format.parts_schema import buckets_for
from bytecp.format.parts_wire import decode_all
from bytecp.format.references import BASE_FILE, referenced_by, run_url
from bytecp.format.table_union import elements_of, sent_table, union_tables
from bytecp.format.tensor_table import TensorTable
from bytecp.plan.planner import check_replicas
from bytecp.saving.leases import Lease
from bytecp.saving.pins import Doom, live_pins
from bytecp.saving.writer import EXACT_CHECK_RANKS, RankOutput
from bytecp.storage_api import Storage, open_storage
from bytecp.tree.bulk import gc_paused
from bytecp.tree.dtypes import dtype_name
from bytecp.tree.skeleton import Node
from bytecp.tree.skeleton_union import NotCompact, deferred, union_json
from bytecp.tree.state import FlatTree, merge_aliases

__all__ = [
    "build_metadata", "DescribedUnion", "described_union", "kept_unions", "tensor_specs", "check_target", "committed_after", "remove_files_of", "remove_failed",
    "remove_replaced", "late_commit_check",
]

log = logging.getLogger("bytecp")


def tensor_specs(flat: FlatTree) -> dict[str, dict[str, Any]]:
    """Every tensor's dtype and global shape, as ``metadata.json`` lists them."""
    return {
        fqn: {"dtype": dtype_name(leaf.dtype), "shape": list(leaf.global_shape)}
        for fqn, leaf in flat.tensors.items()
    }


def _merge_skeletons(skeleton: Node, sent: Sequence[tuple[int, Any]]) -> tuple[Node, str | None]:
    """The union of the coordinator's skeleton with those ``sent`` (rank,
    skeleton JSON) by the ranks whose state differs from every lower
    rank's; with the union's JSON text when it was merged as JSON (the node
    is then parsed from it only if read: :mod:`bytecp.tree.skeleton_union`)."""
    if not sent:
        return skeleton, None
    with gc_paused():  # a few objects per leaf of every skeleton sent (bytecp.tree.bulk)
        own = skeleton.to_json()
        try:
            doc = union_json(own, [sk for _, sk in sent])
        except NotCompact:  # (not as Node.to_json writes it: parsed, which names the fault)
            return skeleton.merge_all([Node.from_json(sk, f"rank {r}'s skeleton") for r, sk in sent]), None
        if doc is own:
            return skeleton, None
        text = dumps(doc)
        return deferred(text, "the union of the ranks' skeletons"), text


@dataclasses.dataclass(frozen=True, eq=False)
class DescribedUnion:
    """The union of what the ranks describe, as a commit's ``metadata.json``
    holds it: the next saves of the same state share it, so the specs are a
    read-only :class:`~bytecp.format.tensor_table.TensorTable` and each
    commit's metadata gets its own copy of the aliases. It may still be
    merging on a thread (:func:`described_union`): reading a member waits
    for it (the tables first, then the skeleton and the JSON text), and
    raises what the merge raised."""

    #: the plan decision's specs key ("": never reused) and the coordinator that built it
    specs_key: str
    coordinator: int
    #: (the tensors, their aliases, elements and name hashes)
    tabled: concurrent.futures.Future[tuple[TensorTable, dict[str, str], int, np.ndarray]]
    #: (the skeleton, the JSON text of it and of ``tensors``)
    described: concurrent.futures.Future[tuple[Node, EncodedMembers]]

    @property
    def tensors(self) -> TensorTable:
        return self.tabled.result()[0]

    @property
    def aliases(self) -> dict[str, str]:
        return self.tabled.result()[1]

    @property
    def elements(self) -> int:
        """The tensors' elements, all together (the commit's count of what the ranks hold)."""
        return self.tabled.result()[2]

    @property
    def hashes(self) -> np.ndarray:
        """The tensors' name hashes, in their order (the commit's directory looks names up by them)."""
        return self.tabled.result()[3]

    @property
    def skeleton(self) -> Node:
        return self.described.result()[0]

    @property
    def encoded(self) -> EncodedMembers:
        return self.described.result()[1]


#: by (the save pipeline's plan-cache key, specs key): the unions its last
#: commits built, the newest last (its coordinator announces their keys in
#: its vote; when the decision's is one of them, no rank sends its skeleton)
_KEPT: dict[tuple[Any, str], DescribedUnion] = {}
#: a process saving several states in turn (a model and an EMA copy) keeps each one's
_KEPT_MAX = 4
#: (``_KEPT`` is added to by the thread that merges a union's skeletons)
_KEPT_LOCK = threading.Lock()
#: the thread a job's first commit merges the ranks' skeletons on, meanwhile building the index directory
_MERGING: list[concurrent.futures.ThreadPoolExecutor] = []


def _merging() -> concurrent.futures.ThreadPoolExecutor:
    with _KEPT_LOCK:
        if not _MERGING:
            _MERGING.append(concurrent.futures.ThreadPoolExecutor(1, "bytecp-union"))
        return _MERGING[0]


def _forget_threads() -> None:
    global _KEPT_LOCK
    _MERGING.clear()  # a forked child has none of its parent's threads, nor their locks
    _KEPT_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_threads)


def kept_unions(slot: Any, coordinator: int) -> list[DescribedUnion]:
    """(coordinator, as it votes) The unions the last commits under ``slot`` built, if it built them."""
    with _KEPT_LOCK:
        return [u for (s, _), u in _KEPT.items() if s == slot and u.coordinator == coordinator]


def described_union(own: Callable[[], tuple[Node, dict[str, dict[str, Any]], dict[str, str]]],
                    sent: Sequence[tuple[int, Any, Mapping[str, Any], dict[str, str]]],
                    coordinator: int, specs_key: str = "", kept: DescribedUnion | None = None,
                    slot: Any = None) -> DescribedUnion:
    """(coordinator, at commit) The union of the coordinator's skeleton,
    tensor specs and aliases (``own()``: asked for only when the union is
    built) with those ``sent`` (rank, skeleton JSON, tensor table, aliases)
    by the ranks whose state differs from every lower rank's, with its
    elements, name hashes and JSON text; or ``kept``, built for ``specs_key``
    (every distinct skeleton's digest and its lowest rank, from the plan's
    votes: :attr:`~bytecp.plan.decide.PlanDecision.specs_key`; then nobody
    sent anything). When some were sent, the union is merged on a thread
    while the caller decodes the ranks' part entries and builds the index
    directory: first the tables (:func:`~bytecp.format.table_union.union_tables`:
    :class:`ConfigError`, raised where they are read, when two ranks describe
    a tensor differently), then the skeletons and the JSON text. A new
    union is kept under ``slot`` for the next saves once merged. A state of
    181,580 tensors merged from 64 skeletons and tables costs 0.4 s to
    merge and encode (0.1 s of it hidden behind the directory's build on
    2 cores); a job pays that once."""
    if kept is not None:
        if (kept.specs_key, kept.coordinator) != (specs_key, coordinator) or not specs_key:
            raise RuntimeError(f"the union kept for skeletons {kept.specs_key!r} on rank {kept.coordinator} "
                               f"stands in for {specs_key!r} on rank {coordinator}")  # (the votes rule it out)
        return kept
    skeleton, specs, aliases = own()
    tabled: concurrent.futures.Future[tuple[TensorTable, dict[str, str], int, np.ndarray]] = concurrent.futures.Future()
    described: concurrent.futures.Future[tuple[Node, EncodedMembers]] = concurrent.futures.Future()
    union = DescribedUnion(specs_key, coordinator, tabled, described)

    def describe() -> None:
        try:
            with gc_paused():  # a few objects per tensor of every rank that sent its table
                tensors, hashes = union_tables([(coordinator, sent_table(specs)), *((r, t) for r, _, t, _ in sent)])
            tabled.set_result((tensors, merge_aliases(aliases, [(r, a) for r, _, _, a in sent], tensors, coordinator),
                               elements_of(tensors), hashes))
            node, text = _merge_skeletons(skeleton, [(r, sk) for r, sk, _, _ in sent])
            encoded = encode_members(node, tensors, skeleton_text=text)
        except BaseException as e:  # noqa: BLE001 - raised where the union is read
            if not tabled.done():
                tabled.set_exception(e)
            described.set_exception(e)
            return
        if specs_key and slot is not None:
            with _KEPT_LOCK:
                _KEPT.pop((slot, specs_key), None)
                _KEPT[(slot, specs_key)] = union
                while len(_KEPT) > _KEPT_MAX:
                    del _KEPT[next(iter(_KEPT))]
        described.set_result((node, encoded))

    if sent:
        _merging().submit(describe)
    else:
        describe()
    return union


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
    kept: DescribedUnion | None = None,
    slot: Any = None,
    verify_replicas: bool = False,
) -> tuple[fmt.Metadata, list[bytes]]:
    """(coordinator) ``metadata.json`` and the index directory's pages, from
    every rank's part entries (each rank wrote and checked its own part);
    the union of the skeletons sent, or ``kept`` when it is the one for
    ``specs_key`` (:func:`described_union`; a new one is kept under ``slot``).
    With ``verify_replicas``, first every replica's checksums are compared.
    Raises :class:`ConfigError` when ranks describe a tensor differently or,
    up to :data:`EXACT_CHECK_RANKS` ranks (whose chunk records come along),
    their chunks do not make up the tensors exactly."""
    if verify_replicas:
        check_replicas([out.replica_crcs for out in outputs])
    sent = [(r, out.skeleton, out.tensors, out.aliases or {}) for r, out in enumerate(outputs)
            if out.skeleton is not None and out.tensors is not None]
    union = described_union(lambda: (flat.skeleton, tensor_specs(flat), flat.aliases), sent, coordinator,
                            specs_key, kept, slot)
    try:
        objects, per_rank, data_files, pages, directory = _gathered(outputs, union, coordinator, save_id, world_size)
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


def check_target(storage: Storage, overwrite: bool, lease: Lease | None = None) -> fmt.Metadata | None:
    """(coordinator, plan phase) Refuse a committed checkpoint unless
    overwriting, and always a base retention retired (``base.json``); the
    one replaced. An overwrite deletes the replaced save's data files after
    its commit, so it dooms them first (:class:`~bytecp.saving.pins.Doom`,
    its marker lifted when ``lease``, this save's, ends), then reads the
    pins of saves in flight, then the committed checkpoints of the run: it
    is refused if any references the checkpoint."""
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
    try:
        old: fmt.Metadata | None = fmt.Metadata.from_bytes(storage.read_bytes(fmt.METADATA_FILE), storage.url)
    except Exception:
        old = None  # an unreadable old checkpoint is simply replaced
    in_flight: list[str] = []
    if old is not None and lease is not None:
        doom = Doom("overwrite", token=lease.save_id)
        doom.mark(storage, old.own_data_files)
        lease.on_stop(lambda: doom.lift(storage))
        with contextlib.suppress(CorruptCheckpointError):  # at a storage's root: no run, nothing pins it
            in_flight = live_pins(open_storage(run_url(storage.url), **storage.options()), storage)[0]
    readers = referenced_by(storage) + [p.rpartition("/")[2].rpartition(".")[0] for p in in_flight]
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
    names the ranks lost after the commit), else None -- and the coordinator
    removes the failed save's files."""
    md = committed_here
    if md is None and save_id:
        try:
            found = fmt.Metadata.from_bytes(storage.read_bytes(fmt.METADATA_FILE), storage.url)
            md = found if found.save_id == save_id else None
        except Exception:
            md = None
    if md is None:
        if coordinator and save_id:
            remove_files_of(storage, save_id)
        return None
    lost = ", ".join(f"rank {r}: {msg}" for r, msg in error.failures.items())
    text = (f"checkpoint {storage.url} is committed (save {save_id}); after the commit "
            f"the {error.operation} step broke: {lost}")
    log.warning("bytecp: %s", text)
    warnings.warn(CommittedWithErrorsWarning(text), stacklevel=2)
    return md


def remove_files_of(storage: Storage, save_id: str) -> None:
    """(coordinator) Remove a failed save's files (never a committed checkpoint's)."""
    for prefix in (f"data/{save_id}/", f"index/{save_id}/"):
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


def remove_failed(storage: Storage, save_id: str, rank: int, *, coordinator: bool) -> list[str]:
    """(every rank, a save that failed, on its way out) Remove what it wrote:
    the coordinator every file of the save (``data/<id>/``, ``index/<id>/``),
    the other ranks their own data files and index part (storage may be
    local to each node).
    Nothing when ``metadata.json`` is this save's (it committed after all).
    -> the files that could not be removed (a read-only file system)."""
    try:
        if storage.exists(fmt.METADATA_FILE) and \
                fmt.Metadata.from_bytes(storage.read_bytes(fmt.METADATA_FILE), storage.url).save_id == save_id:
            return []
    except Exception:  # unreadable: not this save's commit
        pass
    data = f"data/{save_id}/"
    try:
        storage.abort_incomplete_uploads(data)
        files = storage.list_files(data)
        mine = files if coordinator else [f for f in files if f.rsplit("/", 1)[-1].startswith(f"{rank}-")]
        index = storage.list_files(f"index/{save_id}/")
        mine = mine + (index if coordinator else [f for f in index if f.rsplit("/", 1)[-1] == f"{rank}.bin"])
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


def remove_replaced(storage: Storage, old: fmt.Metadata, md: fmt.Metadata, world_size: int) -> None:
    """(coordinator, after an overwrite committed) The replaced checkpoint's files."""
    stale = old.referenced_files() - md.referenced_files()
    stale |= {fmt.report_file(r) for r in range(world_size, old.world_size)}
    try:
        storage.delete(sorted(stale))
    except Exception as e:  # the new checkpoint is committed; leftovers are only garbage
        log.warning("bytecp: could not delete files of the replaced checkpoint at %s: %s", storage.url, e)
