"""One rank's share of a replica set computed alone (bytecp/plan/share.py)
equals its entry in the set's whole plan (planner.plan_replicated) on
varied sets: boxes above and below the split size, boxes that cannot be
split, starting loads with ties, sets of one rank, ranks outside the set;
and at simulated scale (the MoE job's expert sets)."""

from __future__ import annotations

import random

import pytest

from benchmarks import scale_jobs as jobs
from bytecp.plan.exchange import decide, local_plan, planned_locally
from bytecp.plan.planner import WriteItem, plan_replicated
from bytecp.plan.share import share_of
from bytecp.tree.regions import Region


def random_items(rng: random.Random) -> list[WriteItem]:
    items = []
    for i in range(rng.randint(0, 40)):
        shape = rng.choice([(), (1,), (1, 1, 7), (rng.randint(1, 3000), rng.randint(1, 700)),
                            (rng.randint(1, 64), 1, rng.randint(1, 4096)), (0, 5)])
        rows = shape[0] if shape else 0
        a = rng.randint(0, rows // 2) if rows else 0
        region = Region(((a,) + (0,) * (len(shape) - 1)) if shape else (),
                        ((rows - a,) + shape[1:]) if shape else ())
        size = rng.choice([1, 2, 4, 8])
        items.append(WriteItem(f"t{i % 13}.{rng.randint(0, 3)}", region, "x", size, shape))
    return list({(it.fqn, it.region): it for it in items}.values())


@pytest.mark.parametrize("seed", range(80))
def test_the_share_alone_equals_the_whole_plans_entry(seed: int) -> None:
    rng = random.Random(seed)
    world = rng.choice([1, 2, 3, 8, 33, 200])
    ranks = tuple(sorted(rng.sample(range(world), rng.randint(1, world))))
    base = [rng.choice([0, 0, 1 << 20, rng.randint(0, 1 << 24)]) for _ in range(world)]
    items = random_items(rng)
    split = rng.choice([1, 1 << 16, 1 << 20, 4 << 20])
    whole = plan_replicated(items, ranks, base, split_bytes=split)
    for r in range(world):
        assert share_of(items, ranks, base, r, split_bytes=split) == whole.get(r, []), (seed, r)


def test_moe_expert_shares_equal_the_whole_plans_at_4096_ranks() -> None:
    job = jobs.moe_job(4096)
    decision = decide(jobs.votes(job))
    shared: dict = {}
    for rank in (0, 63, 64, 2049, 4095):
        plan = local_plan(jobs.rank_tree(job, rank), rank, job.world)
        alone = planned_locally(plan, decision, split_bytes=4 << 20)
        assert alone == planned_locally(plan, decision, split_bytes=4 << 20, shared=shared)
        assert alone
