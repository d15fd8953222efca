"""The phases of one save on one rank: describe, share, snapshot, plan, stage, write, commit.

The order they run in is not here: :mod:`bytecp.saving.schedule` writes
each order once (``bytecp.save``: everything on the caller's thread; the
eager, lazy and memory-budget orders of ``bytecp.async_save``: which phases
the caller waits for and which run on the background thread). Each phase
takes the frozen values earlier phases returned
(:mod:`bytecp.saving.results`) and returns its own; the pipeline itself
keeps only its inputs and the failure kept for the next collective.

Collectives (every rank, in this order): the plan phase's all-gather (plus a gather and a scatter
when some boxes have no replica hint every holder agrees on and the plan is not cached; an
all-gather of names when pipeline stages split a set; a gather and a broadcast when the skeletons differ
and the coordinator keeps no union of them: :func:`~bytecp.saving.union.gather_union`), and the
commit's gather and broadcast. The local phases (describe, snapshot, stage, write) never raise on
their own in a distributed job: a failure is kept and travels with the next collective, so every
rank learns of it (:class:`~bytecp.errors.DistributedCheckpointError` names each failed rank and its
phase) and nobody waits. If the save fails anywhere before ``metadata.json`` is written, the
coordinator removes its files. From naming the save to its end the coordinator holds the save's
lease (:mod:`bytecp.saving.leases`); once it commits, it removes the files of earlier saves at that
URL that never committed.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from bytecp import device_memory, faults
from bytecp.adapter_api import detect_adapter, looking
from bytecp.dist import DistContext
from bytecp.errors import ConfigError, DistributedCheckpointError
from bytecp.format import limits
from bytecp.format import metadata as fmt
from bytecp.options import SaveOptions
from bytecp.plan.exchange import (
    PLAN_CACHE,
    PLAN_STATS,
    ballot,
    decide,
    holdings,
    needs_coordinator,
    planned_locally,
    sends_specs,
)
from bytecp.plan.planner import LocalSavePlan, WriteItem, plan_save
from bytecp.plan.split_sets import names_of, split_disjoint
from bytecp.recorder import Trace
from bytecp.saving import commit as commits
from bytecp.saving import leases
from bytecp.saving.commit import (
    build_metadata,
    check_target,
    committed_after,
    remove_failed,
)
from bytecp.saving.handles import wait_for_previous
from bytecp.saving.outcome import CommittedMetadata, outcome_of
from bytecp.saving.pins import held
from bytecp.saving.results import (
    NOTHING_DESCRIBED,
    Described,
    SavePlanResult,
    Share,
    StagedBatch,
    nothing_staged,
)
from bytecp.saving.resync import in_step
from bytecp.saving.reuse import Incremental, live_tokens
from bytecp.saving.serving import ServingWriter, default_prefixes
from bytecp.saving.staging import ArenaStager, Queued, Stager
from bytecp.saving.union import gather_union, kept_unions, tensor_table
from bytecp.saving.writer import RankOutput, Staged, for_commit, held_checksums, write_data_files
from bytecp.storage_api import Storage
from bytecp.tree.state import flatten_tree

__all__ = ["SavePipeline"]

log = logging.getLogger("bytecp")


def _warn_if_readers_refuse(nbytes: int, url: str) -> None:
    """(the coordinator, committing) A ``metadata.json`` larger than readers
    read (:func:`bytecp.format.limits.check_metadata_size`) is still committed,
    with a warning saying what loading it takes."""
    try:
        cap = limits.max_metadata_bytes()
    except ConfigError:  # (a reader says what is wrong with it)
        cap = limits.MAX_METADATA_BYTES
    if nbytes > cap:
        log.warning("bytecp: %s: metadata.json is %s bytes, more than the %s readers read; loading it "
                    "takes BYTECP_MAX_METADATA_BYTES=%d or more", url, f"{nbytes:,}", f"{cap:,}", nbytes)

_T = TypeVar("_T")


class SavePipeline:
    """One save on one rank: its inputs and its phases, called in the order
    of a schedule (:mod:`bytecp.saving.schedule`) on every rank."""

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
        #: the one thing carried between phases: a local phase's failure,
        #: raised by the next collective on every rank
        self._kept: BaseException | None = None
        #: boxes unchanged since the base are referenced, not written (format version 3)
        self.incremental = Incremental(storage.url, opts.base, ctx.world_size, ctx.rank)
        #: serving deltas, when asked for (:mod:`bytecp.saving.serving`): fed each batch as it is written
        self.serving = None if opts.serving_dtype is None else ServingWriter(
            storage.url, opts.serving_dtype, opts.serving_prefixes or default_prefixes(state), opts.serving_whole,
            ctx.world_size, ctx.rank, ctx.is_coordinator)

    # -- the phases -----------------------------------------------------------
    def describe(self, ahead: bool = False) -> Described:
        """(every rank, local) Wait for the previous save, pick the framework
        adapter and flatten the state into views of the live tensors (no
        copy); a stager that copies also snapshots the non-tensor values now.
        ``ahead`` (an eager save): the snapshot's copies guessed and started
        first, while the state is described (:mod:`bytecp.saving.ahead`)."""

        def describe() -> Described:
            wait_for_previous(self.trace)
            guess = (self.stager.copy_ahead(bool(self.opts.verify_replicas))
                     if ahead and isinstance(self.stager, ArenaStager) else None)
            with looking():  # one look at the live state: adapters check each module once
                adapter = detect_adapter(self.state, self.opts.framework)
                with self.trace.span("plan"):
                    flat = flatten_tree(adapter.save_tree(self.state, self.ctx))
                    parallelism = adapter.parallelism(self.state, self.ctx)
            if self.stager.copies:  # objects are small: copy them now, tensors are staged later
                memo: dict[int, Any] = {id(x): x for x in flat.shared}  # kept as they are (never mutated)
                flat = dataclasses.replace(flat, objects=copy.deepcopy(flat.objects, memo),
                                           per_rank=copy.deepcopy(flat.per_rank))
            ready = device_memory.ready_events(itertools.chain(
                (t for p in flat.pieces for t in p.cuda),
                (sh.tensor for _, leaf in flat.loose_tensors() for sh in leaf.shards)))
            # a lazy save of host tensors reads their versions on its thread, before it copies them;
            # a device's count moves when a change is queued, so its tensors' are read now, with the event
            tokens = live_tokens(flat, read=not self.opts.lazy or bool(ready)) if adapter.tracks_versions else None
            return Described(flat, adapter.name, parallelism, tokens=tokens, ready=ready, ahead=guess)

        return self._keep_failure("save/describe", describe, NOTHING_DESCRIBED)

    def share(self, described: Described) -> Share:
        """(every rank, local; before an async snapshot) What the snapshot
        copies: this rank's share of the last committed plan when it has one
        for this state (all this rank can write now), else every box it holds."""

        def share() -> Share:
            local, fingerprint = holdings(described.flat, self.ctx.rank, self.ctx.world_size, self.ctx.group_ranks,
                                          self.ctx.group)
            cached = PLAN_CACHE.latest(self._cache_key(), fingerprint)
            if cached is None:
                return Share(local, fingerprint, local.items)
            # the plan gives this rank exactly ``mine``: what the base holds unchanged is not copied (the plan
            # phase splits the same list again: Incremental.split answers it from its memo)
            mine = cached[1]
            copy = tuple(self.incremental.split(mine, described.tokens)[0])
            return Share(local, fingerprint, copy, LocalSavePlan(self.ctx.rank, tuple(mine), fixed=True))

        return self._keep_failure("save/stage", share, Share(LocalSavePlan(self.ctx.rank, ()), "", ()))

    def settle(self) -> None:
        """(the eager order, when its caller's part ends, however) Copies it
        guessed and did not take are ended before the call returns (a save
        that failed before its snapshot never took them)."""
        if isinstance(self.stager, ArenaStager):
            self.stager.pool.end_guess()

    def snapshot(self, described: Described, share: Share, queued: Queued | None = None,
                 eager: bool = False) -> Described:
        """(every rank, local; async saves without a memory budget, whose
        stager is an :class:`~bytecp.saving.staging.ArenaStager`: eager saves on
        the caller's thread, lazy ones first thing on the background thread)
        Copy ``share`` into the reused arena and return the state as that
        copy: the plan, the write and the commit then run on it while
        training changes the live tensors. The copy is all an eager caller,
        or a lazy save's optimizer hook, waits for; it never waits for
        another rank. ``queued``: every copy queued (a lazy step may go on; device copies: on the GPU)."""

        def snapshot() -> Described:
            arena = self.stager
            assert isinstance(arena, ArenaStager)
            if described.tokens is not None:
                described.tokens.read()  # the versions before the bytes: never newer than the copy
            verify = bool(self.opts.verify_replicas)
            live = described.flat
            with self.trace.span("stage") as sp:
                faults.inject("stage", self.ctx.rank)
                # with replica checks the copy also sums what it copies
                events: dict[int, Any] = {}  # (with replica checks the live state is read below: release after)
                flat, copied = arena.snapshot(live, share.items, checksums=verify, ready=described.ready,
                                              queued=events.update if verify else queued, ahead=described.ahead,
                                              eager=eager)
                sp.nbytes = copied.nbytes
            crcs = None
            if verify:  # of every box held, while it is the state being saved
                summed = copied.checksums()
                held = share.local.items
                crcs = held_checksums([it for it in held if (it.fqn, it.region) not in summed], live)
                crcs.update((k, summed[k]) for k in ((it.fqn, it.region) for it in held) if k in summed)
                if queued is not None:
                    queued(events)
            # the later phases read the copy and write it through ``copied``
            return dataclasses.replace(described, flat=flat, stager=copied, share=share, replica_crcs=crcs, ahead=None)

        return self._keep_failure("save/stage", snapshot, described)

    def plan(self, described: Described) -> SavePlanResult:
        """(every rank; one all-gather, plus a gather and a scatter only when
        some boxes have no replica hint, and a gather and a broadcast when the
        ranks' skeletons differ and the coordinator keeps no union of them) Every rank votes with fingerprints of
        what it holds; the coordinator checks the target URL and names the
        save. Each rank then writes its own boxes and its share of every sound
        replica set, computed locally and alike on every member; the
        coordinator plans the rest (:mod:`bytecp.plan.exchange`). A cached plan
        is reused when every rank's was made for exactly these fingerprints."""
        ctx, rank, flat = self.ctx, self.ctx.rank, described.flat
        key = self._cache_key()
        mine: dict[str, Any] = {}

        def held_of(local: LocalSavePlan) -> LocalSavePlan:
            """The boxes this rank writes from: the cached share a snapshot copied alone, else all it holds."""
            share = described.share
            return share.held if share is not None and share.held is not None else local

        def vote() -> bytes:
            self._raise_kept()
            faults.inject("plan", rank)
            if described.share is not None:  # a snapshot described the live state already
                local, fingerprint = described.share.local, described.share.fingerprint
            else:
                local, fingerprint = holdings(flat, rank, ctx.world_size, ctx.group_ranks, ctx.group)
            mine.update(local=local, fingerprint=fingerprint, replaced=None)
            save_id: str | None = None
            objects: tuple[str, ...] = ()
            if ctx.is_coordinator:
                # named first: an overwrite dooms the replaced files for as long as this lease lives
                save_id, objects = fmt.new_save_id(), tuple(flat.objects)
                mine["lease"] = leases.take(self.storage, save_id)  # given up at commit or failure
                mine["replaced"] = check_target(self.storage, self.opts.overwrite, mine["lease"],
                                                 skipped=self.opts.overwrite_readers)
                mine["unions"] = kept_unions(key, rank)  # announced: ranks send no skeleton it holds already
                # and what a rank whose tree differs need not write
            mine["vote"], mine["cached"] = ballot(held_of(local), fingerprint, flat, key, save_id, objects,
                                                  self.storage.url.rstrip("/").rsplit("/", 1)[-1], self.opts.step, ctx.uid,
                                                  tuple(u.specs_key for u in mine.get("unions", ())))
            return mine["vote"]

        with self.trace.span("plan"):
            try:
                votes = in_step(ctx, ctx.all_gather("save/plan", vote), mine["vote"])  # (a save apart: realigned)
                save_id, objects, *_, union_keys = votes.tail_of(ctx.coordinator)  # the coordinator's
                assert save_id is not None
                self.trace.checkpoint_id = save_id
                local: LocalSavePlan = mine["local"]
                decision = decide(votes)
                cache_entry = None
                if decision.reuse:
                    items = mine["cached"][1]
                else:
                    held = held_of(local)
                    split = self.opts.split_bytes
                    if decision.bad_sets and not decision.unknown:  # pipeline stages: names, not boxes
                        before = decision
                        decision = split_disjoint(decision, ctx.all_gather("save/plan", lambda: names_of(held, before)))
                    items = planned_locally(held, decision, split_bytes=split)
                    PLAN_STATS.planned += 1
                    PLAN_STATS.split_sets += len(decision.split)
                    if decision.coordinated:
                        base = list(decision.base_load)
                        PLAN_STATS.coordinated += 1

                        def send() -> LocalSavePlan:
                            sent = needs_coordinator(held, decision)
                            PLAN_STATS.boxes_sent += len(sent.items)
                            return sent

                        items = items + ctx.reduce_scatter(
                            "save/plan", send,
                            lambda plans: plan_save(plans, split_bytes=split, base_load=base, check_coverage=False),
                        )
                    # cached once the save commits: a plan that failed is never reused
                    cache_entry = (mine["fingerprint"], decision.digest, tuple(items))
                write, reused = self.incremental.split(items, described.tokens)
                differs, sends = sends_specs(decision, rank, ctx.coordinator)
                union = next((u for u in mine.get("unions", ()) if u.specs_key == decision.specs_key), None)
                if decision.specs_key not in union_keys and decision.skeletons_differ(ctx.coordinator):
                    # a job's first save of this state: merged on the coordinator's thread while the ranks write
                    union = gather_union(ctx, flat, sends, decision.specs_key, key)
                return SavePlanResult(
                    save_id, tuple(write), local, referenced=reused, skeleton_differs=differs,
                    specs_key=decision.specs_key, union=union,
                    coordinator_objects=frozenset(objects), replaced=mine["replaced"],
                    cache_entry=cache_entry, fingerprint=mine["fingerprint"], reused=decision.reuse,
                )
            except BaseException:
                # a save that fails after planning leaves no cached plan marked as
                # the latest: the next async snapshot copies every box this rank
                # holds, not a share that may not fit the other ranks' (PlanCache.latest)
                PLAN_CACHE.forget(key)
                if "lease" in mine:
                    mine["lease"].stop()
                raise

    def stage(self, described: Described, planned: SavePlanResult) -> StagedBatch:
        """(every rank, local) The stager -- the snapshot's, else the
        pipeline's -- makes this rank's boxes writable (views, copies into
        the reused arena, or the snapshot's copies). With a memory budget,
        every batch but the last is staged and written now, reusing the arena."""
        stager = described.stager or self.stager

        def stage() -> StagedBatch:
            faults.inject("stage", self.ctx.rank)
            written = RankOutput()
            if self.opts.verify_replicas:  # while the state is the one being saved
                crcs = described.replica_crcs
                written.replica_crcs = dict(crcs) if crcs is not None else held_checksums(
                    planned.local.items, described.flat)
            batches = stager.batches(planned.items)
            for batch in batches[:-1]:
                written = self._write_batch(described, planned, self._stage_batch(stager, described, batch),
                                            written)
            return StagedBatch(tuple(self._stage_batch(stager, described, batches[-1] if batches else [])),
                               written)

        return self._keep_failure("save/stage", stage, nothing_staged())

    def write(self, described: Described, planned: SavePlanResult, staged: StagedBatch) -> RankOutput:
        """(every rank, local) Write the staged boxes into this rank's data
        files (the non-tensor values go with the first). The index is
        written by the coordinator at commit. Returns all this rank wrote."""

        def write() -> RankOutput:
            out = self._write_batch(described, planned, staged.staged, staged.written)
            if self.serving is not None:
                with self.trace.span("serve") as sp:
                    self.serving.finish(self.storage, planned.save_id, self.opts.step, planned.referenced.records)
                    sp.nbytes = self.serving.delta_nbytes + self.serving.whole_nbytes
            return out

        return self._keep_failure("save/write", write, staged.written)

    def commit(self, described: Described, planned: SavePlanResult, written: RankOutput) -> fmt.Metadata:
        """(every rank; a gather, then a broadcast) Every rank's output -- or
        its kept failure -- goes to the coordinator, which writes
        ``metadata.json`` only if every rank succeeded; the outcome comes back
        to every rank. After an overwrite the coordinator removes the files of
        the replaced checkpoint; after a failure, those of this save."""
        ctx, flat, save_id = self.ctx, described.flat, planned.save_id
        committed: list[fmt.Metadata] = []
        mine = planned.referenced.add_to(written)  # what it wrote, and the rows it references

        def output() -> RankOutput:
            self._raise_kept()
            return for_commit(mine, self.storage, tensor_table(flat), save_id, ctx.rank, ctx.world_size)

        def commit(outputs: list[RankOutput]) -> fmt.Metadata:
            with self.trace.span("commit") as sp:
                faults.inject("commit", ctx.rank)
                commits.late_commit_check(ctx.deadline)  # the others give up at the deadline: never commit after it
                md, pages = build_metadata(  # (coordinator) metadata.json and the index from every rank's output
                    outputs, described.flat, ctx.coordinator, save_id=save_id, world_size=ctx.world_size,
                    framework=described.framework, parallelism=dict(described.parallelism), step=self.opts.step,
                    user_metadata=dict(self.opts.metadata), version=self.version, specs_key=planned.specs_key,
                    union=planned.union, slot=self._cache_key(), verify_replicas=bool(self.opts.verify_replicas))
                # the bases: pinned, checked before and again just before the commit (bytecp.saving.pins)
                with held(self.storage, md, leases.holding(save_id)) as check_again:
                    self.storage.write_file(md.index.file, pages)  # type: ignore[union-attr]
                    data = md.to_bytes()
                    _warn_if_readers_refuse(len(data), self.storage.url)
                    check_again()
                    self.storage.commit(fmt.METADATA_FILE, data, exclusive=not self.opts.overwrite)
                    committed.append(md)  # from here on the files belong to a checkpoint
                sp.nbytes, sp.files = len(data), 1
            faults.inject("committed", ctx.rank)
            return outcome_of(md)  # (a large state's without its large members: bytecp.saving.outcome)

        try:
            try:
                md = ctx.all_reduce("save/write", output, commit, reduce_op="save/commit")
            except DistributedCheckpointError as e:
                # the outcome is what storage says: once metadata.json of this save
                # is written, the save succeeded, whoever was lost afterwards
                done = committed_after(self.storage, e, save_id, committed[0] if committed else None,
                                       coordinator=ctx.is_coordinator)
                if done is None:
                    raise
                md = done
            md = committed[0] if committed else md.attach(self.storage) if isinstance(md, CommittedMetadata) else md
            if not ctx.is_coordinator:  # the outcome reached this rank (the coordinator's point is in commit())
                faults.inject("committed", ctx.rank)
        except BaseException:
            PLAN_CACHE.forget(self._cache_key())  # as after a failed plan
            if ctx.is_coordinator and not committed and save_id:
                leases.give_up(save_id)
                commits.remove_files_of(self.storage, save_id)
            raise
        self.incremental.committed(md, described.tokens, mine.chunks, mine.data_files)
        if self.serving is not None:
            self.serving.committed(md.save_id, md.step)
        if planned.cache_entry is not None:
            fingerprint, digest, items = planned.cache_entry
            PLAN_CACHE.put(self._cache_key(), fingerprint, digest, list(items))
        elif planned.reused:
            PLAN_CACHE.touch(self._cache_key(), planned.fingerprint)
        if ctx.is_coordinator and planned.replaced is not None:
            commits.remove_replaced(self.storage, planned.replaced, md, ctx.world_size)
        if ctx.is_coordinator:
            commits.remember_committed(self.storage, md)
        if ctx.is_coordinator:  # and the files of earlier saves here that never committed
            leases.release(self.storage, md.save_id)
        return md

    def remove_written(self) -> list[str]:
        """(every rank, failed) :func:`~bytecp.saving.commit.remove_failed` once named; -> the files left."""
        save_id = self.trace.checkpoint_id  # the save's id once planned (the URL before)
        if not save_id or save_id == self.storage.url:
            return []
        return remove_failed(self.storage, save_id, self.ctx.rank, coordinator=self.ctx.is_coordinator)

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
    def _cache_key(self) -> tuple[Any, ...]:
        """Plans of different groups, world sizes or split sizes never mix."""
        return (self.ctx.world_size, self.ctx.rank, self.opts.split_bytes, id(self.ctx.group))

    def _keep_failure(self, phase: str, fn: Callable[[], _T], failed: _T) -> _T:
        """Run a local phase unless an earlier one failed (then ``failed``
        is its value); in a distributed job keep its failure for the next
        collective, else raise it at once."""
        if self._kept is not None:
            return failed
        try:
            return fn()
        except Exception as e:
            if not self.ctx.enabled:
                raise
            e.bytecp_phase = phase  # type: ignore[attr-defined]  # named in the error every rank sees
            self._kept = e
            return failed

    def _raise_kept(self) -> None:
        if self._kept is not None:
            raise self._kept

    def _stage_batch(self, stager: Stager, described: Described, batch: Sequence[WriteItem]) -> list[Staged]:
        with self.trace.span("stage") as sp:
            staged = stager.stage(described.flat, batch, ready=described.ready)
            sp.nbytes = sum(len(s.data) for s in staged)
        return staged

    def _write_batch(self, described: Described, planned: SavePlanResult, staged: Sequence[Staged],
                     before: RankOutput) -> RankOutput:
        """Write a staged batch into the next data files of this rank; what
        was written ``before`` and now, as a new output."""
        flat = described.flat
        first = not before.data_files
        # replicated values are written by the coordinator; a rank whose state
        # tree differs from the coordinator's writes those the coordinator lacks
        objects: dict[str, Any] = {}
        if first and self.ctx.is_coordinator:
            objects = flat.objects
        elif first and planned.skeleton_differs:
            objects = {k: v for k, v in flat.objects.items() if k not in planned.coordinator_objects}
        if self.serving is not None:  # from the staged copy, before the writer hands it on
            with self.trace.span("serve"):
                self.serving.add(staged)
        with self.trace.span("write") as sp:
            faults.inject("write", self.ctx.rank)
            out = write_data_files(
                self.storage, planned.save_id, self.ctx.rank, list(staged), objects,
                flat.per_rank if first else {}, io_threads=self.opts.io_threads,
                allow_pickle=self.opts.allow_pickle, first_file=len(before.data_files), data=flat.data if first else None,
            )
            sp.nbytes, sp.files = sum(out.data_files.values()), len(out.data_files)
        merged = RankOutput(replica_crcs=before.replica_crcs)
        merged.extend(before)
        merged.extend(out)
        return merged
