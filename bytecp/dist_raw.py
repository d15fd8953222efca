"""The raw ``torch.distributed`` calls under :class:`bytecp.dist.DistContext`.

Every collective bytecp issues (its own and those of
:mod:`bytecp.preemption`) is started with ``async_op=True`` and finished by
:func:`finish`, which waits for its works and then *keeps* them until the
next collective on the same group; the works of a group's last collective
stay until the interpreter clears this module.

Why (an abort at exit, SIGABRT, *terminate called without an active
exception*): with gloo, the worker thread that ran a collective drops its
reference to the work just after marking it complete. When that reference
is the last one, destroying the work releases its tensors, and releasing a
tensor that has a Python object takes the GIL. The caller woke up at the
completion and still holds the GIL; a script that returns within the GIL's
switch interval (5 ms) -- ``bytecp.load(...)``, ``destroy_process_group()``,
end -- starts finalizing first, and CPython ends a thread that asks for the
GIL after that with ``pthread_exit``, whose unwinding through the worker's
``noexcept`` frames calls ``std::terminate``. A work kept here is never
destroyed on a gloo thread: its last reference goes on the caller's thread
(at the next collective, or while the interpreter finalizes, GIL held).
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["finish", "all_gather_bytes", "broadcast_bytes", "to_bytes", "from_bytes"]

#: the works of the latest collective on each group (``id`` of the group; 0: the default group)
_kept: dict[int, list[Any]] = {}
_kept_lock = threading.Lock()


def finish(group: Any, works: Sequence[Any]) -> None:
    """(the thread that started ``works``) Wait for them, then keep them in
    place of the group's previous collective's works (see the module docstring)."""
    for w in works:
        w.wait()
    with _kept_lock:
        _kept[0 if group is None else id(group)] = list(works)


def to_bytes(obj: Any) -> torch.Tensor:
    """``obj`` pickled, as a CPU ``uint8`` tensor."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def from_bytes(buf: torch.Tensor | None) -> Any:
    """The object :func:`to_bytes` made (``None`` for no buffer)."""
    # payloads come from this job's own ranks (as with torch.distributed's object collectives)
    return None if buf is None else pickle.loads(buf.cpu().numpy().tobytes())


def all_gather_bytes(data: torch.Tensor, group: Any, world_size: int, device: torch.device) -> list[torch.Tensor]:
    """(every rank of ``group``) Every rank's ``data`` (CPU ``uint8``), in
    group rank order: the sizes, then the payloads padded to the largest."""
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world_size)]
    finish(group, [dist.all_gather(sizes, size, group=group, async_op=True)])
    lengths = [int(s.item()) for s in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data.to(device)
    outs = [torch.empty_like(padded) for _ in range(world_size)]
    finish(group, [dist.all_gather(outs, padded, group=group, async_op=True)])
    return [o[:n].cpu() for o, n in zip(outs, lengths, strict=True)]


def broadcast_bytes(data: torch.Tensor | None, src: int, group: Any, device: torch.device) -> torch.Tensor:
    """(every rank of ``group``) Global rank ``src``'s ``data`` (CPU
    ``uint8``; ``None`` on the other ranks): the size, then the payload."""
    size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64, device=device)
    finish(group, [dist.broadcast(size, src=src, group=group, async_op=True)])
    buf = data.to(device) if data is not None else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    if buf.numel():
        finish(group, [dist.broadcast(buf, src=src, group=group, async_op=True)])
    return buf.cpu()
