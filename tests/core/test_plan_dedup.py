"""The save plan for simulated ranks whose replica hints are wrong or
missing for some boxes: identical boxes are written once, whatever the
hints said; boxes that overlap without being the same box fail the plan,
naming the tensor, the ranks and the boxes."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

from bytecp.errors import ConfigError
from bytecp.plan.exchange import (
    decide,
    local_plan,
    needs_coordinator,
    plan_key,
    planned_locally,
    vote_for,
)
from bytecp.plan.planner import WriteItem, find_overlap, plan_save
from bytecp.tree.regions import Region
from bytecp.tree.skeleton import Node
from bytecp.tree.state import FlatTree, ReplicaSet, Shard, TensorLeaf

SHAPE = (24, 4)


def leaf(rows: tuple[int, int], hint: ReplicaSet | None) -> TensorLeaf:
    box = Region((rows[0], 0), (rows[1] - rows[0], 4))
    return TensorLeaf(SHAPE, torch.float32, [Shard(box, torch.zeros(box.lengths))], hint)


def tree(**tensors: TensorLeaf) -> FlatTree:
    return FlatTree(Node.container("dict", ()), dict(tensors), {}, {}, {})


def plan_world(trees: list[FlatTree]) -> tuple[list[list[WriteItem]], bool]:
    """What every rank writes, as the save's plan phase computes it."""
    world = len(trees)
    plans = [local_plan(t, r, world) for r, t in enumerate(trees)]
    decision = decide([vote_for(p, plan_key(p), None, "s", None) for p in plans])
    mine = [planned_locally(p, decision, split_bytes=4 << 20) for p in plans]
    if decision.coordinated:
        rest = plan_save([needs_coordinator(p, decision) for p in plans], base_load=list(decision.base_load),
                         check_coverage=False)
        mine = [a + b for a, b in zip(mine, rest, strict=True)]
    return mine, decision.coordinated


def tiles_once(mine: list[list[WriteItem]], fqns: list[str]) -> None:
    boxes: dict[str, list[Region]] = defaultdict(list)
    for items in mine:
        for it in items:
            boxes[it.fqn].append(it.region)
    for fqn in fqns:
        assert sum(b.numel for b in boxes[fqn]) == math.prod(SHAPE), fqn
        assert find_overlap([b for b in boxes[fqn] if b.numel]) is None, fqn


def own(r: int) -> ReplicaSet:
    return ReplicaSet.of((r,))


def test_own_hints_on_replicas_are_merged_without_the_coordinator() -> None:
    # an adapter that calls every rank's box its own, on 2 x 2 ranks holding halves
    trees = [tree(w=leaf((0, 12) if r < 2 else (12, 24), own(r))) for r in range(4)]
    mine, coordinated = plan_world(trees)
    assert not coordinated
    tiles_once(mine, ["w"])


def test_two_sound_sets_holding_the_same_boxes_write_them_once() -> None:
    # a hint naming only a sub-mesh's ranks: {0, 1} and {2, 3} each sound, both hold all of w
    trees = [tree(w=leaf((0, 24), ReplicaSet.of((0, 1) if r < 2 else (2, 3)))) for r in range(4)]
    mine, coordinated = plan_world(trees)
    assert not coordinated
    tiles_once(mine, ["w"])
    assert sum(1 for items in mine for _ in items) >= 1


def test_boxes_with_and_without_hints_are_deduplicated_by_the_coordinator() -> None:
    # ranks 0, 1: a sound set; ranks 2, 3 hold the same box without a hint; own shards of v alongside
    trees = [tree(w=leaf((0, 24), ReplicaSet.of((0, 1)) if r < 2 else None),
                  v=leaf((6 * r, 6 * r + 6), own(r))) for r in range(4)]
    mine, coordinated = plan_world(trees)
    assert coordinated
    tiles_once(mine, ["w", "v"])
    assert [[it.region.offsets[0] for it in items if it.fqn == "v"] for items in mine] == [[0], [6], [12], [18]]


def test_an_own_box_a_hintless_rank_also_holds_is_written_once() -> None:
    trees = [tree(w=leaf((0, 12), own(0))), tree(w=leaf((0, 12), None)), tree(w=leaf((12, 24), own(2)))]
    mine, coordinated = plan_world(trees)
    assert coordinated
    tiles_once(mine, ["w"])


def test_overlapping_boxes_that_differ_fail_the_plan_naming_ranks_and_boxes() -> None:
    trees = [tree(w=leaf((0, 12), None)), tree(w=leaf((8, 24), None))]
    with pytest.raises(ConfigError) as e:
        plan_world(trees)
    msg = str(e.value)
    assert "tensor 'w' of shape [24, 4]" in msg and "rank(s) [0]" in msg and "rank(s) [1]" in msg
    assert "[0:12, 0:4]" in msg and "[8:24, 0:4]" in msg and "redistribute" in msg


def pp_trees(split_names: bool = True) -> list[FlatTree]:
    """pipeline 2 x FSDP 2 on a (pp, dp) mesh: each stage's shards hinted
    with the other stage's rank too (a DTensor on mesh["dp"]), step counters
    as plain tensors on every rank (hinted: every rank)."""
    trees = []
    for r in range(4):
        stage, i = divmod(r, 2)
        name = f"layers.{stage}.w" if split_names else "layers.0.w"
        hint = ReplicaSet.of((i, 2 + i))
        step = TensorLeaf.full(torch.zeros(()))
        trees.append(tree(**{name: leaf((12 * i, 12 * i + 12), hint), f"{name}.step": step}))
    return trees


def test_pipeline_stages_split_their_sets_by_names_and_plan_without_boxes() -> None:
    from bytecp.plan.split_sets import names_of, split_disjoint

    trees = pp_trees()
    plans = [local_plan(t, r, 4) for r, t in enumerate(trees)]
    decision = decide([vote_for(p, plan_key(p), None, "s", None) for p in plans])
    # {0, 2}, {1, 3} and every rank: members holding different stages vote apart, into these groups
    groups = sorted(decision.groups[k] for k in decision.bad_sets)
    assert decision.coordinated and groups == [((0,), (2,)), ((0, 1), (2, 3)), ((1,), (3,))], groups
    decision = split_disjoint(decision, [names_of(p, decision) for p in plans])
    assert not decision.coordinated and not decision.bad_sets
    assert sorted(decision.split.values()) == groups  # each split into its groups, planned locally
    mine = [planned_locally(p, decision, split_bytes=4 << 20) for p in plans]
    for name in ("layers.0.w", "layers.1.w"):
        assert sorted(it.region.offsets[0] for items in mine for it in items if it.fqn == name) == [0, 12]
        assert sum(1 for items in mine for it in items if it.fqn == f"{name}.step") == 1


def test_groups_that_share_a_name_stay_with_the_coordinator() -> None:
    from bytecp.plan.split_sets import names_of, split_disjoint

    # a hint {0, 1} on what are two shards of one tensor: the groups share the name
    trees = [tree(w=leaf((12 * r, 12 * r + 12), ReplicaSet.of((0, 1)))) for r in range(2)]
    plans = [local_plan(t, r, 2) for r, t in enumerate(trees)]
    decision = decide([vote_for(p, plan_key(p), None, "s", None) for p in plans])
    decision = split_disjoint(decision, [names_of(p, decision) for p in plans])
    assert decision.coordinated and not decision.split
    mine, _ = plan_world(trees)
    tiles_once(mine, ["w"])
