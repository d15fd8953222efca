"""Replica hints for Megatron-Core state, from Megatron's own process groups.

The save plan (``bytecp.plan.exchange``) agrees on who writes what without
gathering every rank's boxes when each tensor says which ranks hold the very
same boxes (:class:`~bytecp.tree.state.ReplicaSet`). Megatron knows: a model
tensor's boxes repeat over its data-parallel group -- the dense one (with
context parallelism: CP ranks hold the same weights) or, for experts, the
expert data-parallel group -- and, when the tensor is not split by tensor
parallelism (layernorms, position embeddings, the router), over the tensor
parallel ranks too. A distributed optimizer's flat ranges belong to one
data-parallel rank each; they repeat only over the tensor-parallel ranks of
a tensor TP does not split.

:func:`hints` is called by the adapter (``adapter.py``, save only, all
ranks, no communication); the hints are verified by the plan exchange, so a
layout they do not describe costs the coordinator's path, never a wrong save.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from bytecp.tree.state import ReplicaSet

__all__ = ["Hints", "hints"]


def _ranks(group: Any) -> tuple[int, ...] | None:
    import torch.distributed as dist

    if group is None:
        return None
    try:
        return tuple(int(r) for r in dist.get_process_group_ranks(group))
    except Exception:  # a group this rank is not in, or no process group at all
        return None


@dataclasses.dataclass(frozen=True)
class Hints:
    """This rank's replica sets, by what a tensor is (None: no hint)."""

    rank: int
    dense_dp: ReplicaSet | None  # data parallel x context parallel
    dense_tp_dp: ReplicaSet | None  # tensor x data x context parallel
    expert_dp: ReplicaSet | None
    expert_tp_dp: ReplicaSet | None
    dense_tp: ReplicaSet | None
    expert_tp: ReplicaSet | None

    def model(self, key: str, local_shape: tuple[int, ...], global_shape: tuple[int, ...], prepend: int) -> ReplicaSet | None:
        """The ranks holding the same boxes of model tensor ``key`` as this rank."""
        split = _tp_split(local_shape, global_shape, prepend)
        if _is_expert(key):
            return self.expert_dp if split else self.expert_tp_dp
        return self.dense_dp if split else self.dense_tp_dp

    def optimizer(self, key: str, local_shape: tuple[int, ...], global_shape: tuple[int, ...], prepend: int) -> ReplicaSet | None:
        """The ranks holding the same flat ranges of the state of model tensor ``key``."""
        if _tp_split(local_shape, global_shape, prepend):
            return ReplicaSet.of((self.rank,))
        return self.expert_tp if _is_expert(key) else self.dense_tp


def _is_expert(key: str) -> bool:
    return ".experts." in key


def _tp_split(local_shape: tuple[int, ...], global_shape: tuple[int, ...], prepend: int) -> bool:
    """Whether the tensor's own axes (past the layer/expert axes) are split."""
    return tuple(local_shape) != tuple(global_shape[prepend:])


def hints() -> Hints | None:
    """(save, all ranks) This rank's hints, or None when Megatron's model
    parallel groups are not initialized."""
    try:
        from megatron.core import parallel_state as ps
    except ImportError:  # pragma: no cover
        return None
    if not ps.model_parallel_is_initialized():
        return None
    import torch.distributed as dist

    def of(getter: str, **kw: Any) -> ReplicaSet | None:
        fn = getattr(ps, getter, None)
        if fn is None:
            return None
        try:
            ranks = _ranks(fn(**kw))
        except (AssertionError, RuntimeError, TypeError):
            return None
        return _set(ranks)

    return _build(of, dist.get_rank())


def _build(of: Any, rank: int) -> Hints:
    expert_dp = of("get_expert_data_parallel_group")
    expert_tp = of("get_expert_tensor_parallel_group")
    expert_tp_dp = _union(expert_dp, expert_tp)
    return Hints(
        rank,
        of("get_data_parallel_group", with_context_parallel=True),
        of("get_tensor_and_data_parallel_group", with_context_parallel=True),
        expert_dp,
        expert_tp_dp,
        of("get_tensor_model_parallel_group"),
        expert_tp,
    )


def _union(a: ReplicaSet | None, b: ReplicaSet | None) -> ReplicaSet | None:
    """The ranks holding an expert tensor expert TP does not split: the
    expert DP group when expert TP is 1, the expert TP group when expert DP
    is 1; None (the coordinator's path) when both exceed 1."""
    if a is None or b is None:
        return None
    if a.size == 1:
        return b
    if b.size == 1:
        return a
    return None  # a grid of expert TP x DP: left to the coordinator


@functools.lru_cache(maxsize=256)
def _set(ranks: tuple[int, ...] | None) -> ReplicaSet | None:
    return ReplicaSet.of(ranks) if ranks else None
