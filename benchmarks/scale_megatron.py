"""Scale benchmark, Megatron case: a first save's plan at thousands of
simulated ranks with the replica hints the Megatron adapter derives from
Megatron's process groups (``adapters/megatron/replicas.py``), against the
coordinator's path a job without hints takes (``python -m
benchmarks.scale_megatron``).

A GPT of ``ddp_model`` shapes under TP x PP x DP in Megatron's rank order
(tp fastest, then dp, then pp): TP splits the weight matrices, the
layernorms are replicated over TP. Each rank's tree carries the hints the
adapter gives (a weight: its DP group; a layernorm: its TP x DP group); the
votes are every rank's as :func:`bytecp.plan.exchange.vote_for` makes them,
synthesized per (stage, TP rank) since DP replicas' votes are equal. One
rank's plan (describe, vote, decide from every vote, its share) is timed;
without hints the coordinator instead gathers every rank's boxes, whose
pickled size is reported (and the coordinator's plan over them timed at
the smaller worlds).
"""

from __future__ import annotations

import argparse
import json
import pickle
from typing import Any

import torch

from bytecp.plan.exchange import decide, local_plan, plan_key, planned_locally, vote_for
from bytecp.plan.planner import LocalSavePlan, plan_save
from bytecp.tree.regions import Region
from bytecp.tree.skeleton import Node
from bytecp.tree.state import FlatTree, ReplicaSet, Shard, TensorLeaf

from . import scale_sim as sim
from .scale import measure

__all__ = ["main", "megatron_save_plan"]


def _rank_of(tp_r: int, dp_r: int, pp_r: int, tp: int, dp: int) -> int:
    return tp_r + tp * (dp_r + dp * pp_r)


def rank_tree(model: dict[str, tuple[int, ...]], tp: int, pp: int, dp: int, rank: int, hints: bool) -> FlatTree:
    """One rank's model tensors (zero-strided views) with the adapter's hints."""
    tp_r, pp_r = rank % tp, rank // (tp * dp)
    dp_set = ReplicaSet.of(tuple(_rank_of(tp_r, d, pp_r, tp, dp) for d in range(dp)))
    tpdp_set = ReplicaSet.of(tuple(_rank_of(t, d, pp_r, tp, dp) for t in range(tp) for d in range(dp)))
    names = sorted(model)
    tensors: dict[str, TensorLeaf] = {}
    for i, fqn in enumerate(names):
        if i % pp != pp_r:  # this stage's share of the tensors
            continue
        shape = model[fqn]
        if len(shape) == 2 and shape[0] % tp == 0:
            rows = shape[0] // tp
            box = Region((tp_r * rows, 0), (rows, shape[1]))
            rs = dp_set
        else:
            box = Region((0,) * len(shape), shape)
            rs = tpdp_set
        local = torch.zeros(1).expand(box.lengths)
        tensors[fqn] = TensorLeaf(shape, torch.float32, [Shard(box, local)], rs if hints else None)
    return FlatTree(Node.container("dict", ()), tensors, {}, {}, {})


def megatron_save_plan(tp: int, pp: int, dp: int, repeats: int, coordinator: bool) -> dict[str, Any]:
    model = sim.ddp_model()
    world = tp * pp * dp
    rank = world // 2
    # one vote per (stage, TP rank): DP replicas vote alike
    proto: dict[tuple[int, int], Any] = {}
    for pp_r in range(pp):
        for tp_r in range(tp):
            r = _rank_of(tp_r, 0, pp_r, tp, dp)
            plan = local_plan(rank_tree(model, tp, pp, dp, r, True), r, world)
            proto[(pp_r, tp_r)] = vote_for(plan, plan_key(plan), None, "s", None).encode()
    votes = [proto[(r // (tp * dp), r % tp)] for r in range(world)]
    # each rank's vote crosses the network on its own (all_gather_object)
    payload = [pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL) for v in votes]
    flat = rank_tree(model, tp, pp, dp, rank, True)

    def first() -> Any:
        plan = local_plan(flat, rank, world)
        vote_for(plan, plan_key(plan), None, "s", None)
        d = decide([pickle.loads(b) for b in payload])
        return d, planned_locally(plan, d, split_bytes=4 << 20)

    t, mem, (decision, mine) = measure(first, repeats)
    out: dict[str, Any] = {
        "world": world, "tp": tp, "pp": pp, "dp": dp, "first_save_s": t, "first_save_peak_mb": mem / 1e6,
        "votes_received_bytes": sum(map(len, payload)), "coordinator_gathers_plans": decision.coordinated,
        "boxes_written_by_rank": len(mine),
    }
    # without hints: every rank's boxes go to the coordinator
    plans = [local_plan(rank_tree(model, tp, pp, dp, r, False), r, world) for r in range(world)]
    plans = [LocalSavePlan(p.rank, p.items) for p in plans]
    out["no_hints_gathered_mb"] = sum(len(pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL)) for p in plans) / 1e6
    if coordinator:
        tc, memc, _ = measure(lambda: plan_save(plans, split_bytes=4 << 20), 1)
        out["no_hints_coordinator_s"], out["no_hints_coordinator_peak_mb"] = tc, memc / 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", default="8x4x16,8x4x128", help="TPxPPxDP, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--coordinator-max", type=int, default=4096, help="time the no-hint coordinator plan up to this world")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = []
    for layout in args.layouts.split(","):
        tp, pp, dp = (int(x) for x in layout.split("x"))
        row = megatron_save_plan(tp, pp, dp, args.repeats, tp * pp * dp <= args.coordinator_max)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("| W (TP x PP x DP) | first save plan, hints (rank) | votes received | coordinator gather | "
          "without hints: gathered | without hints: coordinator plan |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        coord = f"{r['no_hints_coordinator_s']:.1f} s, {r['no_hints_coordinator_peak_mb']:.0f} MB" if "no_hints_coordinator_s" in r else "–"
        print(f"| {r['world']} ({r['tp']} x {r['pp']} x {r['dp']}) | {r['first_save_s'] * 1e3:.0f} ms, "
              f"{r['first_save_peak_mb']:.1f} MB | {r['votes_received_bytes'] / 1e6:.2f} MB | "
              f"{'yes' if r['coordinator_gathers_plans'] else 'no'} | {r['no_hints_gathered_mb']:.0f} MB | {coord} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
