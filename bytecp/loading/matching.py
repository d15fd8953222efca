"""Match a load target against a checkpoint: keys, shapes and dtypes, the
boxes to fill, and the non-tensor values to rebuild.

Called by the load pipeline's match phase on every rank, after the metadata
has arrived and the adapter has described the target; one process for
``load_state_dict`` (whose target is a single slot: everything).
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from bytecp.adapter_api import excluded
from bytecp.data.restore import restore_data
from bytecp.errors import CorruptCheckpointError, StateMismatchError
from bytecp.format import metadata as fmt
from bytecp.format.objects import read_object
from bytecp.format.tensor_table import spec_of
from bytecp.loading.reader import Target
from bytecp.options import LoadOptions
from bytecp.storage_api import Storage
from bytecp.tree.dtypes import dtype_from_name, dtype_name
from bytecp.tree.regions import Region
from bytecp.tree.skeleton import Node, NodeKind
from bytecp.tree.state import FlatTree, Slot

__all__ = ["Match", "match_target"]


@dataclasses.dataclass
class Match:
    """What one rank loads: its boxes to fill, and the values rebuilt for its slots."""

    #: keys the target wanted but the checkpoint lacks
    missing: list[str]
    #: keys the checkpoint has that the target did not ask for
    unexpected: list[str]
    #: slot fqn -> rebuilt value (its tensors are in ``targets`` too, filled by the read)
    values: dict[str, Any]
    targets: list[Target]
    #: actions after the apply phase (a resharded data loader's sampler epoch: bytecp.data)
    after: list[Callable[[], None]] = dataclasses.field(default_factory=list)


def match_target(
    storage: Storage, target: FlatTree, md: fmt.Metadata, opts: LoadOptions, rank: int, world_size: int,
    *, cast: bool = False, elsewhere: Sequence[str] = (), names: Sequence[str] = (),
) -> Match:
    """(every rank) Match ``target`` with the checkpoint; raise
    :class:`~bytecp.errors.StateMismatchError` naming every difference
    (missing/unexpected keys only when ``opts.strict``; keys under the
    adapter's ``elsewhere`` names are another rank's, never unexpected).
    ``cast`` (a foreign source): a floating-point target of another floating
    dtype is read through a staging buffer and cast (bf16 <-> fp32).
    ``names``: the state's own top-level names (an entry excluded whole never
    reaches ``target``), for the warning of an ``exclude=`` name that looks
    misspelt."""
    skeleton = md.skeleton
    if opts.exclude:  # left out of the load: neither targets nor stored entries under those names
        _warn_unmatched(opts.exclude, [*skeleton.index(), *target.tensors, *target.slots, *names], storage.url)

        def drop(fqn: str) -> bool:
            return excluded(fqn, opts.exclude)

        target = _without(target, drop)
        skeleton = skeleton.without(drop)
    nodes = skeleton.index()
    sources = _sources(target, md)
    missing, unexpected = _compare_keys(target, md, nodes, sources, opts.exclude)
    if elsewhere:  # other ranks of the job load these (the adapter says so): not unexpected here
        unexpected = [k for k in unexpected if not excluded(k, elsewhere)]
    if opts.strict and (missing or unexpected):
        parts = [f"state does not match the checkpoint at {storage.url}:"]
        if missing:
            parts.append(f"  missing from the checkpoint ({len(missing)}): {_keys(missing)}")
        if unexpected:
            parts.append(f"  in the checkpoint but not in the state ({len(unexpected)}): {_keys(unexpected)}")
        saved_roots = {k.split(".", 1)[0] for k in nodes if k}
        roots = sorted({*_roots_not_in(unexpected, target), *({k.split(".", 1)[0] for k in missing} - saved_roots)})
        leave = f", or exclude={roots} to leave those entries out" if roots else ""
        parts.append(f"  pass strict=False to load the keys that match{leave}")
        raise StateMismatchError("\n".join(parts))
    targets = _tensor_targets(storage, target, md, sources, cast)
    rebuild = _SlotBuilder(storage, md, opts, rank, world_size, targets)
    values = {fqn: rebuild(nodes.get(fqn), slot) for fqn, slot in target.slots.items()}
    rebuild.warn_if_resharded_per_rank()
    return Match(missing, unexpected, values, targets, rebuild.after)


def _warn_unmatched(exclude: Sequence[str], keys: Sequence[str], url: str) -> None:
    """Warn of each ``exclude=`` name under which neither the state nor the
    checkpoint holds anything and that is close to a name they do hold (a
    typo leaves what it meant loaded); a name for what this load has none of
    (a model-only checkpoint's optimizer) is not one."""
    roots = {k.split(".", 1)[0].split("/", 1)[0] for k in keys}
    for n in exclude:
        if n in roots or any(excluded(k, (n,)) for k in keys if k.startswith(n)):
            continue
        close = difflib.get_close_matches(n.split(".", 1)[0], sorted(r for r in roots if r), n=1, cutoff=0.8)
        if close:
            warnings.warn(f"bytecp.load: exclude={n!r} names nothing in the state or the checkpoint at {url}; did "
                          f"you mean {close[0]!r}? (a misspelt name leaves what it meant loaded)",
                          stacklevel=_stacklevel_outside_bytecp())


def _sources(target: FlatTree, md: fmt.Metadata) -> dict[str, str]:
    """Target tensor FQN -> the stored tensor it is read from.

    A name the checkpoint records as an alias reads its stored tensor. The
    target's own ties (names sharing memory, :attr:`FlatTree.aliases`) form a
    group filled once, from the first of its names the checkpoint has (stored
    or aliased): a tied target loads an untied checkpoint, and an untied
    target gets the data under each name.
    """
    names = {fqn: [fqn] for fqn in target.tensors}
    for alias, first in target.aliases.items():
        names[first].append(alias)
    out: dict[str, str] = {}
    for fqn, group in names.items():
        for name in group:
            src = name if name in md.tensors else md.aliases.get(name)
            if src is not None:
                out[fqn] = src
                break
    return out


def _without(target: FlatTree, drop: Callable[[str], bool]) -> FlatTree:
    """The target less its entries under excluded names (they keep their values)."""
    return dataclasses.replace(
        target,
        tensors={k: v for k, v in target.tensors.items() if not drop(k)},
        aliases={k: v for k, v in target.aliases.items() if not drop(k) and not drop(v)},
        slots={k: v for k, v in target.slots.items() if not drop(k)},
    )


def _roots_not_in(unexpected: list[str], target: FlatTree) -> list[str]:
    """The top-level names of ``unexpected`` keys under which the state holds nothing."""
    held = {k.split(".", 1)[0] for k in (*target.tensors, *target.aliases, *target.slots)}
    return sorted({k.split(".", 1)[0] for k in unexpected} - held)


def _compare_keys(
    target: FlatTree, md: fmt.Metadata, nodes: dict[str, Node], sources: dict[str, str],
    exclude: tuple[str, ...] = (),
) -> tuple[list[str], list[str]]:
    missing: list[str] = []
    covered: set[str] = set()
    for fqn in [*target.tensors, *target.aliases]:
        if fqn in sources or target.aliases.get(fqn) in sources:  # a tie: filled with its group
            covered.add(fqn)
        else:
            missing.append(fqn)
    for fqn in target.slots:
        node = nodes.get(fqn)
        if node is None:
            missing.append(fqn)
        else:
            covered.update(leaf.name for leaf in node.leaves())
    saved = set(md.tensors) | set(md.aliases) | set(md.objects) | set(md.per_rank)
    if exclude:
        saved = {k for k in saved if not excluded(k, exclude)}
    return missing, sorted(saved - covered)


def _tensor_targets(
    storage: Storage, target: FlatTree, md: fmt.Metadata, sources: dict[str, str], cast: bool = False
) -> list[Target]:
    """The boxes of the target's tensors that the checkpoint holds (an alias
    of the target shares its group's memory and is not read again); any
    shape or dtype difference is an error naming the tensor and both sides."""
    targets: list[Target] = []
    mismatches: list[str] = []
    retyped = 0  # the same shape in another dtype
    for fqn, leaf in target.tensors.items():
        src = sources.get(fqn)
        if src is None:
            continue
        dt, shape = spec_of(md.tensors, src)
        castable = cast and leaf.dtype.is_floating_point and dtype_from_name(dt).is_floating_point
        if shape != tuple(leaf.global_shape) or (dt != dtype_name(leaf.dtype) and not castable):
            mismatches.append(
                f"{fqn}{'' if src == fqn else f' (stored as {src})'}: checkpoint has {dt} {list(shape)}, "
                f"target is {dtype_name(leaf.dtype)} {list(leaf.global_shape)}"
            )
            retyped += shape == tuple(leaf.global_shape)
            continue
        targets.extend(Target(src, sh.region, sh.tensor) for sh in leaf.shards)
    if mismatches:
        raise StateMismatchError(
            f"tensor shape or dtype differs from the checkpoint at {storage.url}:\n  "
            + "\n  ".join(mismatches[:50])
            + ("\n  ..." if len(mismatches) > 50 else "")
            + ("\n  a bytecp checkpoint loads in its own dtypes: load into a state of the checkpoint's dtypes and convert it after "
               "(model.to(dtype)), or read bytecp.load_state_dict(url) and cast what you take" if retyped else "")
        )
    return targets


class _SlotBuilder:
    """Rebuilds slot values from the skeleton: tensors are allocated whole and
    added to the targets, objects read (each once), per-rank values taken
    from this rank's record (or, at another world size, ``rank % saved``);
    a data loader's position resharded from the checkpoint's merged
    positions when its layout changed (:mod:`bytecp.data.restore`)."""

    def __init__(
        self, storage: Storage, md: fmt.Metadata, opts: LoadOptions, rank: int, world_size: int,
        targets: list[Target],
    ) -> None:
        self.storage, self.md, self.opts, self.targets = storage, md, opts, targets
        self.rank, self.world_size = rank, world_size
        self.src = rank if md.world_size == world_size else rank % max(1, md.world_size)
        self._objects: dict[str, Any] = {}
        self._tensors: dict[str, torch.Tensor] = {}  # stored FQN -> the tensor rebuilt for it
        self._resharded: set[str] = set()
        self._live: Any = None  # the live object of the slot being rebuilt (a data loader)
        self._warnings: list[str] = []
        self.after: list[Callable[[], None]] = []

    def __call__(self, node: Node | None, slot: Slot) -> Any:
        if node is None:
            return slot.default
        self._live = slot.live
        return node.build(self._leaf)

    def _leaf(self, kind: NodeKind, fqn: str) -> Any:
        if kind == "tensor":  # an alias is the very tensor of its stored name: the tie is kept
            src = fqn if fqn in self.md.tensors else self.md.aliases[fqn]
            t = self._tensors.get(src)
            if t is None:
                dt, shape = spec_of(self.md.tensors, src)
                t = self._tensors[src] = torch.empty(shape, dtype=dtype_from_name(dt))
                self.targets.append(Target(src, Region(tuple(0 for _ in t.shape), tuple(t.shape)), t))
            return t
        if kind == "obj":
            if fqn not in self._objects:
                self._objects[fqn] = self._read(fqn, self.md.objects[fqn])
            return self._objects[fqn]
        recs = self.md.per_rank[fqn]
        if self._live is not None:
            got = restore_data(fqn, self._live, self.md.data.get(fqn), self.md.world_size, self.rank,
                               self.world_size, lambda r: self._per_rank(fqn, recs, r), self.opts.data_reshard)
            if got is not None:
                self.after += [got.after] if got.after is not None else []
                self._warnings += [got.warning] if got.warning else []
                if not got.as_saved:
                    return got.value
                return self._per_rank(fqn, recs, self.src)
        if self.md.world_size != self.world_size:
            self._resharded.add(fqn)
        return self._per_rank(fqn, recs, self.src)

    def _per_rank(self, fqn: str, recs: Mapping[int, fmt.ObjectRecord], rank: int) -> Any:
        if rank not in recs:
            raise CorruptCheckpointError(f"{self.storage.url}: no per-rank value of {fqn!r} for rank {rank}")
        return self._read(f"{fqn}[rank {rank}]", recs[rank])

    def _read(self, fqn: str, rec: fmt.ObjectRecord) -> Any:
        return read_object(self.storage, fqn, rec, verify=self.opts.verify, allow_pickle=self.opts.allow_pickle)

    def warn_if_resharded_per_rank(self) -> None:
        for w in self._warnings:
            warnings.warn(w, stacklevel=_stacklevel_outside_bytecp())
        if self._resharded:
            warnings.warn(
                f"checkpoint {self.storage.url} was saved by {self.md.world_size} ranks and is loaded by "
                f"{self.world_size}: rank {self.rank} restores the per-rank state of saved rank "
                f"{self.src} for {', '.join(sorted(self._resharded)[:5])}",
                stacklevel=_stacklevel_outside_bytecp(),
            )


def _stacklevel_outside_bytecp() -> int:
    """The ``stacklevel`` that points a warning at the caller's code: the
    first frame whose module is not ``bytecp`` or one of its subpackages."""
    level, f = 1, sys._getframe(1)
    while f is not None:
        module = f.f_globals.get("__name__", "")
        if module != "bytecp" and not module.startswith("bytecp."):
            return level
        f, level = f.f_back, level + 1  # type: ignore[assignment]
    return level


def _keys(keys: Sequence[str], n: int = 20) -> str:
    shown = ", ".join(repr(k) for k in list(keys)[:n])
    return shown + (f", ... ({len(keys) - n} more)" if len(keys) > n else "")
