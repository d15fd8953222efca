"""The load sequence, written once: metadata -> match -> plan -> read ->
exchange -> apply.

Built by :mod:`bytecp.api` on every rank for ``bytecp.load`` (target: the
live state, filled in place) and in one process for
``bytecp.load_state_dict`` (target: everything, as plain values).

Collectives (every rank, in this order, each fail-together): the metadata
broadcast (the coordinator reads and validates ``metadata.json`` and the
chunk index), match, [the zero-redundancy all-gather], read, [one broadcast
per rank holding shared pieces], apply. A failure on any rank raises
:class:`~bytecp.errors.DistributedCheckpointError` on every rank, labelled
with the phase (``load/match``, ``load/read``, ...).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from . import faults, limits
from . import format as fmt
from .adapter_api import LoadTarget, detect_adapter
from .dist import DistContext
from .dtypes import dtype_from_name, itemsize
from .errors import ConfigError
from .matching import Match, match_target
from .options import LoadOptions
from .planner import plan_load, plan_shared_reads
from .reader import Target, execute_reads, read_chunks, read_metadata
from .recorder import Trace
from .state import Slot, flatten_tree
from .storage_api import Storage
from .zero_redundancy import SharedPlan, exchange, shared_candidates, split_targets

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
        self.chunks: list[fmt.ChunkRecord] = []
        self.matched: Match | None = None
        self.target: LoadTarget | None = None
        self.own: list[Target] = []
        self.shared: SharedPlan = []
        self._shared_views: dict[Any, Any] = {}

    def run(self) -> LoadResult:
        """(every rank) The whole load on the caller's thread."""
        self.read_metadata()
        self.match()
        self.plan()
        self.read()
        self.exchange()
        self.apply()
        assert self.md is not None and self.matched is not None
        return LoadResult(self.matched.missing, self.matched.unexpected, self.md, self.matched.values)

    def read_metadata(self) -> None:
        """(coordinator reads, every rank receives; one broadcast) The
        validated metadata and chunk index."""

        def read() -> tuple[fmt.Metadata, list[fmt.ChunkRecord]]:
            with self.trace.span("read_metadata") as sp:
                md = read_metadata(self.storage)
                real = limits.real_data_sizes(self.storage, md)  # one listing serves both checks
                chunks = read_chunks(self.storage, md, real)
                limits.check_sizes(self.storage, md, chunks, real)  # before any tensor is allocated
                sp.files = 1 + len(md.index_files)
            return md, chunks

        self.md, self.chunks = self.ctx.broadcast("load/metadata", read)
        self.trace.checkpoint_id = self.md.save_id
        self.trace.step = self.md.step

    def match(self) -> None:
        """(every rank; fail-together) The adapter describes where this rank's
        tensors live (any world size or parallelism); they are matched with
        the checkpoint's keys, shapes and dtypes."""
        md = self.md
        assert md is not None

        def match() -> tuple[LoadTarget | None, Match]:
            faults.inject("match", self.ctx.rank)
            if self.state is None:
                target, tree = None, Slot()
            else:
                adapter = detect_adapter(self.state, self.opts.framework)
                target = adapter.load_tree(self.state, self.ctx, md)
                tree = target.tree
            flat = flatten_tree(tree, target=True)
            return target, match_target(self.storage, flat, md, self.opts, self.ctx.rank, self.ctx.world_size)

        with self.trace.span("plan"):
            self.target, self.matched = self.ctx.run("load/match", match)

    def plan(self) -> None:
        """(every rank; one all-gather with zero-redundancy loading) Which
        boxes this rank reads: its own targets, or with zero redundancy its
        pieces of the boxes every rank needs (assigned alike on every rank)."""
        md, matched, ctx = self.md, self.matched, self.ctx
        assert md is not None and matched is not None
        zero = self.opts.zero_redundancy
        if zero is None:
            zero = self.storage.remote
        if zero and ctx.enabled and ctx.world_size > 1:
            specs = ctx.all_gather("load/plan", lambda: shared_candidates(matched.targets, md))
            with self.trace.span("plan"):
                itemsizes = {fqn: itemsize(dtype_from_name(info["dtype"])) for fqn, info in md.tensors.items()}
                self.shared = plan_shared_reads(specs, itemsizes)
        self.own, self._shared_views = split_targets(matched.targets, self.shared, ctx.rank)

    def read(self) -> None:
        """(every rank; fail-together) Ranged reads of only the bytes this
        rank needs, straight into its target tensors."""
        md = self.md
        assert md is not None

        def read() -> None:
            faults.inject("read", self.ctx.rank)
            with self.trace.span("plan"):
                itemsizes = {t.fqn: itemsize(t.view.dtype) for t in self.own}
                reqs = plan_load([(t.fqn, t.box) for t in self.own], self.chunks, itemsizes=itemsizes)
            execute_reads(self.storage, self.chunks, self.own, reqs, io_threads=self.opts.io_threads,
                          verify=self.opts.verify, trace=self.trace)

        self.ctx.run("load/read", read)

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
            self.ctx.run("load/apply", lambda: target.finalize(matched.values))

    def whole(self) -> dict[str, Any]:
        """(``state=None``) The rebuilt checkpoint root (a dict of plain values)."""
        assert self.matched is not None
        value = self.matched.values[""]
        if not isinstance(value, dict):  # pragma: no cover - save always takes a dict
            raise ConfigError(f"{self.storage.url}: the checkpoint's root is not a dict")
        return value
