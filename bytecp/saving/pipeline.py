"""The save sequence, written once: describe -> plan -> stage -> write -> commit.

Built by :mod:`bytecp.api` on every rank for every save:

- ``bytecp.save`` runs :meth:`SavePipeline.run` on the caller's thread
  (stager: views of the live tensors, no copy);
- ``bytecp.async_save`` runs describe and :meth:`SavePipeline.snapshot`
  (the copy into the reused arena) on the caller's thread, then plan,
  stage (of the copy), write and commit on the background thread, on a
  process group of its own (with a memory budget: describe, plan and the
  staged batches on the caller's thread);
- ``bytecp.async_save(lazy=True)`` runs describe on the caller's thread and
  everything else, snapshot first, on the background thread; optimizers
  wait in a pre-step hook until the snapshot is done.

Collectives (every rank, in this order): the plan phase's all-gather (plus a
gather and a scatter when some boxes have no replica hint every holder agrees
on, and the plan is not cached), and the commit's gather and broadcast: 3,
or 5 when the coordinator plans. The local phases
(describe, stage, write) never raise on their own in a distributed job: a
failure is kept and travels with the next collective, so every rank learns
of it (:class:`~bytecp.errors.DistributedCheckpointError` names each failed
rank and its phase) and nobody waits. If the save fails anywhere before
``metadata.json`` is written, the coordinator removes its files.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from bytecp import faults
from bytecp.adapter_api import detect_adapter
from bytecp.dist import DistContext
from bytecp.errors import (
    CommittedWithErrorsWarning,
    DistributedCheckpointError,
)
from bytecp.format import metadata as fmt
from bytecp.format.index_build import BuiltIndex
from bytecp.format.references import held
from bytecp.options import SaveOptions
from bytecp.plan.exchange import (
    PLAN_CACHE,
    PlanVote,
    decide,
    local_plan,
    needs_coordinator,
    plan_key,
    planned_locally,
    specs_digest,
    vote_for,
)
from bytecp.plan.planner import LocalSavePlan, WriteItem, check_replicas, plan_save
from bytecp.recorder import Trace
from bytecp.saving.commit import build_metadata, check_target, tensor_specs
from bytecp.saving.handles import wait_for_previous
from bytecp.saving.reuse import Incremental, live_tokens
from bytecp.saving.staging import ArenaStager, Stager
from bytecp.saving.writer import RankOutput, Staged, for_commit, held_checksums, write_data_files
from bytecp.storage_api import Storage
from bytecp.tree.skeleton import Node
from bytecp.tree.state import FlatTree, flatten_tree

__all__ = ["SavePipeline"]

log = logging.getLogger("bytecp")


class SavePipeline:
    """One save on one rank. Call the phases in order on every rank (or :meth:`run`)."""

    def __init__(
        self,
        storage: Storage,
        state: dict[str, Any],
        opts: SaveOptions,
        ctx: DistContext,
        trace: Trace,
        stager: Stager,
        *,
        version: str = "",
    ) -> None:
        self.storage, self.state, self.opts, self.ctx = storage, state, opts, ctx
        self.trace, self.stager, self.version = trace, stager, version
        self.flat = FlatTree(Node.container("dict", ()), {}, {}, {}, {})
        self.framework = ""
        self.parallelism: dict[str, Any] = {}
        #: decided by the coordinator in the plan phase
        self.save_id = ""
        #: the boxes this rank writes, in the batches the stager stages in turn
        self.batches: list[list[WriteItem]] = []
        self.output = RankOutput()
        self._skeleton_differs = False
        self._coordinator_objects: frozenset[str] = frozenset()  # the names of the values the coordinator writes
        self._staged: list[Staged] = []
        self._replaced: fmt.Metadata | None = None  # coordinator: what an overwrite replaces
        self._kept: BaseException | None = None
        self._local: LocalSavePlan | None = None  # every box this rank holds
        self._fingerprint = ""  # of ``_local``, once a snapshot has replaced the live tensors
        #: after a snapshot of the cached share only: the boxes copied (fixed:
        #: a new plan gives this rank exactly these, the other holders the rest)
        self._held: LocalSavePlan | None = None
        self._cache_entry: tuple[Any, str, str, list[WriteItem]] | None = None  # put once committed
        self._reused = False  # the cached plan was reused (it becomes the latest once committed)
        #: boxes unchanged since the base are referenced, not written (format version 3)
        self.incremental = Incremental(storage.url, opts.base, ctx.world_size, ctx.rank)

    # -- the phases -----------------------------------------------------------
    def run(self) -> fmt.Metadata:
        """(every rank) The whole save on the caller's thread."""
        self.describe()
        self.plan()
        self.stage()
        self.write()
        return self.commit()

    def describe(self) -> None:
        """(every rank, local) Wait for the previous save, pick the framework
        adapter and flatten the state into views of the live tensors (no
        copy); a stager that copies also snapshots the non-tensor values now."""

        def describe() -> None:
            wait_for_previous(self.trace)
            adapter = detect_adapter(self.state, self.opts.framework)
            with self.trace.span("plan"):
                flat = flatten_tree(adapter.save_tree(self.state, self.ctx))
                self.parallelism = adapter.parallelism(self.state, self.ctx)
                self.incremental.tokens, self.incremental.enabled = live_tokens(flat), adapter.tracks_versions
            if self.stager.copies:  # objects are small: copy them now, tensors are staged later
                flat = dataclasses.replace(flat, objects=copy.deepcopy(flat.objects),
                                           per_rank=copy.deepcopy(flat.per_rank))
            self.flat, self.framework = flat, adapter.name

        self._keep_failure("save/describe", describe)

    def snapshot(self) -> None:
        """(every rank, local; async saves without a memory budget, whose
        stager is an :class:`~bytecp.saving.staging.ArenaStager`: eager saves on
        the caller's thread, lazy ones first thing on the background thread)
        Copy every box this rank may write into the reused arena -- its
        share of the cached plan when it has one for this state, else every
        box it holds -- and go on with the copy: the plan, the write and the
        commit then run while training changes the live tensors. The copy is
        all an eager caller, or a lazy save's optimizer hook, waits for; it
        never waits for another rank."""

        def snapshot() -> None:
            arena = self.stager
            assert isinstance(arena, ArenaStager)
            self._local = local_plan(self.flat, self.ctx.rank, self.ctx.world_size, self.ctx.group_ranks)
            self._fingerprint = plan_key(self._local)
            # the last committed plan's share only: every rank's is from that same plan
            cached = PLAN_CACHE.latest(self._cache_key(), self._fingerprint)
            items = cached[1] if cached is not None else self._local.items
            if cached is not None:  # only the cached share is copied: all this rank can write now
                self._held = LocalSavePlan(self.ctx.rank, tuple(items), fixed=True)
            verify = bool(self.opts.verify_replicas)
            live = self.flat
            with self.trace.span("stage") as sp:
                faults.inject("stage", self.ctx.rank)
                # with replica checks the copy also sums what it copies
                self.flat, copied = arena.snapshot(live, items, checksums=verify)
                sp.nbytes = sum(it.nbytes for it in items)
            self.stager = copied  # later phases write the copy
            if verify:  # of every box held, while it is the state being saved
                summed = copied.checksums()
                held = [(it.fqn, it.region) for it in self._local.items]
                crcs = held_checksums([it for it in self._local.items if (it.fqn, it.region) not in summed], live)
                crcs.update((k, summed[k]) for k in held if k in summed)
                self.output.replica_crcs = crcs

        self._keep_failure("save/stage", snapshot)

    def plan(self) -> None:
        """(every rank; one all-gather, plus a gather and a scatter only when
        some boxes have no replica hint) Every rank votes with fingerprints of
        what it holds; the coordinator checks the target URL and names the
        save. Each rank then writes its own boxes and its share of every sound
        replica set, computed locally and alike on every member; the
        coordinator plans the rest (:mod:`bytecp.plan.exchange`). A cached plan
        is reused when every rank's was made for exactly these fingerprints."""
        ctx, rank = self.ctx, self.ctx.rank
        key = self._cache_key()
        mine: dict[str, Any] = {}

        def vote() -> PlanVote:
            self._raise_kept()
            faults.inject("plan", rank)
            if self._local is None:  # else a snapshot described the live state already
                self._local = local_plan(self.flat, rank, ctx.world_size, ctx.group_ranks)
                self._fingerprint = plan_key(self._local)
            cached = mine["cached"] = PLAN_CACHE.get(key, self._fingerprint)
            save_id = None
            if ctx.is_coordinator:
                self._replaced = check_target(self.storage, self.opts.overwrite)
                save_id = fmt.new_save_id()
            v = vote_for(self._held or self._local, self._fingerprint, cached[0] if cached else None,
                         specs_digest(self.flat), save_id)
            if ctx.is_coordinator and self.flat.objects:  # what a rank whose tree differs need not write
                v = dataclasses.replace(v, objects=tuple(self.flat.objects))
            return v

        with self.trace.span("plan"), self._forget_plan_on_failure():
            votes = ctx.all_gather("save/plan", vote)
            coordinator = votes[ctx.coordinator]
            assert coordinator.save_id is not None
            self.save_id = self.trace.checkpoint_id = coordinator.save_id
            self._skeleton_differs = votes[rank].skeleton != coordinator.skeleton
            self._coordinator_objects = frozenset(coordinator.objects)
            decision = decide(votes)
            if decision.reuse:
                items = mine["cached"][1]
                self._reused = True
            else:
                held = self._held or self._local
                assert held is not None
                split = self.opts.split_bytes
                items = planned_locally(held, decision, split_bytes=split)
                if decision.coordinated:
                    base = list(decision.base_load)
                    items = items + ctx.reduce_scatter(
                        "save/plan", lambda: needs_coordinator(held, decision),
                        lambda plans: plan_save(plans, split_bytes=split, base_load=base, check_coverage=False),
                    )
                # cached once the save commits: a plan that failed is never reused
                self._cache_entry = (key, self._fingerprint, decision.digest, items)
            self.batches = self.stager.batches(self.incremental.split(items))

    def stage(self) -> None:
        """(every rank, local) The stager makes this rank's boxes writable
        (views, or copies into the reused arena). With a memory budget, every
        batch but the last is staged and written now, reusing the arena."""

        def stage() -> None:
            faults.inject("stage", self.ctx.rank)
            if self.opts.verify_replicas and self.output.replica_crcs is None and self._local is not None:
                # while the state is the one being saved
                self.output.replica_crcs = held_checksums(self._local.items, self.flat)
            for batch in self.batches[:-1]:
                self._stage_batch(batch)
                self._write_batch()
            self._stage_batch(self.batches[-1] if self.batches else [])

        self._keep_failure("save/stage", stage)

    def write(self) -> None:
        """(every rank, local) Write the staged boxes into this rank's data
        files (the non-tensor values go with the first). The index is
        written by the coordinator at commit."""

        def write() -> None:
            self._write_batch()

        self._keep_failure("save/write", write)

    def commit(self) -> fmt.Metadata:
        """(every rank; a gather, then a broadcast) Every rank's output -- or
        its kept failure -- goes to the coordinator, which writes
        ``metadata.json`` only if every rank succeeded; the outcome comes back
        to every rank. After an overwrite the coordinator removes the files of
        the replaced checkpoint; after a failure, those of this save."""
        ctx = self.ctx
        committed: list[fmt.Metadata] = []

        def output() -> RankOutput:
            self._raise_kept()
            self.incremental.add_to(self.output)
            if self._skeleton_differs:
                self.output.skeleton = self.flat.skeleton.to_json()
                self.output.tensors = tensor_specs(self.flat)
                self.output.aliases = dict(self.flat.aliases)
            return for_commit(self.output)

        def commit(outputs: list[RankOutput]) -> fmt.Metadata:
            with self.trace.span("commit") as sp:
                faults.inject("commit", ctx.rank)
                md, index = self._metadata(outputs)
                with held(self.storage, md):  # the bases: pinned, committed checkpoints of the run
                    self.storage.write_file(md.index.file, index.blobs)  # type: ignore[union-attr]
                    data = md.to_bytes()
                    self.storage.commit(fmt.METADATA_FILE, data, exclusive=not self.opts.overwrite)
                    committed.append(md)  # from here on the files belong to a checkpoint
                sp.nbytes, sp.files = len(data), 1
            faults.inject("committed", ctx.rank)
            return md

        try:
            with self._forget_plan_on_failure():
                try:
                    md = ctx.all_reduce("save/write", output, commit, reduce_op="save/commit")
                except DistributedCheckpointError as e:
                    # the outcome is what storage says: once metadata.json of this save
                    # is written, the save succeeded, whoever was lost afterwards
                    done = self._committed_after(e, committed[0] if committed else None)
                    if done is None:
                        raise
                    md = done
        except BaseException:
            if ctx.is_coordinator and not committed and self.save_id:
                self._remove_files_of(self.save_id)
            raise
        self.incremental.committed(md, self.output.chunks, self.output.data_files)
        if self._cache_entry is not None:
            PLAN_CACHE.put(*self._cache_entry)
        elif self._reused:
            PLAN_CACHE.touch(self._cache_key(), self._fingerprint)
        if ctx.is_coordinator and self._replaced is not None:
            self._remove_replaced(md)
        return md

    def report(self) -> None:
        """(every rank, after a successful commit) Finish the trace and store
        this rank's report beside the checkpoint (informational)."""
        report = self.trace.finish(ok=True)
        if not self.opts.write_reports:
            return
        try:
            self.storage.write_file(fmt.report_file(report.rank), [json.dumps(report.to_json()).encode()])
        except Exception as e:
            log.warning("bytecp: could not store the monitoring report at %s: %s", self.storage.url, e)

    # -- helpers ----------------------------------------------------------------
    @contextlib.contextmanager
    def _forget_plan_on_failure(self) -> Iterator[None]:
        """A save that fails after planning leaves no cached plan marked as
        the latest: the next async snapshot copies every box this rank holds
        instead of a share that may not fit the other ranks' (see
        :meth:`~bytecp.plan.exchange.PlanCache.latest`)."""
        try:
            yield
        except BaseException:
            PLAN_CACHE.forget(self._cache_key())
            raise

    def _cache_key(self) -> tuple[Any, ...]:
        """Plans of different groups, world sizes or split sizes never mix."""
        return (self.ctx.world_size, self.ctx.rank, self.opts.split_bytes, id(self.ctx.group))

    def _committed_after(self, error: DistributedCheckpointError, committed_here: fmt.Metadata | None) -> fmt.Metadata | None:
        """After the commit step broke: this save's metadata if it was committed
        (here, or by the coordinator as storage shows; a warning names the
        ranks lost after the commit), else None -- and the coordinator removes
        the failed save's files."""
        md = committed_here
        if md is None and self.save_id:
            try:
                found = fmt.Metadata.from_bytes(self.storage.read_bytes(fmt.METADATA_FILE), self.storage.url)
                md = found if found.save_id == self.save_id else None
            except Exception:
                md = None
        if md is None:
            if self.ctx.is_coordinator and self.save_id:
                self._remove_files_of(self.save_id)
            return None
        lost = ", ".join(f"rank {r}: {msg}" for r, msg in error.failures.items())
        text = (f"checkpoint {self.storage.url} is committed (save {self.save_id}); after the commit "
                f"the {error.operation} step broke: {lost}")
        log.warning("bytecp: %s", text)
        warnings.warn(CommittedWithErrorsWarning(text), stacklevel=2)
        return md

    def _keep_failure(self, phase: str, fn: Callable[[], None]) -> None:
        """Run a local phase unless an earlier one failed; in a distributed job
        keep its failure for the next collective, else raise it at once."""
        if self._kept is not None:
            return
        try:
            fn()
        except Exception as e:
            if not self.ctx.enabled:
                raise
            e.bytecp_phase = phase  # type: ignore[attr-defined]  # named in the error every rank sees
            self._kept = e

    def _raise_kept(self) -> None:
        if self._kept is not None:
            raise self._kept

    def _stage_batch(self, batch: Sequence[WriteItem]) -> None:
        with self.trace.span("stage") as sp:
            self._staged = self.stager.stage(self.flat, batch)
            sp.nbytes = sum(len(s.data) for s in self._staged)

    def _write_batch(self) -> None:
        """Write the staged batch into the next data files of this rank."""
        first = not self.output.data_files
        # replicated values are written by the coordinator; a rank whose state
        # tree differs from the coordinator's writes those the coordinator lacks
        objects: dict[str, Any] = {}
        if first and self.ctx.is_coordinator:
            objects = self.flat.objects
        elif first and self._skeleton_differs:
            objects = {k: v for k, v in self.flat.objects.items() if k not in self._coordinator_objects}
        with self.trace.span("write") as sp:
            faults.inject("write", self.ctx.rank)
            out = write_data_files(
                self.storage, self.save_id, self.ctx.rank, self._staged, objects,
                self.flat.per_rank if first else {}, io_threads=self.opts.io_threads,
                allow_pickle=self.opts.allow_pickle, first_file=len(self.output.data_files),
            )
            sp.nbytes, sp.files = sum(out.data_files.values()), len(out.data_files)
        self.output.extend(out)
        self._staged = []

    def _metadata(self, outputs: list[RankOutput]) -> tuple[fmt.Metadata, BuiltIndex]:
        """(coordinator) metadata.json and the index from every rank's output."""
        if self.opts.verify_replicas:
            check_replicas([out.replica_crcs for out in outputs])
        return build_metadata(
            outputs, self.flat, self.ctx.coordinator,
            save_id=self.save_id, world_size=self.ctx.world_size, framework=self.framework,
            parallelism=self.parallelism, step=self.opts.step, user_metadata=dict(self.opts.metadata),
            version=self.version,
        )

    def _remove_files_of(self, save_id: str) -> None:
        """(coordinator) Remove a failed save's files (never a committed checkpoint's)."""
        for prefix in (f"data/{save_id}/", f"index/{save_id}/"):
            try:
                self.storage.delete_prefix(prefix)
            except Exception as e:
                log.warning("bytecp: could not remove files of the failed save %s: %s", save_id, e)

    def _remove_replaced(self, md: fmt.Metadata) -> None:
        """(coordinator, after an overwrite committed) The replaced checkpoint's files."""
        old = self._replaced
        assert old is not None
        stale = old.referenced_files() - md.referenced_files()
        stale |= {fmt.report_file(r) for r in range(self.ctx.world_size, old.world_size)}
        try:
            self.storage.delete(sorted(stale))
        except Exception as e:  # the new checkpoint is committed; leftovers are only garbage
            log.warning("bytecp: could not delete files of the replaced checkpoint at %s: %s", self.storage.url, e)
