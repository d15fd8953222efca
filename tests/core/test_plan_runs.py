"""A large replica set's plan gives each holder one contiguous run of the
set's boxes in (tensor, region) order (bytecp/plan/runs.py): every element
of every box written exactly once, no empty piece, each holder's bytes within
one grain (one of the pieces the largest-first rule cuts its box into) of its water-level target, each member's share computed
alone (share.share_of) equal to its entry in the whole plan
(planner.plan_replicated), and the same answer whatever the order of the
boxes given."""

from __future__ import annotations

import random
from fractions import Fraction

import numpy as np
import pytest

from bytecp.plan.planner import MIN_PIECE_BYTES, WriteItem, plan_replicated
from bytecp.plan.runs import RUN_MIN_BOXES, uses_runs
from bytecp.plan.share import share_of
from bytecp.tree.regions import Region


def large_set(rng: random.Random) -> list[WriteItem]:
    """Boxes of 1-d to 3-d tensors (some with leading dims of 1, a few empty
    or scalar), of a few MB each, some tensors held as several boxes."""
    items: list[WriteItem] = []
    for i in range(rng.randint(RUN_MIN_BOXES, 60)):
        kind = rng.random()
        if kind < 0.05:
            shape: tuple[int, ...] = ()
        elif kind < 0.1:
            shape = (0, 5)
        elif kind < 0.3:
            shape = (1, rng.randint(1, 4), rng.randint(1, 1 << 20))
        else:
            shape = (rng.randint(1, 4000), rng.randint(1, 3000))
        size = rng.choice([1, 2, 4])
        name = f"layer{i % 17}.w{rng.randint(0, 3)}.{i}"
        if len(shape) == 2 and shape[0] > 4 and rng.random() < 0.3:  # two boxes of one tensor
            cut = rng.randint(1, shape[0] - 1)
            items.append(WriteItem(name, Region((0, 0), (cut, shape[1])), "x", size, shape))
            items.append(WriteItem(name, Region((cut, 0), (shape[0] - cut, shape[1])), "x", size, shape))
        else:
            items.append(WriteItem(name, Region((0,) * len(shape), shape), "x", size, shape))
    return items


