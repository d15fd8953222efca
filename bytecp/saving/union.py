"""The union of what the ranks describe, merged at a job's first save and kept for the next.

Called by the save pipeline's plan phase (every rank, :func:`gather_union`)
when the ranks' state skeletons differ and the coordinator holds no union
of them yet: the lowest rank of each skeleton other than the coordinator's
sends it with its tensor table and aliases, and :func:`described_union`
merges them with the coordinator's own on a thread while every rank stages
and writes its data; the coordinator's commit
(:func:`bytecp.saving.commit.build_metadata`) reads the merged union. It is
kept for the next saves of the same state; the pipeline's vote announces
the kept ones (:func:`kept_unions`), and when the plan decision's key is
one of them no rank sends its skeleton again.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from bytecp import faults
from bytecp.dist import DistContext
from bytecp.errors import CorruptCheckpointError
from bytecp.format.member_text import EncodedMembers, dumps, encode_members
from bytecp.format.parts_wire import NameTable
from bytecp.format.table_union import elements_of, sent_table, union_tables
from bytecp.format.tensor_table import TensorTable
from bytecp.plan.exchange import PLAN_STATS
from bytecp.tree.bulk import gc_paused
from bytecp.tree.dtypes import dtype_name
from bytecp.tree.kept import Recent, memoized
from bytecp.tree.pools import KeptPool
from bytecp.tree.skeleton import Node
from bytecp.tree.skeleton_union import NotCompact, deferred, union_json
from bytecp.tree.state import FlatTree, merge_aliases

__all__ = ["DescribedUnion", "described_by", "described_union", "gather_union", "kept_unions", "tensor_specs",
           "tensor_table"]


def tensor_specs(flat: FlatTree) -> dict[str, dict[str, Any]]:
    """Every tensor's dtype and global shape, as ``metadata.json`` lists them."""
    return {
        fqn: {"dtype": dtype_name(leaf.dtype), "shape": list(leaf.global_shape)}
        for fqn, leaf in flat.tensors.items()
    }


def tensor_table(flat: FlatTree) -> TensorTable:
    """(every rank, at commit) :func:`tensor_specs` as a read-only table, kept
    with a kept description (:func:`bytecp.tree.kept.memoized`): the checks of this
    rank's chunks keep their columns of it in its memo, made once for the
    saves of a state whose structure has not changed."""
    return memoized(flat, ("tensor table",), lambda: TensorTable.of(tensor_specs(flat)), specs=True)


def _merge_skeletons(skeleton: Node, sent: Sequence[tuple[int, Any]]) -> tuple[Node, str | None]:
    """The union of the coordinator's skeleton with those ``sent`` (rank,
    skeleton JSON, or its text) by the ranks whose state differs from every lower
    rank's; with the union's JSON text when it was merged as JSON (the node
    is then parsed from it only if read: :mod:`bytecp.tree.skeleton_union`)."""
    if not sent:
        return skeleton, None
    with gc_paused():  # a few objects per leaf of every skeleton sent (bytecp.tree.bulk)
        sent = [(r, _parsed(r, sk)) for r, sk in sent]
        own = skeleton.to_json()
        try:
            doc = union_json(own, [sk for _, sk in sent])
        except NotCompact:  # (not as Node.to_json writes it: parsed, which names the fault)
            return skeleton.merge_all([Node.from_json(sk, f"rank {r}'s skeleton") for r, sk in sent]), None
        if doc is own:
            return skeleton, None
        text = dumps(doc)
        return deferred(text, "the union of the ranks' skeletons"), text


def _parsed(rank: int, doc: Any) -> Any:
    """A skeleton sent as its JSON text (:func:`described_by`), parsed; one sent as JSON objects, as it is."""
    if type(doc) is not str:
        return doc
    try:
        return json.loads(doc)
    except ValueError as e:
        raise CorruptCheckpointError(f"rank {rank}'s skeleton: not JSON ({str(e)[:200]})") from e


