"""Prewarm: allocate a process's staging memory before its first checkpoint.

(every rank, once at start-up: :func:`bytecp.prewarm`, or the first
``CheckpointManager.maybe_save`` with ``async_save=True``) An asynchronous
save copies the state into the process's reused arena
(:data:`~bytecp.saving.staging.POOL`); allocating and faulting in that arena
is most of what the first save of a process blocks for. Prewarming lays out
the boxes this rank would copy for ``state`` and allocates the arena for
them now, and creates the background saves' process group, so the first
checkpoint blocks like the later ones. Saves to a storage that lends its
own arenas (``keeper://``, see :mod:`bytecp.saving.staging`) copy into
those instead: given that storage's ``url``, prewarm has the host's keeper
ready one of the right size.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import torch

from bytecp.adapter_api import detect_adapter
from bytecp.dist import DistContext
from bytecp.plan.exchange import local_plan
from bytecp.saving.handles import checkpoint_group
from bytecp.saving.staging import POOL, shared_layout_sizes
from bytecp.storage_api import open_storage
from bytecp.tree.state import flatten_tree

__all__ = ["prewarm"]


def prewarm(state: dict[str, Any], *, framework: str | None = None, process_group: Any = None,
            coordinator_rank: int = 0, url: str | None = None,
            storage_options: dict[str, Any] | None = None, arenas: int = 1, io_threads: int = 4) -> float:
    """Allocate the staging arena for ``state`` (every rank); returns the seconds it took.

    Takes no copy and writes nothing. Cheap to call again: an arena already
    large enough is kept. A state that grows later grows the arena then.
    With ``url`` (the storage the saves go to) whose backend lends arenas
    (``keeper://``), ``arenas`` of them are readied there instead (the
    manager asks for one more than the memory checkpoints it keeps: the
    saves then take turns in those, mapped once), for saves with ``io_threads``.
    """
    t0 = time.perf_counter()
    group = checkpoint_group(process_group)  # collective on the first call: every rank calls prewarm
    ctx = DistContext(group, coordinator_rank)
    adapter = detect_adapter(state, framework)
    flat = flatten_tree(adapter.save_tree(state, ctx))
    items = local_plan(flat, ctx.rank, ctx.world_size, ctx.group_ranks).items
    on_device = any(
        s.tensor.device.type == "cuda" for leaf in flat.tensors.values() for s in leaf.shards
    )
    storage = open_storage(url, **(storage_options or {})) if url is not None else None
    if storage is not None and storage.lends_arenas:
        sizes = collections.Counter(shared_layout_sizes(items, io_threads))  # one arena per data file of a save
        for nbytes, files in sorted(sizes.items()):
            storage.prepare_staging(nbytes, arenas * files, pinned=on_device and torch.cuda.is_available())
    else:
        POOL.arena(items, pinned=on_device and torch.cuda.is_available())
    return time.perf_counter() - t0
