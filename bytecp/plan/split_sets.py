"""Replica sets whose members hold different tensors: pipeline stages.

Called by the save pipeline's plan phase after :func:`~bytecp.plan.exchange.decide`
(every rank, a first save only). A hint naming every rank of the job, or
every stage of a pipeline (a DTensor on one stage's mesh), is too wide when
each stage holds its own part of the model under the full model's names:
the set's members vote different fingerprints and the set is bad. Its
members fall into groups that agree; if the groups hold pairwise different
tensors (no name in common), each group is a sound replica set of its own
and is planned locally like any other. One all-gather of the names' 8-byte
hashes, from one member of each group, proves it -- no box is gathered.
Groups that share a name stay with the coordinator (it compares boxes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from bytecp.format.chunk_batch import fqn_hash
from bytecp.plan.exchange import PlanDecision
from bytecp.plan.planner import LocalSavePlan

__all__ = ["names_of", "split_disjoint"]

#: (set key -> (group, sorted hashes of the tensor names the group holds in the set))
Names = Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]]


def names_of(plan: LocalSavePlan, decision: PlanDecision) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """(every rank) For each bad set in which this rank is the lowest member
    of its group: the group and the hashes of the tensors it holds in the set."""
    names: dict[str, set[int]] = {}
    for it, rs in zip(plan.items, plan.sets or (None,) * len(plan.items), strict=True):
        if rs is not None and rs.key in decision.bad_sets:
            names.setdefault(rs.key, set()).add(fqn_hash(it.fqn))
    out = {}
    for key, hashes in names.items():
        group = next((g for g in decision.groups.get(key, ()) if plan.rank in g), None)
        if group is not None and group[0] == plan.rank:
            out[key] = (group, tuple(sorted(hashes)))
    return out


def split_disjoint(decision: PlanDecision, gathered: Sequence[Names]) -> PlanDecision:
    """(every rank, alike) ``decision`` with every bad set whose groups hold
    pairwise different tensors split into its groups (``split``), planned
    locally; the coordinator plans only what is left (if anything)."""
    by_set: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for names in gathered:
        for key, entry in names.items():
            by_set.setdefault(key, []).append(entry)
    split: dict[str, tuple[tuple[int, ...], ...]] = {}
    for key in decision.bad_sets:
        entries = by_set.get(key, [])
        groups = decision.groups.get(key, ())
        if len(entries) != len(groups) or sum(len(g) for g, _ in entries) != sum(len(g) for g in groups):
            continue  # (a member sent nothing: not provable)
        every = [h for _, hashes in entries for h in hashes]
        if len(every) == len(set(every)):
            split[key] = tuple(sorted(g for g, _ in entries))
    if not split:
        return decision
    bad = decision.bad_sets - split.keys()
    return dataclasses.replace(decision, bad_sets=bad, split={**decision.split, **split})
