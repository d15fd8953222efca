"""Correctness at thousands of simulated ranks, in one process: the save plan
made from replica hints writes every byte exactly once, the version-2 index
version-4 index (every rank's part, the coordinator's directory) gives
every rank exactly the chunks its targets need (every needed byte read
once) while it reads a small part of the index and only the parts its
boxes meet, a rank with nothing to load reads nothing, and the zero-redundancy
assignment computed locally equals the gathered one. Times are the scale
benchmark's business (benchmarks/scale.py), not asserted here."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from benchmarks import scale_jobs as jobs
from benchmarks import scale_load as sl
from benchmarks import scale_sim as sim
from benchmarks.scale_parts import Layout, real_part
from bytecp.format import metadata as fmt
from bytecp.format import parts_read
from bytecp.format.parts_build import build_directory
from bytecp.format.parts_schema import PartsDirectory, buckets_for
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

Checkpoint = tuple[fmt.Metadata, sl.Recording, int]
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


def write_world(root: Path, job: jobs.Job) -> Checkpoint:
    """A version-4 checkpoint of every rank's real part and the directory."""
    buckets = buckets_for(job.world)
    parts = [real_part(job, r, buckets) for r in range(job.world)]
    pages, directory = build_directory([p.entries for p in parts], jobs.SAVE_ID, buckets, job.specs())
    (root / "index" / jobs.SAVE_ID).mkdir(parents=True)
    (root / directory.file).write_bytes(b"".join(pages))
    for r, p in enumerate(parts):
        if p.blobs:
            (root / f"index/{jobs.SAVE_ID}/{r}.bin").write_bytes(b"".join(p.blobs))
    (root / "metadata.json").write_bytes(sl.metadata_for(job, directory, sl.data_files(job)).to_bytes())
    md = fmt.Metadata.from_bytes((root / "metadata.json").read_bytes(), str(root))
    return md, sl.Recording(open_storage(str(root))), sum(sum(p.entries.rows) + len(p.entries.scalars) for p in parts)


@pytest.fixture(scope="module")
def fsdp_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return write_world(tmp_path_factory.mktemp("scale") / "ck", jobs.Job("small", 128, SMALL))


def reader_targets(loading_world: int, rank: int) -> list[tuple[str, Region]]:
    targets = [(fqn, sim.row_box(shape, loading_world, rank) if sharded else full_region(shape))
               for fqn, shape, sharded in sim.fsdp_tensors(SMALL, True)]
    return [t for t in targets if t[1].numel]


def read_exactly(md: fmt.Metadata, storage: sl.Recording, targets: list[tuple[str, Region]]) -> list[fmt.ChunkRecord]:
    storage.read.clear()
    chunks, _ = parts_read.read_parts(storage, md, sl.wanted_of(targets))  # type: ignore[arg-type]
    reqs = plan_load(targets, chunks, itemsizes={f: 4 for f, _ in targets})  # raises unless covered exactly
    need = sum(box.numel * 4 for _, box in targets)
    assert sum(r.box.numel * 4 for r in reqs) == need  # every needed element once
    assert sum(r.nbytes for r in reqs) == need  # row shards: no byte read twice or in vain
    return chunks