def _ready_names(tensors: TensorTable, hashes: np.ndarray) -> None:
    """(the union's thread) The commit's table of these tensor names
    (:meth:`NameTable.of <bytecp.format.parts_wire.NameTable.of>` keeps the
    last one built) with its Arrow column, and Arrow's take readied (its first
    call imports ``pyarrow.compute``): 0.3 s of a DeepSeek-V3-like state's
    first commit, paid here while the ranks write. Only a warm-up: a fault
    here (two names of one 64-bit hash, or any other) is the commit's to
    report, which builds the table again."""
    if not len(tensors):
        return
    with contextlib.suppress(Exception):
        NameTable.of(tensors.names, hashes).strings(np.zeros(1, np.int64))


@dataclasses.dataclass(frozen=True, eq=False)
class DescribedUnion:
    """The union of what the ranks describe, as a commit's ``metadata.json``
    holds it: the next saves of the same state share it, so the specs are a
    read-only :class:`~bytecp.format.tensor_table.TensorTable` and each
    commit's metadata gets its own copy of the aliases. It may still be
    merging on a thread (:func:`described_union`): reading a member waits
    for it (the tables first, then the skeleton, aliases and JSON text), and
    raises what the merge raised."""

    #: the plan decision's specs key ("": never reused) and the coordinator that built it
    specs_key: str
    coordinator: int
    #: (the tensors, their elements and name hashes)
    tabled: concurrent.futures.Future[tuple[TensorTable, int, np.ndarray]]
    #: (the skeleton, the JSON text of it and of ``tensors``, the aliases)
    described: concurrent.futures.Future[tuple[Node, EncodedMembers, dict[str, str]]]

    @property
    def tensors(self) -> TensorTable:
        return self.tabled.result()[0]

    @property
    def aliases(self) -> dict[str, str]:
        return self.described.result()[2]

    @property
    def elements(self) -> int:
        """The tensors' elements, all together (the commit's count of what the ranks hold)."""
        return self.tabled.result()[1]

    @property
    def hashes(self) -> np.ndarray:
        """The tensors' name hashes, in their order (the commit's directory looks names up by them)."""
        return self.tabled.result()[2]

    @property
    def skeleton(self) -> Node:
        return self.described.result()[0]

    @property
    def encoded(self) -> EncodedMembers:
        return self.described.result()[1]


#: by (the save pipeline's plan-cache key, specs key): the unions its last
#: commits built, the newest last (its coordinator announces their keys in
#: its vote; when the decision's is one of them, no rank sends its skeleton)
#: (added to by the thread that merges a union's skeletons; a process saving several states in turn,
#: a model and an EMA copy, keeps each one's)
_KEPT: Recent[tuple[Any, str], DescribedUnion] = Recent(4)
#: the thread a job's first commit merges the ranks' skeletons on, meanwhile building the index directory
_MERGING = KeptPool(1, "bytecp-union")


def kept_unions(slot: Any, coordinator: int) -> list[DescribedUnion]:
    """(coordinator, as it votes) The unions the last commits under ``slot`` built, if it built them."""
    return [u for (s, _), u in _KEPT.items() if s == slot and u.coordinator == coordinator]


def described_by(flat: FlatTree) -> tuple[Any, dict[str, Any], dict[str, str]]:
    """(a rank that sends, :func:`gather_union`) What it sends of ``flat``:
    its skeleton's compact JSON as text (one string to pickle and unpickle:
    the coordinator parses it on its merging thread, with the collector
    paused; as JSON objects, 63 skeletons of a DeepSeek-V3-like state took
    0.6 s to unpickle in the gather itself, every rank waiting), its tensor
    specs as a table (:func:`~bytecp.format.table_union.sent_table`) and its aliases."""
    PLAN_STATS.specs_sent += 1
    return dumps(flat.skeleton.to_json()), sent_table(tensor_specs(flat)), dict(flat.aliases)


