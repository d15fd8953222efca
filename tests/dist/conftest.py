"""Session-scoped worker pools, one per world size, shared by every distributed test."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from .pool import WorkerError, WorkerPool

_pools: dict[int, WorkerPool] = {}


def get_pool(world_size: int) -> WorkerPool:
    pool = _pools.get(world_size)
    if pool is None or not pool.alive:
        if pool is not None:
            pool.close(kill=True)
        pool = WorkerPool(world_size)
        _pools[world_size] = pool
    return pool


def discard_pool(world_size: int) -> None:
    """After a test that leaves its pool's process group out of step (a load
    abandoned at its deadline: the guide says to restart the job), the next
    test gets fresh ranks."""
    pool = _pools.pop(world_size, None)
    if pool is not None:
        pool.close(kill=True)


@pytest.fixture(scope="session")
def pools() -> Iterator[Callable[[int], WorkerPool]]:
    yield get_pool
    for p in _pools.values():
        p.close()
    _pools.clear()


__all__ = ["WorkerError", "get_pool", "discard_pool"]