def grains(it: WriteItem, holders: int, split: int = 4 << 20) -> tuple[int, int, set[int]]:
    """(dimension, bytes of the widest grain, the grains' row bounds) of a box: the
    pieces the largest-first rule cuts it into, which the runs never cut finer."""
    for d, n in enumerate(it.region.lengths):
        if n > 1:
            k = min(n, holders, max(1, it.nbytes // MIN_PIECE_BYTES)) if it.nbytes >= split else 1
            return d, -(-n // k) * (it.nbytes // n), {n * i // k for i in range(k + 1)}
    return -1, it.nbytes, {0, 1}


def check_cover(items: list[WriteItem], plan: dict[int, list[WriteItem]]) -> None:
    """Every element of every box exactly once, no piece empty unless its box is."""
    by_box: dict[tuple[str, Region], int] = {}
    for it in items:
        by_box[(it.fqn, it.region)] = 0
    for pieces in plan.values():
        for p in pieces:
            box = next(k for k in by_box if k[0] == p.fqn and k[1].contains(p.region))
            assert p.region.numel > 0 or box[1].numel == 0
            by_box[box] += p.region.numel if box[1].numel else 1
    for (fqn, region), got in by_box.items():
        assert got == (region.numel or 1), (fqn, region)
    # pieces of one box are disjoint: their element counts add up and each lies in the box
    for pieces in plan.values():
        for a in range(len(pieces)):
            for b in range(a + 1, len(pieces)):
                if pieces[a].fqn == pieces[b].fqn:
                    assert pieces[a].region.intersect(pieces[b].region) is None


@pytest.mark.parametrize("seed", range(40))
def test_runs_cover_balance_and_equal_the_share_alone(seed: int) -> None:
    rng = random.Random(seed)
    world = rng.choice([2, 3, 8, 33, 100])
    ranks = tuple(sorted(rng.sample(range(world), rng.randint(2, world))))
    items = large_set(rng)
    total = sum(it.nbytes for it in items)
    if total // len(ranks) < 4 << 20:  # make it large: repeat the biggest box under new names
        big = max(items, key=lambda w: w.nbytes)
        items += [WriteItem(f"zz{i}", big.region, big.dtype, big.itemsize, big.global_shape)
                  for i in range((4 << 20) * len(ranks) // max(1, big.nbytes) + 1)]
        total = sum(it.nbytes for it in items)
    base = [rng.choice([0, 0, 1 << 20, rng.randint(0, 3 * total // len(ranks))]) for _ in range(world)]
    assert uses_runs(items, len(ranks), 4 << 20, MIN_PIECE_BYTES)
    whole = plan_replicated(items, ranks, base, split_bytes=4 << 20)
    check_cover(items, whole)
    for r in range(world):
        assert share_of(items, ranks, base, r, split_bytes=4 << 20) == whole.get(r, []), (seed, r)
        assert share_of(items, ranks, np.asarray(base, dtype=np.int64), r, split_bytes=4 << 20) == whole.get(r, [])
    # the water level over the starting loads, and each holder within one grain of its target (half a grain at either end)
    bases = sorted(base[r] for r in ranks)
    m = max(j + 1 for j in range(len(bases)) if bases[j] * (j + 1) < total + sum(bases[: j + 1]))
    level = Fraction(total + sum(bases[:m]), m)
    widest = max(grains(it, len(ranks))[1] for it in items)
    boxes = {(it.fqn, it.region): it for it in items}
    for pieces in whole.values():  # every piece a run of whole grains of its box
        for p in pieces:
            it = next(w for (f, reg), w in boxes.items() if f == p.fqn and reg.contains(p.region))
            d, _, bounds = grains(it, len(ranks))
            if p.region != it.region:
                a = p.region.offsets[d] - it.region.offsets[d]
                assert a in bounds and a + p.region.lengths[d] in bounds, (seed, p, it)
    for r in ranks:
        got = sum(p.nbytes for p in whole.get(r, []))
        assert abs(got - max(Fraction(0), level - base[r])) <= widest + 1, (seed, r)
    # determinism: the same plan from the boxes in any order
    shuffled = items[:]
    rng.shuffle(shuffled)
    assert plan_replicated(shuffled, ranks, base, split_bytes=4 << 20) == whole


def test_each_holder_gets_one_contiguous_run() -> None:
    """700 expert boxes over 64 holders from level loads: every holder's boxes
    are consecutive in name order (a partial box at most at each end)."""
    items = [WriteItem(f"layers.{i // 12:02d}.experts.{i % 12:02d}.w", Region((0, 0), (2048, 1024)), "bf16", 2,
                       (2048, 1024)) for i in range(700)]
    ranks = tuple(range(64))
    whole = plan_replicated(items, ranks, [0] * 64)
    order = sorted((it.fqn, it.region) for it in items)
    index = {k[0]: n for n, k in enumerate(order)}
    pieces = 0
    for r in ranks:
        mine = whole[r]
        names = [index[p.fqn] for p in mine]
        assert names == list(range(names[0], names[0] + len(names)))
        assert all(p.region.lengths[0] == 2048 for p in mine[1:-1])
        assert abs(sum(p.nbytes for p in mine) - 700 * 2048 * 1024 * 2 // 64) <= 1 << 20  # a grain: 512 rows
        pieces += len(mine)
    assert pieces <= 700 + 63


def test_small_sets_keep_the_largest_first_rule() -> None:
    few = [WriteItem(f"t{i}", Region((0,), (8 << 20,)), "u8", 1, (8 << 20,)) for i in range(RUN_MIN_BOXES - 1)]
    assert not uses_runs(few, 4, 4 << 20, MIN_PIECE_BYTES)
    small = [WriteItem(f"t{i}", Region((0,), (1 << 10,)), "u8", 1, (1 << 10,)) for i in range(100)]
    assert not uses_runs(small, 2, 4 << 20, MIN_PIECE_BYTES)
    assert not uses_runs(few * 3, 1, 1, MIN_PIECE_BYTES)
    # today's rule: every box of at least split_bytes cut into one piece per holder
    whole = plan_replicated(few, (0, 1, 2, 3), [0] * 4)
    assert sorted(whole) == [0, 1, 2, 3] and all(len(v) == len(few) for v in whole.values())


def test_holders_above_the_level_write_nothing() -> None:
    items = [WriteItem(f"t{i:02d}", Region((0, 0), (1024, 1024)), "u8", 1, (1024, 1024)) for i in range(16)]
    base = [0, 100 << 20, 0, 0]
    whole = plan_replicated(items, (0, 1, 2, 3), base)
    assert 1 not in whole
    for r in (0, 2, 3):
        assert abs(sum(p.nbytes for p in whole[r]) - (16 << 20) // 3) <= 1 << 20  # boxes under split_bytes: uncut, a grain each
    for r in range(4):
        assert share_of(items, (0, 1, 2, 3), base, r, split_bytes=4 << 20) == whole.get(r, [])