@pytest.mark.parametrize("loading_world", [128, 50, 1])
def test_every_rank_gets_exactly_its_chunks_from_a_small_part_of_the_index(fsdp_checkpoint: Checkpoint, loading_world: int) -> None:
    md, storage, total_rows = fsdp_checkpoint
    assert isinstance(md.index, PartsDirectory) and len(md.index.ranks) == 128
    for rank in sorted({0, 1, loading_world // 3, loading_world // 2, loading_world - 1}):
        chunks = read_exactly(md, storage, reader_targets(loading_world, rank))
        if loading_world > 1:  # the parts of its rows (the step values: the directory's scalar page)
            assert len(storage.read) <= 3 * (128 // loading_world + 1) + 4
            assert len(chunks) < total_rows / 5


def test_a_rank_with_nothing_to_load_reads_nothing(fsdp_checkpoint: Checkpoint) -> None:
    md, storage, _ = fsdp_checkpoint
    storage.read.clear()
    assert parts_read.read_parts(storage, md, {}) == ([], 0)  # type: ignore[arg-type]
    assert not storage.read


def test_moe_experts_replicated_over_data_parallel_are_read_whole_from_their_pieces(tmp_path: Path) -> None:
    dense, experts = sim.deepseek_v3(layers=3, dense_layers=1, hidden=64, experts=8, expert_ffn=4096,
                                     dense_ffn=96, vocab=512, heads=2, q_lora=32, kv_lora=16, nope=8, rope=4, v_dim=8)
    job = jobs.Job("small moe", 32, dense, experts, ep=4)
    assert any(len(items) > 1 for items in job.expert_plan(1).values())  # a 1 MiB expert weight split over holders
    md, storage, total_rows = write_world(tmp_path / "ck", job)
    assert job.chunk_count() == total_rows
    for rank in (0, 13, 31):
        read_exactly(md, storage, [t for t in job.targets(rank) if t[1].numel])
        assert storage.read  # its experts' pieces: the wide segments of their holders, named one by one


def test_moe_experts_fsdp_over_data_parallel_tile_once_and_are_laid_out_as_built(tmp_path: Path) -> None:
    # torchtitan's layout: each expert row-sharded over the 32 DP ranks of its EP index (100 rows: 4 a
    # shard, the last 7 ranks of each index hold none), nothing replicated
    dense, experts = sim.deepseek_v3(layers=3, dense_layers=1, hidden=64, experts=8, expert_ffn=100,
                                     dense_ffn=96, vocab=512, heads=2, q_lora=32, kv_lora=16, nope=8, rope=4, v_dim=8)
    job = jobs.Job("small moe, experts fsdp", 128, dense, experts, ep=4, expert_fsdp=True)
    assert not job.expert_plan(0)
    assert {job.shape(f) for f, _ in job.expert_shards(4 * 30 + 1)} == {(64, 100)}  # no row of a 100-row one
    written: dict[str, list[Region]] = defaultdict(list)
    for r in range(job.world):
        for fqn, box in job.chunks(r):
            written[fqn].append(box)
    assert_tiles(written, {f: tuple(s["shape"]) for f, s in job.specs().items()})
    assert sum(map(len, written.values())) == job.chunk_count()
    md, storage, total_rows = write_world(tmp_path / "ck", job)
    assert job.chunk_count() == total_rows
    layout, buckets = Layout(job, buckets_for(job.world)), buckets_for(job.world)
    for r in range(job.world):  # the synthetic entries of the scale benchmark: every rank's, as build_part's
        e, (lo, hi, rows, wide, elements) = real_part(job, r, buckets).entries, layout.segments(r)
        nb = len(e.lo)
        assert (lo, hi, rows, elements + len(e.scalars)) == (e.lo, e.hi, e.rows[:nb], e.elements), r
        assert [n for names, _ in wide for n in names] == e.names and [n for _, n in wide] == e.rows[nb:], r
    for rank in (0, 13, 127):
        read_exactly(md, storage, [t for t in job.targets(rank) if t[1].numel])


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


@pytest.mark.bench
def test_the_scale_benchmarks_commit_and_load_steps_run_on_a_small_moe() -> None:
    """The benchmark's coordinator (the union of 4 EP indices' skeletons and
    tables, built then kept) and its load case run, and the union holds
    every rank's tensors and skeleton as the nodes' merge does."""
    from benchmarks import scale
    from benchmarks.scale_parts import Entries

    dense, experts = sim.deepseek_v3(layers=3, dense_layers=1, hidden=64, experts=8, expert_ffn=100,
                                     dense_ffn=96, vocab=512, heads=2, q_lora=32, kv_lora=16, nope=8, rope=4, v_dim=8)
    job = jobs.Job("small moe", 32, dense, experts, ep=4)
    union = jobs.union(job)
    skeletons = [jobs.described(job, r)[0] for r in range(job.ep)]
    assert union.skeleton.to_json() == skeletons[0].merge_all(skeletons[1:]).to_json()
    assert dict(union.tensors) == job.specs() and union.elements == sum(math.prod(s["shape"])
                                                                          for s in job.specs().values())
    entries = Entries(job, buckets_for(job.world))
    c = scale.coordinator(job, entries, 1)
    assert c["skeletons_sent"] == job.ep - 1 and c["metadata_mb"] > 0 and c["outcome_kb"] > 0
    got = scale.loads(job, entries, 1, 3000)
    assert got["written"] and got["middle"]["rows"] > 0 and got["nothing"]["rows"] == 0
