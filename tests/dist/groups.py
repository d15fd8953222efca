"""Process groups a test case makes on a pool's ranks, destroyed before it
makes the next ones.

A pool's ranks live for the whole session (tests/dist/pool.py), and every
gloo group keeps a thread that wakes a hundred times a second, idle or
not: Megatron's ``initialize_model_parallel`` makes 17 groups at every
call and a device mesh several, so a rank that served the Megatron tests
held 600 groups and spent more of its time in their threads than in the
tests (about a tenth of the suite's CPU). The cases that make groups at
every call make them through :func:`renew` (or are :func:`renewing`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")

#: the groups each kind of case made last, on this rank
_made: dict[str, list[object]] = {}


def _groups() -> list[object]:
    return list(dist.distributed_c10d._world.pg_map)


def renew(kind: str, make: Callable[[], T]) -> T:
    """(every rank) Destroy the groups ``make`` made at the last call for
    ``kind`` (nothing may still use them: the case that made them is over),
    then call ``make`` and remember the groups it makes."""
    for group in _made.pop(kind, []):
        if group in dist.distributed_c10d._world.pg_map:
            dist.destroy_process_group(group)
    before = set(map(id, _groups()))
    try:
        return make()
    finally:  # (what a failed make made too)
        _made[kind] = [g for g in _groups() if id(g) not in before and g is not dist.GroupMember.WORLD]


def renewing(kind: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """A case function whose every call is :func:`renew` of ``kind``: the
    groups its last call made are destroyed when it is called again."""
    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def case(*args: Any, **kwargs: Any) -> T:
            return renew(kind, lambda: fn(*args, **kwargs))
        return case
    return wrap
