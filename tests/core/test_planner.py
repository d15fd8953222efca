"""The planner as pure functions, for thousands of simulated ranks in one process."""

from __future__ import annotations

import math
import time
from collections import defaultdict

import pytest

from bytecp.errors import ConfigError, CorruptCheckpointError
from bytecp.format.metadata import ChunkRecord
from bytecp.plan.load_plan import plan_load
from bytecp.plan.planner import (
    MIN_PIECE_BYTES,
    LocalSavePlan,
    WriteItem,
    check_replicas,
    find_overlap,
    plan_save,
    plan_shared_reads,
)
from bytecp.tree.regions import Region, full_region


def item(fqn: str, shape: tuple[int, ...], box: Region, size: int = 4) -> WriteItem:
    return WriteItem(fqn, box, "float32", size, shape)


def rows(shape: tuple[int, ...], parts: int, i: int) -> Region:
    """Row shard ``i`` of ``parts`` (torch.chunk sizes, possibly empty)."""
    step = -(-shape[0] // parts)
    lo = min(i * step, shape[0])
    hi = min(lo + step, shape[0])
    return Region((lo, *[0] * (len(shape) - 1)), (hi - lo, *shape[1:]))


def assert_tiles(written: dict[str, list[Region]], shapes: dict[str, tuple[int, ...]]) -> None:
    """Every tensor written exactly once: boxes disjoint, covering every element."""
    for fqn, shape in shapes.items():
        boxes = written[fqn]
        assert sum(b.numel for b in boxes) == math.prod(shape), fqn
        assert find_overlap(boxes) is None, fqn


SHAPES = {f"layers.{i}.w": (1024 + 7 * i, 513) for i in range(24)} | {"embed": (50257, 64), "norm": (7,)}
#: a GPT-like model of about 3 GB: each rank's share is far above the planner's
#: piece sizes, as in the DDP target (every rank within 10% of 1/W)
BIG = {f"layers.{i}.w": (8192 + 7 * i, 4096) for i in range(24)} | {"embed": (50257, 1024), "norm": (1024,)}


def test_ddp_4096_ranks_write_each_tensor_once_and_evenly() -> None:
    world = 4096
    shapes = {"big": (8192, 4096), "mid": (4096, 1024), "small": (3, 5)}
    plans = [
        LocalSavePlan(r, tuple(item(f, s, full_region(s)) for f, s in shapes.items())) for r in range(world)
    ]
    t0 = time.perf_counter()
    out = plan_save(plans)
    assert time.perf_counter() - t0 < 60
    written: dict[str, list[Region]] = defaultdict(list)
    for items in out:
        for it in items:
            written[it.fqn].append(it.region)
    assert_tiles(written, shapes)
    # large replicated tensors are split, never below the minimum piece size
    assert len(written["big"]) == (8192 * 4096 * 4) // MIN_PIECE_BYTES
    assert all(b.numel * 4 >= MIN_PIECE_BYTES for b in written["big"])
    assert len(written["small"]) == 1


def test_ddp_ranks_write_within_ten_percent_of_one_over_w() -> None:
    for world in (2, 3, 8, 64):
        plans = [
            LocalSavePlan(r, tuple(item(f, s, full_region(s)) for f, s in BIG.items())) for r in range(world)
        ]
        out = plan_save(plans)
        per_rank = [sum(it.nbytes for it in items) for items in out]
        total = sum(math.prod(s) * 4 for s in BIG.values())
        assert sum(per_rank) == total
        assert max(abs(b - total / world) for b in per_rank) <= 0.1 * total / world, (world, per_rank)


def test_fsdp_4096_ranks_each_write_their_own_shards() -> None:
    world = 4096
    plans = [
        LocalSavePlan(r, tuple(item(f, s, rows(s, world, r)) for f, s in SHAPES.items())) for r in range(world)
    ]
    out = plan_save(plans)
    written: dict[str, list[Region]] = defaultdict(list)
    for r, items in enumerate(out):
        for it in items:
            assert it.region == rows(it.global_shape, world, r)  # nothing moves between ranks
            written[it.fqn].append(it.region)
    assert_tiles(written, SHAPES)


def test_hsdp_replicas_write_once_spread_over_the_replica_group() -> None:
    world, shard = 4096, 64  # 64 replica groups of 64-way sharding
    plans = [
        LocalSavePlan(r, tuple(item(f, s, rows(s, shard, r % shard)) for f, s in SHAPES.items()))
        for r in range(world)
    ]
    out = plan_save(plans)
    written: dict[str, list[Region]] = defaultdict(list)
    writers = set()
    for r, items in enumerate(out):
        for it in items:
            written[it.fqn].append(it.region)
            writers.add(r)
    assert_tiles(written, SHAPES)
    assert len(writers) > shard  # replicas share the writing, not only the first group


def test_reshard_load_plans_read_only_what_each_target_needs() -> None:
    shape = (1000, 300)
    for saved_world, load_world in ((8, 4), (4, 3), (3, 8), (4096, 7)):
        chunks = [
            ChunkRecord("w", "float32", shape, b.offsets, b.lengths, f"data/s/{r}-0.bin", 0, b.numel * 4, 0)
            for r in range(saved_world)
            if (b := rows(shape, saved_world, r)).numel
        ]
        for r in range(load_world):
            box = rows(shape, load_world, r)
            reqs = plan_load([("w", box)], chunks, itemsizes={"w": 4})
            covered = sorted((q.box for q in reqs), key=lambda b: b.offsets)
            assert sum(b.numel for b in covered) == box.numel and find_overlap(covered) is None
            # row shards are contiguous in their chunks: every byte read is needed
            assert sum(q.nbytes for q in reqs) == box.numel * 4


def test_chunks_that_overlap_beside_a_gap_are_refused_though_their_counts_add_up() -> None:
    """A crafted (or damaged) index: rows [0:4] and [2:6] of an 8-row tensor, 64
    elements as the tensor's: a load filled rows 2..3 twice and left rows 6..7
    as they were, without a word; now refused, naming the two regions."""
    shape = (8, 8)
    chunks = [ChunkRecord("w", "float32", shape, (0, 0), (4, 8), "data/s/0-0.bin", 0, 128, 0),
              ChunkRecord("w", "float32", shape, (2, 0), (4, 8), "data/s/0-0.bin", 0, 128, 0)]
    with pytest.raises(CorruptCheckpointError, match=r"'w': the checkpoint's chunks overlap: \[0:4, 0:8\] and "
                                                     r"\[2:6, 0:8\] of target region \[0:8, 0:8\]"):
        plan_load([("w", Region((0, 0), shape))], chunks, itemsizes={"w": 4})
    # a target that meets only the parts that do not overlap plans as ever
    assert plan_load([("w", Region((0, 0), (2, 8)))], chunks, itemsizes={"w": 4})


def test_column_targets_read_spans_or_rows_not_whole_chunks() -> None:
    shape = (64, 1 << 16)  # 256 KiB rows
    chunks = [ChunkRecord("w", "float32", shape, (0, 0), shape, "data/s/0-0.bin", 0, math.prod(shape) * 4, 0)]
    box = Region((0, 0), (64, 1 << 10))  # a narrow column slice
    reqs = plan_load([("w", box)], chunks, itemsizes={"w": 4})
    read = sum(q.nbytes for q in reqs)
    assert read == box.numel * 4  # split row by row: the 252 KiB gaps are never read
    assert len(reqs) == 64


def test_shared_reads_split_every_common_box_once_across_ranks() -> None:
    world = 64
    full = {f: full_region(s) for f, s in BIG.items()}
    specs = [[(f, b) for f, b in full.items()] for _ in range(world)]
    plan = plan_shared_reads(specs, {f: 4 for f in BIG})
    pieces: dict[str, list[Region]] = defaultdict(list)
    for per in plan:
        for fqn, box, piece in per:
            assert box.contains(piece)
            assert piece.numel * 4 >= MIN_PIECE_BYTES or piece == box
            pieces[fqn].append(piece)
    assert_tiles(pieces, BIG)
    loads = [sum(p.numel * 4 for _, _, p in per) for per in plan]
    total = sum(loads)
    assert max(abs(x - total / world) for x in loads) <= 0.1 * total / world  # each reads ~1/W


def test_fixed_pieces_stay_and_the_other_holders_get_the_rest() -> None:
    # rank 0 copied only its earlier share of "big" (an eager snapshot); rank 1
    # and 2 hold all of it: rank 0 writes exactly its piece, the rest is split
    shape = (4096, 1024)
    mine = Region((0, 0), (1365, 1024))
    plans = [
        LocalSavePlan(0, (item("big", shape, mine),), fixed=True),
        LocalSavePlan(1, (item("big", shape, full_region(shape)), item("small", (7,), full_region((7,))))),
        LocalSavePlan(2, (item("big", shape, full_region(shape)), item("small", (7,), full_region((7,))))),
    ]
    out = plan_save(plans, check_coverage=False)
    assert [it.region for it in out[0]] == [mine]
    written = defaultdict(list)
    for items in out:
        for it in items:
            written[it.fqn].append(it.region)
    assert_tiles(written, {"big": shape, "small": (7,)})
    assert {it.fqn for it in out[1]} | {it.fqn for it in out[2]} == {"big", "small"}


def test_tiling_error_agrees_with_counting_every_element() -> None:
    """Random sets of boxes (row slabs, flat-range pieces, column blocks,
    empty boxes) in small tensors: the vectorized check finds an overlap or
    a gap exactly when counting each element's owners does."""
    import itertools
    import random

    from bytecp.plan.planner import tiling_error
    from bytecp.tree.regions import flat_range_to_boxes

    rng = random.Random(7)
    for case in range(600):
        shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(0, 3)))
        total = math.prod(shape)
        kind = case % 3
        if kind == 0 and shape:  # slabs along dim 0, perhaps overlapping
            cuts = sorted(rng.randint(0, shape[0]) for _ in range(rng.randint(1, 3)))
            edges = [0, *cuts, shape[0]]
            boxes = [Region((a, *[0] * (len(shape) - 1)), (b - a, *shape[1:])) for a, b in zip(edges, edges[1:], strict=False)]
        elif kind == 1:  # flat-range pieces
            cuts = sorted(rng.randint(0, total) for _ in range(rng.randint(1, 3)))
            edges = [0, *cuts, total]
            boxes = [bx for a, b in zip(edges, edges[1:], strict=False) for bx in flat_range_to_boxes(shape, a, b)]
        else:  # arbitrary boxes
            boxes = []
            for _ in range(rng.randint(1, 4)):
                offs = tuple(rng.randint(0, n - 1) for n in shape)
                boxes.append(Region(offs, tuple(rng.randint(0, n - o) for o, n in zip(offs, shape, strict=True))))
        if rng.random() < 0.3 and boxes:  # a box twice, shifted, or dropped
            b = rng.choice(boxes)
            boxes.append(Region(b.offsets, tuple(max(0, n - rng.randint(0, 1)) for n in b.lengths)))
        boxes = list(dict.fromkeys(boxes))  # the planner passes distinct boxes
        owners: dict[tuple[int, ...], int] = defaultdict(int)
        for b in boxes:
            for idx in itertools.product(*(range(o, o + n) for o, n in zip(b.offsets, b.lengths, strict=True))):
                owners[idx] += 1
        exact = len(owners) == total and all(v == 1 for v in owners.values())
        error = tiling_error(shape, boxes)
        assert (error is None) == exact, (shape, boxes, error)
        if sum(owners.values()) >= total and any(v > 1 for v in owners.values()):
            assert error is not None and "overlap" in error, (shape, boxes, error)