def gather_union(ctx: DistContext, flat: FlatTree, sends: bool, specs_key: str, slot: Any) -> DescribedUnion | None:
    """(every rank, the end of the plan phase of a save whose ranks'
    skeletons differ and whose union the coordinator does not hold) One
    gather and a broadcast: each rank that ``sends`` (the lowest of each
    skeleton other than the coordinator's:
    :func:`~bytecp.plan.decide.sends_specs`) its skeleton JSON, tensor table
    (:func:`~bytecp.format.table_union.sent_table`) and aliases to the
    coordinator, which starts merging them with its own on a thread
    (:func:`described_union`, kept under ``slot`` once merged) and returns
    the union; None on every other rank. Raises on every rank when one
    failed to send. The merge runs while the ranks stage and write (a
    DeepSeek-V3-like state: 63 skeletons of 181,580 tensors in all, 0.4 s),
    so the commit finds it done; a fault in it (two ranks describing a
    tensor differently) is raised where the commit reads it."""
    made: list[DescribedUnion] = []

    def send() -> tuple[Any, dict[str, Any], dict[str, str]] | None:
        faults.inject("union", ctx.rank)
        return described_by(flat) if sends else None

    def merge(got: list[tuple[Any, dict[str, Any], dict[str, str]] | None]) -> None:
        made.append(described_union(lambda: (flat.skeleton, tensor_specs(flat), flat.aliases),
                                    [(r, *g) for r, g in enumerate(got) if g is not None], ctx.coordinator,
                                    specs_key, slot))

    ctx.all_reduce("save/plan", send, merge)
    return made[0] if made else None


def described_union(own: Callable[[], tuple[Node, dict[str, dict[str, Any]], dict[str, str]]],
                    sent: Sequence[tuple[int, Any, Mapping[str, Any], dict[str, str]]],
                    coordinator: int, specs_key: str = "", slot: Any = None) -> DescribedUnion:
    """(coordinator: at a job's first save, :func:`gather_union`; at a
    commit whose ranks all describe the coordinator's skeleton,
    :func:`~bytecp.saving.commit.build_metadata`) The union of the
    coordinator's skeleton, tensor specs and aliases (``own()``) with those
    ``sent`` (rank, skeleton JSON, tensor table, aliases) by the ranks whose
    state differs from every lower rank's, with its elements, name hashes
    and JSON text, for ``specs_key`` (every distinct skeleton's digest and
    its lowest rank, from the plan's votes:
    :attr:`~bytecp.plan.decide.PlanDecision.specs_key`). When some were
    sent, the union is merged on a thread while the ranks stage and write
    their data: first the tables (:func:`~bytecp.format.table_union.union_tables`:
    :class:`ConfigError`, raised where they are read, when two ranks
    describe a tensor differently), then the skeletons and the JSON text. A
    new union is kept under ``slot`` for the next saves once merged. A
    state of 181,580 tensors merged from 64 skeletons and tables costs 0.4 s
    to merge and encode; a job pays that once, while its first save writes."""
    skeleton, specs, aliases = own()
    tabled: concurrent.futures.Future[tuple[TensorTable, int, np.ndarray]] = concurrent.futures.Future()
    described: concurrent.futures.Future[tuple[Node, EncodedMembers, dict[str, str]]] = concurrent.futures.Future()
    union = DescribedUnion(specs_key, coordinator, tabled, described)

    def describe() -> None:
        try:
            with gc_paused():  # a few objects per tensor of every rank that sent its table
                tensors, hashes = union_tables([(coordinator, sent_table(specs)), *((r, t) for r, _, t, _ in sent)])
            tabled.set_result((tensors, elements_of(tensors), hashes))
            _ready_names(tensors, hashes)
            node, text = _merge_skeletons(skeleton, [(r, sk) for r, sk, _, _ in sent])  # (its faults before the aliases')
            merged = merge_aliases(aliases, [(r, a) for r, _, _, a in sent], tensors, coordinator)
            encoded = encode_members(node, tensors, skeleton_text=text)
        except BaseException as e:  # noqa: BLE001 - raised where the union is read
            if not tabled.done():
                tabled.set_exception(e)
            described.set_exception(e)
            return
        if specs_key and slot is not None:
            _KEPT.put((slot, specs_key), union)
        described.set_result((node, encoded, merged))

    if sent:
        _MERGING.get().submit(describe)
    else:
        describe()
    return union
