"""(run on the 2-rank pool by test_plan_hints.py) Adapters whose replica
hints are wrong or missing: every rank holds the whole of each tensor, but
the adapter calls each rank's copy its own, or gives no hint."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from bytecp.adapters.plain import PlainAdapter

import bytecp
from bytecp import adapter_api
from bytecp.tree.state import ReplicaSet, TensorLeaf

from .adapter_cases import plain_state


class SelfishAdapter(PlainAdapter):
    """Calls every rank's copy of a replicated tensor the rank's own."""

    name = "selfish"

    def tensor_leaf(self, t: torch.Tensor) -> Any:
        return TensorLeaf.full(t, ReplicaSet.of((dist.get_rank(),)))


class HalfHintAdapter(PlainAdapter):
    """Matrices called each rank's own, vectors without a hint."""

    name = "halfhint"

    def tensor_leaf(self, t: torch.Tensor) -> Any:
        return TensorLeaf.full(t, ReplicaSet.of((dist.get_rank(),)) if t.ndim == 2 else None)


def save_then_load(framework: str, url: str) -> dict[str, Any]:
    """(every rank) Save the plain state through ``framework``, load it into
    another one; whether every tensor came back bitwise, and whether the
    coordinator planned the save."""
    from bytecp.plan.exchange import PLAN_STATS

    adapter_api.register_adapter("selfish", SelfishAdapter, before=None)
    adapter_api.register_adapter("halfhint", HalfHintAdapter, before=None)
    state = plain_state(3)
    before = PLAN_STATS.coordinated
    bytecp.save(url, state, framework=framework)
    coordinated = PLAN_STATS.coordinated - before
    other = plain_state(9)
    bytecp.load(url, other, framework=framework)
    same = all(torch.equal(a, b) for a, b in zip(state["model"].state_dict().values(),
                                                   other["model"].state_dict().values(), strict=True))
    for p, q in zip(state["model"].parameters(), other["model"].parameters(), strict=True):
        sa, sb = state["optimizer"].state[p], other["optimizer"].state[q]
        same = same and all(torch.equal(sa[k], sb[k]) for k in sa)
    return {"same": same, "coordinated": coordinated}


class AllReplicasAdapter(PlainAdapter):
    """Every tensor whole on every rank, hinted as one replica set of all ranks (as DDP)."""

    name = "allreplicas"

    def tensor_leaf(self, t: torch.Tensor) -> Any:
        return TensorLeaf.full(t, ReplicaSet.of(tuple(range(dist.get_world_size()))))


def large_set_save_then_load(url: str) -> dict[str, Any]:
    """(every rank) Save 24 tensors (~24 MB) that every rank holds, hinted as
    one replica set: large enough that each rank writes one contiguous run
    (bytecp/plan/runs.py); load them into another model. Whether they came
    back bitwise, whether the set was planned as runs, and the coordinator's count."""
    from bytecp.plan.exchange import PLAN_STATS
    from bytecp.plan.planner import MIN_PIECE_BYTES
    from bytecp.plan.runs import uses_runs

    adapter_api.register_adapter("allreplicas", AllReplicasAdapter, before=None)

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(*(torch.nn.Linear(1024, 509 + i) for i in range(12)))

    state = {"model": model(3)}
    sizes = [t.numel() * t.element_size() for t in state["model"].state_dict().values()]
    runs = uses_runs([type("Box", (), {"nbytes": n})() for n in sizes],  # type: ignore[misc]
                     dist.get_world_size(), 4 << 20, MIN_PIECE_BYTES)
    before = PLAN_STATS.coordinated
    bytecp.save(url, state, framework="allreplicas")
    coordinated = PLAN_STATS.coordinated - before
    other = {"model": model(9)}
    bytecp.load(url, other, framework="allreplicas")
    same = all(torch.equal(a, b) for a, b in zip(state["model"].state_dict().values(),
                                                   other["model"].state_dict().values(), strict=True))
    return {"same": same, "runs": runs, "coordinated": coordinated}
