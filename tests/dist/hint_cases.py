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
