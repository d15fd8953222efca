"""The load sequence, written once: metadata -> match -> plan -> read ->
exchange -> apply.

Built by :mod:`bytecp.api` on every rank for ``bytecp.load`` (target: the
live state, filled in place) and in one process for
``bytecp.load_state_dict`` (target: everything, as plain values).

Collectives (every rank, in this order, each fail-together): the metadata
broadcast (the coordinator opens the checkpoint: ``metadata.json``
validated, declared sizes checked; every rank receives the opened
checkpoint, :mod:`bytecp.loading.opened`), match, [the zero-redundancy
all-gather], read, [one broadcast per rank holding shared pieces], apply. A failure on any rank raises
:class:`~bytecp.errors.DistributedCheckpointError` on every rank, labelled
with the phase (``load/match``, ``load/read``, ...).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from bytecp import faults
from bytecp.adapter_api import LoadTarget, detect_adapter, excluded, excluding
from bytecp.dist import DistContext
from bytecp.errors import ConfigError
from bytecp.format import metadata as fmt
from bytecp.format.tensor_table import spec_of
from bytecp.interop.hf_names import match_names
from bytecp.loading.checks import block_bytes_of
from bytecp.loading.matching import Match, match_target
from bytecp.loading.opened import OpenedCheckpoint, Shared, open_checkpoint
from bytecp.loading.reader import Target, execute_reads
from bytecp.loading.zero_redundancy import (
    SharedPlan,
    candidates_digest,
    exchange,
    shared_candidates,
    split_targets,
)
from bytecp.options import LoadOptions
from bytecp.plan.load_plan import plan_load
from bytecp.plan.planner import assign_shared
from bytecp.recorder import Trace
from bytecp.storage_api import Storage
from bytecp.tree.bulk import gc_paused
from bytecp.tree.dtype_names import ITEMSIZES
from bytecp.tree.regions import Region
from bytecp.tree.state import Slot, flatten_tree

__all__ = ["LoadPipeline", "LoadResult"]


@dataclasses.dataclass
class LoadResult:
    """What a load found: keys the target wanted but the checkpoint lacks, and
    keys the checkpoint has that the target did not ask for."""

    missing_keys: list[str]
    unexpected_keys: list[str]
    metadata: fmt.Metadata
    values: dict[str, Any]  # slot fqn -> rebuilt value


class LoadPipeline:
    """One load on one rank. ``state=None``: rebuild the whole checkpoint as plain values."""

    def __init__(
        self, storage: Storage, state: dict[str, Any] | None, opts: LoadOptions, ctx: DistContext, trace: Trace
    ) -> None:
        self.storage, self.state, self.opts, self.ctx, self.trace = storage, state, opts, ctx, trace
        self.md: fmt.Metadata | None = None
        self.opened: OpenedCheckpoint | None = None
        self.matched: Match | None = None
        self.target: LoadTarget | None = None
        self.own: list[Target] = []
        self.shared: SharedPlan = []
        self._shared_views: dict[Any, Any] = {}
        #: the state less its excluded entries, when ``exclude=`` names some (else None)
        self._adapted: dict[str, Any] | None = None

    def run(self) -> LoadResult:
        """(every rank) The whole load on the caller's thread, without cyclic
        garbage collection meanwhile: matching, planning and reading tens of
        thousands of tensors makes enough objects to start collections of the
        process's whole heap (a 20,120-tensor load: 2.2 s with them, 1.2 s
        paused); what is garbage goes at the first collection after. The
        working state (targets, the opened index) is let go before the
        collector is back on: it was the young objects the first collection
        after the pause traversed, one per load (3-6 ms for a 2,235-tensor load,
        10% of its Python), at the pause's very end."""
        with gc_paused():
            for phase, step in (("load/metadata", self.read_metadata), ("load/match", self.match),
                                ("load/plan", self.plan), ("load/read", self.read), ("load/read", self.exchange),
                                ("load/apply", self.apply)):
                self._check_deadline(phase)
                step()
            assert self.md is not None and self.matched is not None
            self._release()
            return LoadResult(self.matched.missing, self.matched.unexpected, self.md, self.matched.values)

    def _release(self) -> None:
        """(the end of :meth:`run`) Let go of what only the phases needed: the opened index, the
        targets and their plan (the result and :meth:`whole` need the metadata and the values)."""
        assert self.matched is not None
        self.matched.targets = []
        self.opened, self.target, self.own, self.shared, self._shared_views = None, None, [], [], {}

    def _check_deadline(self, phase: str) -> None:
        """(one process) A load past ``load_timeout_s`` stops before its next
        phase; with several ranks the collectives give up at the deadline
        together instead (:class:`~bytecp.dist.DistContext`)."""
        ctx = self.ctx
        if ctx.deadline is not None and (not ctx.enabled or ctx.world_size == 1) and time.monotonic() > ctx.deadline:
            raise TimeoutError(f"{self.storage.url}: the load's deadline ({ctx.deadline_option}) passed before "
                               f"{phase}; raise load_timeout_s if loads this large need longer")

    def read_metadata(self) -> None:
        """(coordinator opens, every rank receives; one broadcast) The opened
        checkpoint: validated metadata, sizes checked against the real files,
        and what each rank needs to find its rows (a version-1 index whole; a
        version-2 index only by its budget: each rank reads the segments its
        own targets meet in :meth:`read`)."""

        def read() -> Shared:
            with self.trace.span("read_metadata") as sp:
                # a Hugging Face or DCP directory too; format= forces one
                opened = open_checkpoint(self.storage, foreign=True, format=self.opts.format)
                opened.check_sizes()  # before any tensor is allocated
                sp.files = opened.files_read
                return opened.share()

        self.opened = OpenedCheckpoint.received(self.storage, self.ctx.broadcast("load/metadata", read))
        self.md = self.opened.metadata
        self.trace.checkpoint_id = self.md.save_id
        self.trace.step = self.md.step

    def match(self) -> None:
        """(every rank; fail-together) The adapter describes where this rank's
        tensors live (any world size or parallelism); they are matched with
        the checkpoint's keys, shapes and dtypes."""
        md = self.md
        assert md is not None

        def match() -> tuple[LoadTarget | None, OpenedCheckpoint, Match]:
            faults.inject("match", self.ctx.rank)
            if self.state is None:
                target, tree = None, Slot()
            else:
                # an entry excluded whole never reaches the adapter (its target would be built for
                # nothing); the others' plain values, replaced in that copy, go back at apply
                state = self.state
                if any(excluded(str(k), self.opts.exclude) for k in state):
                    state = self._adapted = {k: v for k, v in state.items()
                                             if not excluded(str(k), self.opts.exclude)}
                adapter = detect_adapter(state, self.opts.framework)
                with excluding(self.opts.exclude):  # entries an adapter adds are left out too
                    target = adapter.load_tree(state, self.ctx, md)
                tree = target.tree
            flat = flatten_tree(tree, target=True)
            opened = self.opened
            assert opened is not None
            if opened.transformers_names and self.state is not None:  # a Hugging Face directory: its names, the target's
                names = match_names(flat, md.tensors, tied=md.user_metadata.get("tie_word_embeddings") is True,
                                    strict=self.opts.strict, where=self.storage.url)
                opened = opened.renamed(names.renames, names.aliases)
            matched = match_target(self.storage, flat, opened.metadata, self.opts, self.ctx.rank,
                                   self.ctx.world_size, cast=opened.transformers_names,
                                   elsewhere=target.elsewhere if target is not None else (),
                                   names=[str(k) for k in self.state] if self.state is not None else ())
            if target is not None and target.check is not None:  # refused before anything is read into the state
                with excluding(self.opts.exclude):
                    target.check(matched.values)
            return target, opened, matched

        with self.trace.span("plan"):
            self.target, opened, self.matched = self.ctx.run("load/match", match)
        self.opened, self.md = opened, opened.metadata

    def plan(self) -> None:
        """(every rank; one all-gather of a digest with zero-redundancy
        loading) Which boxes this rank reads: its own targets, or with zero
        redundancy its pieces of the whole tensors every rank wants. The
        ranks compare only a digest of the whole tensors they want; when
        every rank wants the same ones (DDP, replicated values), each
        computes the same assignment alone (O(W) data exchanged in all).
        When they differ, each rank reads its own targets."""
        md, matched, ctx = self.md, self.matched, self.ctx
        assert md is not None and matched is not None
        zero = self.opts.zero_redundancy
        if zero is None:
            zero = self.storage.remote
        if zero and ctx.enabled and ctx.world_size > 1:
            mine = shared_candidates(matched.targets, md)
            digests = ctx.all_gather("load/plan", lambda: candidates_digest(mine))
            if mine and all(d == digests[0] for d in digests):
                with self.trace.span("plan"):
                    itemsizes = {fqn: ITEMSIZES[spec_of(md.tensors, fqn)[0]] for fqn, _ in mine}
                    self.shared = assign_shared(mine, ctx.world_size, itemsizes)
        self.own, self._shared_views = split_targets(matched.targets, self.shared, ctx.rank)

    def read(self) -> None:
        """(every rank; fail-together) The index rows of this rank's boxes
        (version 2: only the segments they meet), then ranged reads of only
        the bytes it needs, straight into its target tensors."""
        opened = self.opened
        assert opened is not None

        def read() -> None:
            faults.inject("read", self.ctx.rank)
            verify = self.opts.verify and not opened.foreign
            blocks = block_bytes_of(opened.metadata) if verify else None  # partial reads widened to whole blocks
            with self.trace.span("plan"):
                chunks = self._own_rows(opened)
                tensors = opened.metadata.tensors
                itemsizes = {t.fqn: ITEMSIZES[spec_of(tensors, t.fqn)[0]] for t in self.own}  # the stored dtype: a foreign source's may be cast
                reqs = plan_load([(t.fqn, t.box) for t in self.own], chunks, itemsizes=itemsizes, block_bytes=blocks)
            execute_reads(opened.storage, chunks, self.own, reqs, io_threads=self.opts.io_threads,
                          verify=verify, trace=self.trace, block_bytes=blocks)

        self.ctx.run("load/read", read)

    def _own_rows(self, opened: OpenedCheckpoint) -> list[fmt.ChunkRecord]:
        """The rows of this rank's boxes, checked against the metadata."""
        wanted: dict[str, list[Region]] = {}
        for t in self.own:
            if t.box.numel:
                wanted.setdefault(t.fqn, []).append(t.box)
        with self.trace.span("read_metadata") as sp:
            got = opened.rows_for(wanted)
            sp.files = got.files
        return got.rows

    def exchange(self) -> None:
        """(every rank, zero-redundancy loads only) Send the pieces read to every rank."""
        if self.shared:
            exchange(self.ctx, self.shared, self._shared_views, self.trace)

    def apply(self) -> None:
        """(every rank; fail-together) Hand modules, optimizers and stateful
        objects their loaded state through the adapter."""
        target, matched = self.target, self.matched
        if target is None or matched is None:
            return
        with self.trace.span("apply"):
            def apply() -> None:
                with excluding(self.opts.exclude):
                    target.finalize(matched.values)
                for after in matched.after:  # a resharded loader's sampler epoch
                    after()
                if self._adapted is not None and self.state is not None:
                    self.state.update(self._adapted)

            self.ctx.run("load/apply", apply)

    def whole(self) -> dict[str, Any]:
        """(``state=None``) The rebuilt checkpoint root (a dict of plain values)."""
        assert self.matched is not None
        value = self.matched.values[""]
        if not isinstance(value, dict):  # pragma: no cover - save always takes a dict
            raise ConfigError(f"{self.storage.url}: the checkpoint's root is not a dict")
        return value