def test_fixed_shares_that_overlap_are_written_once() -> None:
    """Fixed plans (an async snapshot copied only a cached share) from
    different earlier plans: the lowest rank keeps the overlapping rows, the
    other writes the rest of its share, a free holder nothing more."""
    shape = (10, 4)
    part = lambda o, n: item("w", shape, Region((o, 0), (n, 4)))  # noqa: E731
    plans = [LocalSavePlan(0, (part(0, 6),), fixed=True), LocalSavePlan(1, (part(4, 6),), fixed=True),
             LocalSavePlan(2, (item("w", shape, full_region(shape)),))]
    out = plan_save(plans, check_coverage=False)
    rows = sorted((it.region.offsets[0], it.region.lengths[0], r) for r, items in enumerate(out) for it in items)
    assert rows == [(0, 6, 0), (6, 4, 1)]


def test_plan_cache_latest_is_the_last_committed_plan_only() -> None:
    from bytecp.plan.exchange import PlanCache

    cache, w = PlanCache(), [item("w", (4,), full_region((4,)))]
    cache.put("k", "fp-a", "d1", w)
    cache.put("k", "fp-b", "d2", [])
    assert cache.get("k", "fp-a") == ("d1", w) and cache.latest("k", "fp-a") is None
    assert cache.latest("k", "fp-b") == ("d2", [])
    cache.touch("k", "fp-a")  # a commit that reused fp-a's entry
    assert cache.latest("k", "fp-a") == ("d1", w) and cache.latest("k", "fp-b") is None
    cache.forget("k")  # a failed save
    assert cache.latest("k", "fp-a") is None and cache.get("k", "fp-a") == ("d1", w)


def test_replicas_that_differ_are_named_with_the_ranks_on_each_side() -> None:
    box = Region((0, 0), (64, 8))
    same = {("model.embed", box): 11}
    check_replicas([same, dict(same), None])  # a rank holding nothing is no replica
    with pytest.raises(ConfigError) as e:
        check_replicas([same, {("model.embed", box): 12}, dict(same)])
    assert "'model.embed'" in str(e.value) and "ranks [0, 2] vs [1]" in str(e.value)

