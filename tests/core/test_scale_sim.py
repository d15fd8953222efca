"""Correctness at thousands of simulated ranks, in one process: the save plan
made from replica hints writes every byte exactly once, the version-2 index
gives every rank exactly the chunks its targets need (every needed byte read
once) while it reads a small part of the index, and the zero-redundancy
assignment computed locally equals the gathered one. Times are the scale
benchmark's business (benchmarks/scale.py), not asserted here."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

from benchmarks import scale_sim as sim
from bytecp.format import index_read
from bytecp.format import metadata as fmt
from bytecp.format.index_build import build_index
from bytecp.plan.exchange import (
    decide,
    local_plan,
    needs_coordinator,
    plan_key,
    planned_locally,
    vote_for,
)
from bytecp.plan.load_plan import plan_load
from bytecp.plan.planner import (
    WriteItem,
    assign_shared,
    find_overlap,
    plan_save,
    plan_shared_reads,
)
from bytecp.storage_api import open_storage
from bytecp.tree.regions import Region, full_region
from bytecp.tree.skeleton import Node
from bytecp.tree.state import EVERY_RANK, FlatTree, ReplicaSet, Shard, TensorLeaf

SMALL = sim.llama7b(layers=1, hidden=512, ffn=1376, vocab=4000)


def assert_tiles(written: dict[str, list[Region]], shapes: dict[str, tuple[int, ...]]) -> None:
    for fqn, shape in shapes.items():
        boxes = [b for b in written[fqn] if b.numel]
        assert sum(b.numel for b in boxes) == math.prod(shape), fqn
        assert find_overlap(boxes) is None, fqn


def plan_world(trees: list[FlatTree], split: int = 4 << 20) -> list[list[WriteItem]]:
    """What every rank writes, computed as each rank computes it (a replica
    set's plan, the same on each member, is made once; a few members make
    their own to show it is the same)."""
    world = len(trees)
    plans = [local_plan(t, r, world) for r, t in enumerate(trees)]
    votes = [vote_for(p, plan_key(p), None, "s", None) for p in plans]
    decision = decide(votes)
    shared: dict = {}
    mine = [planned_locally(p, decision, split_bytes=split, shared=shared) for p in plans]
    for r in {0, world // 2, world - 1}:
        assert planned_locally(plans[r], decision, split_bytes=split) == mine[r]
    if decision.coordinated:
        rest = plan_save([needs_coordinator(p, decision) for p in plans], split_bytes=split,
                         base_load=list(decision.base_load), check_coverage=False)
        mine = [a + b for a, b in zip(mine, rest, strict=True)]
    return mine


def written_by(mine: list[list[WriteItem]]) -> dict[str, list[Region]]:
    out: dict[str, list[Region]] = defaultdict(list)
    for items in mine:
        for it in items:
            out[it.fqn].append(it.region)
    return out


def test_fsdp_4096_ranks_plan_without_the_coordinator_and_tile_once() -> None:
    world = 4096
    trees = [sim.fsdp_rank_tree(SMALL, world, r) for r in range(world)]
    plans = [local_plan(t, r, world) for r, t in enumerate(trees[:2])]
    decision = decide([vote_for(p, plan_key(p), None, "s", None) for p in plans] * (world // 2))
    assert not decision.bad_sets  # shards, and one world set every rank agrees on
    mine = plan_world(trees)
    shapes = {fqn: shape for fqn, shape, _ in sim.fsdp_tensors(SMALL, True)}
    assert_tiles(written_by(mine), shapes)
    # every shard by its holder; each step tensor by exactly one rank
    for r in (0, 511, 4095):
        assert all(it.region == sim.row_box(it.global_shape, world, r) for it in mine[r] if it.global_shape)
    assert sum(1 for items in mine for it in items if not it.global_shape) == len(SMALL)


def ddp_trees(world: int, shapes: dict[str, tuple[int, ...]], extra_on: int | None = None) -> list[FlatTree]:
    trees = []
    for r in range(world):
        tensors = {f: TensorLeaf.full(torch.zeros(1).expand(s)) for f, s in shapes.items()}
        if r == extra_on:
            tensors["only_here"] = TensorLeaf.full(torch.zeros(5))
        trees.append(FlatTree(Node.container("dict", ()), tensors, {}, {}, {}))
    return trees


def test_ddp_4096_ranks_split_every_tensor_once_each_rank_near_one_over_w() -> None:
    world = 4096
    shapes = {f"layers.{i}.w": (8192 + 7 * i, 4096) for i in range(24)} | {"embed": (50257, 1024), "norm": (1024,)}
    mine = plan_world(ddp_trees(world, shapes))
    assert_tiles(written_by(mine), shapes)
    per_rank = [sum(it.nbytes for it in items) for items in mine]
    total = sum(math.prod(s) * 4 for s in shapes.values())
    assert sum(per_rank) == total
    assert max(per_rank) <= 1.1 * total / world + (4 << 20)


def test_a_hint_that_does_not_hold_is_planned_by_the_coordinator() -> None:
    world = 64
    shapes = {"a": (4096, 64), "b": (7,)}
    trees = ddp_trees(world, shapes, extra_on=5)  # rank 5 holds a tensor nobody else has
    plans = [local_plan(t, r, world) for r, t in enumerate(trees)]
    decision = decide([vote_for(p, plan_key(p), None, "s", None) for p in plans])
    assert decision.coordinated and ReplicaSet.world(world).key in decision.bad_sets
    mine = plan_world(trees)
    assert_tiles(written_by(mine), shapes | {"only_here": (5,)})
    assert [it.fqn for it in mine[5] if it.fqn == "only_here"] == ["only_here"]


def test_hsdp_replicas_write_once_spread_over_each_replica_group() -> None:
    replicas, shards = 16, 256  # 4096 ranks: mesh (replicate, shard)
    world = replicas * shards
    shape = (8192, 131072)  # a 16 MiB shard per rank: one piece per replica
    trees = []
    for r in range(world):
        i = r % shards
        group = ReplicaSet.of(tuple(j * shards + i for j in range(replicas)))
        box = sim.row_box(shape, shards, i)
        leaf = TensorLeaf(shape, torch.float32, [Shard(box, torch.zeros(1).expand(box.lengths))], group)
        trees.append(FlatTree(Node.container("dict", ()), {"w": leaf, "step": TensorLeaf.full(torch.zeros(()), EVERY_RANK)},
                              {}, {}, {}))
    mine = plan_world(trees)
    assert_tiles(written_by(mine), {"w": shape, "step": ()})
    per_rank = [sum(it.nbytes for it in items if it.fqn == "w") for items in mine]
    assert min(per_rank) == max(per_rank) == 8192 * 131072 * 4 // world  # every replica writes 1/16 of its shard


@pytest.fixture(scope="module")
def fsdp_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[fmt.Metadata, object, int]:
    world = 4096
    batches = sim.fsdp_batches(SMALL, world, adam=True)
    tensors, files = sim.specs(SMALL, True), sim.data_files(batches)
    built = build_index(batches, tensors, files, "20261123T000000-00000000")
    for fqn, d in built.band_dims.items():
        tensors[fqn] = {**tensors[fqn], "band_dim": d}
    md = fmt.Metadata(save_id="20261123T000000-00000000", world_size=world, framework="fsdp2", parallelism={},
                      skeleton=Node.container("dict", ()), tensors=tensors, objects={}, per_rank={},
                      index_files=[], data_files=files, index=built.directory)
    root = tmp_path_factory.mktemp("scale") / "ck"
    (root / "index" / md.save_id).mkdir(parents=True)
    (root / built.directory.file).write_bytes(b"".join(built.blobs))
    (root / "metadata.json").write_bytes(md.to_bytes())
    md = fmt.Metadata.from_bytes((root / "metadata.json").read_bytes(), str(root))
    return md, open_storage(str(root)), sum(len(b) for b in batches)


@pytest.mark.parametrize("loading_world", [4096, 1000, 1])
def test_every_rank_gets_exactly_its_chunks_from_a_small_part_of_the_index(fsdp_checkpoint, loading_world: int) -> None:
    md, storage, total_rows = fsdp_checkpoint
    assert md.index is not None and md.index.segments > 1
    ranks = sorted({0, 1, loading_world // 3, loading_world // 2, loading_world - 1})
    for rank in ranks:
        targets = [(fqn, sim.row_box(shape, loading_world, rank) if sharded else full_region(shape))
                   for fqn, shape, sharded in sim.fsdp_tensors(SMALL, True)]
        targets = [t for t in targets if t[1].numel]
        wanted: dict[str, list[Region]] = defaultdict(list)
        for fqn, box in targets:
            wanted[fqn].append(box)
        segments = index_read.wanted_segments(md, wanted)
        chunks = index_read.read_segments(storage, md, segments, fqns=set(wanted))
        reqs = plan_load(targets, chunks, itemsizes={f: 4 for f in wanted})  # raises unless covered exactly
        need = sum(box.numel * 4 for _, box in targets)
        assert sum(r.box.numel * 4 for r in reqs) == need  # every needed element once
        assert sum(r.nbytes for r in reqs) == need  # row shards: no byte read twice or in vain
        if loading_world > 1:
            assert md.index.segments and len(segments) <= 8 + len(md.index.wide["first"])
            assert len(chunks) < total_rows / 20


def test_a_rank_with_nothing_to_load_reads_nothing(fsdp_checkpoint) -> None:
    md, storage, _ = fsdp_checkpoint
    assert index_read.wanted_segments(md, {}) == []
    assert index_read.read_segments(storage, md, []) == []


def test_zero_redundancy_assignment_alone_equals_the_gathered_one() -> None:
    mine = sorted((f"t{i}", full_region((1000 + 37 * i, 1024))) for i in range(12))
    sizes = {f: 4 for f, _ in mine}
    for world in (2, 7, 64):
        assert assign_shared(mine, world, sizes) == plan_shared_reads([mine] * world, sizes)
    out = assign_shared(mine, 4096, sizes)
    got: dict[str, list[Region]] = defaultdict(list)
    for pieces in out:
        for fqn, _, piece in pieces:
            got[fqn].append(piece)
    assert_tiles(got, {f: b.lengths for f, b in mine})
