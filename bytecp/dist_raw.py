"""The raw ``torch.distributed`` calls under :class:`bytecp.dist.DistContext`.

Every collective bytecp issues (its own and those of
:mod:`bytecp.tools.preemption`) is started with ``async_op=True`` and finished by
:func:`finish`, which waits for its works and then *keeps* them: the works
of a group's latest collective stay until its next one, and works replaced
there stay :data:`RETIRE_SECONDS` longer. At interpreter exit
(:func:`_settle`, a threading exit hook) the main thread lets
:data:`SETTLE_SECONDS` pass since the last collective, GIL released, then
waits (at most as long again) until no other thread is runnable, before
finalization begins.

Why (an abort at exit, SIGABRT, *terminate called without an active
exception*): with gloo, the worker thread that ran a collective drops its
reference to the work just after marking it complete. When that reference
is the last one, destroying the work releases its tensors, and releasing a
tensor that has a Python object takes the GIL. The caller woke up at the
completion and holds the GIL; a script that returns within the GIL's switch
interval (5 ms) -- ``bytecp.load(...)``, ``destroy_process_group()``, end
-- starts finalizing first, and CPython ends a thread that asks for the GIL
after that with ``pthread_exit``, whose unwinding through the worker's
``noexcept`` frames calls ``std::terminate``. A work kept here is never
freed on a gloo thread (its worker only drops a reference, without the GIL,
long before this module lets the work go), and a worker that waits for the
GIL for any other collective gets it while :func:`_settle` sleeps.
"""

from __future__ import annotations

import contextvars
import ctypes
import datetime
import logging
import os
import pickle
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from bytecp.errors import ConfigError

__all__ = ["KEEP_BYTES", "finish", "side_group", "retire_side_group", "registered", "ranks_of", "default_store",
           "all_gather_bytes", "broadcast_bytes", "to_bytes", "from_bytes", "RETIRE_SECONDS", "SETTLE_SECONDS", "DEADLINE", "StoreSilent", "roll_call", "settle_native_threads"]

log = logging.getLogger("bytecp")

#: how long a replaced collective's works are still kept (its gloo worker
#: dropped its own reference microseconds after completing it)
RETIRE_SECONDS = 1.0
#: at exit, the least time since the last collective before finalization
SETTLE_SECONDS = 0.1
#: a CPU collective's payload up to this size is kept (larger ones are
#: followed by the small collectives that end every operation)
KEEP_BYTES = 1 << 20

_lock = threading.Lock()
#: the works of the latest collective on each group (``id`` of the group; 0: the default group)
_kept: dict[int, list[Any]] = {}
#: replaced works, with when they were replaced
_retired: list[tuple[float, list[Any]]] = []
_last = 0.0
#: roll-call threads (may outlive their call while the store's host is stopped)
_roll_calls: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
#: at exit, how long roll calls still waiting in the store are given to end
ROLL_CALL_EXIT_SECONDS = 15.0


#: bytecp's own gloo groups: (purpose, the ranks they span) -> group
_side: dict[tuple[str, tuple[int, ...]], Any] = {}


def registered(group: Any) -> bool:
    """Whether ``group`` is still one of torch.distributed's groups (not
    destroyed, alone or with the world by ``destroy_process_group()``)."""
    try:
        dist.get_rank(group)  # a group of others answers -1; a destroyed one raises
    except (ValueError, RuntimeError):
        return False
    return True


def ranks_of(process_group: Any) -> tuple[int, ...]:
    """The global ranks of ``process_group`` (None: the world's); a
    :class:`~bytecp.errors.ConfigError` for a group torch.distributed no
    longer has."""
    if process_group is None:
        return tuple(range(dist.get_world_size()))
    try:
        return tuple(dist.get_process_group_ranks(process_group))
    except (KeyError, ValueError, RuntimeError) as e:
        raise ConfigError("process_group= is not one of torch.distributed's groups (destroyed, or made before "
                          "torch.distributed was initialized again): pass a group of the current world") from e


def side_group(purpose: str, process_group: Any) -> Any:
    """(every rank of ``process_group``, and only those; collectively when it
    makes one) A gloo group of bytecp's own over the ranks of
    ``process_group`` (None: the world), one per ``purpose`` (``"saves"``: background saves' collectives;
    ``"votes"``: the managers' save decisions), so that its collectives never
    interleave with training's nor with the other purpose's.

    Made once for those ranks and reused by every later call (a process
    making many managers or saves holds one group, never one per call: every
    gloo group keeps a thread that wakes a hundred times a second), and made
    again when the one kept is no longer registered (``torch.distributed``
    was destroyed and initialized again in this process: an in-process
    restart). Kept by the ranks, never by the group object, so that every
    rank decides alike whether to make one (``new_group`` is collective)."""
    key = (purpose, ranks_of(process_group))
    group = _side.get(key)
    if group is None or not registered(group):
        # over a part of the world, only its ranks call this: made by them alone (named by the ranks,
        # without moving the world's count of groups, which names the training's next groups alike on
        # every rank: moved on these ranks alone, the job's next new_group hung)
        part = len(key[1]) != dist.get_world_size()
        group = _side[key] = dist.new_group(ranks=list(key[1]), backend="gloo", use_local_synchronization=part)
    return group


def retire_side_group(purpose: str, process_group: Any) -> None:
    """(every rank, after a collective on the group broke: a rank missed the
    deadline or died) Never use the group :func:`side_group` keeps for
    ``purpose`` over ``process_group`` again -- an abandoned collective may
    still pair up with a late rank's; the next call makes a new one.

    The retired group is kept for the life of the process, and never
    destroyed at its end either (a reference no finalization drops):
    destroying a gloo group joins its worker threads, and the one running
    the abandoned collective waits for the peer that never comes until the
    group's own timeout (30 min) -- wherever the last reference went: an
    exception collected mid-training, or the interpreter's last collection
    at exit (seen by the chaos run as a hang after a stall)."""
    try:
        key = (purpose, ranks_of(process_group))
    except ConfigError:  # the group is gone: so is what side_group kept for it
        return
    group = _side.pop(key, None)
    if group is not None:
        # a reference nothing owns: a module-level list would be cleared at finalization
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


#: the monotonic time by which the collectives of the operation in progress
#: on this thread must finish (set by :meth:`bytecp.dist.DistContext._collective`)
DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("bytecp_deadline", default=None)


def finish(group: Any, works: Sequence[Any], *, keep: bool = True) -> None:
    """(the thread that started ``works``) Wait for them, then keep them in
    place of the group's previous collective's works (see the module docstring).

    ``keep=False`` (a collective on device memory, whose works gloo's CPU
    threads never free, or a large payload that later collectives of the
    same operation follow): waited for and let go, so kept works never hold
    GPU memory or a large host buffer until the next checkpoint."""
    global _last
    deadline = DEADLINE.get()
    for w in works:
        if deadline is None:
            w.wait()
        else:  # raises once the deadline has passed (gloo: "Operation timed out!")
            w.wait(datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
    now = time.monotonic()
    with _lock:
        _retired[:] = [r for r in _retired if now - r[0] < RETIRE_SECONDS]
        _last = now
        if not keep:
            return
        old = _kept.get(0 if group is None else id(group))
        _kept[0 if group is None else id(group)] = list(works)
        if old:
            _retired.append((now, old))


def _settle() -> None:
    """(the main thread, at interpreter exit, after the in-flight save's thread
    has ended) Sleep until :data:`SETTLE_SECONDS` have passed since the last
    collective: the gloo workers drop their references, and any of them
    waiting for the GIL takes it, before finalization begins."""
    wait = _last + SETTLE_SECONDS - time.monotonic() if _last else 0.0
    if wait > 0:
        time.sleep(wait)
    _join_roll_calls(ROLL_CALL_EXIT_SECONDS)
    settle_native_threads(SETTLE_SECONDS)


def _join_roll_calls(limit: float) -> None:
    """(at exit) Wait, at most ``limit`` seconds, for roll calls still blocked
    in a store request (their host was stopped, and may be back): one that
    returned while the interpreter finalizes would end by ``pthread_exit``
    inside torch's C++ frames, and abort the process (seen by the chaos run
    after a stall, with every save of the job done)."""
    end = time.monotonic() + limit
    for t in list(_roll_calls):
        if t.is_alive():
            log.warning("bytecp: waiting (at most %.0f s) for a roll call in the rendezvous store before exit", limit)
            t.join(max(0.0, end - time.monotonic()))


def settle_native_threads(limit: float) -> None:
    """(the main thread, at exit: :func:`_settle`; also a process that must
    not import bytecp's API, such as a benchmark's baseline worker) Release
    the GIL until no other thread of this process is runnable, for at most
    ``limit`` seconds.

    The same abort as above, from collectives bytecp never saw (FSDP's,
    DCP's, the training loop's): their gloo worker, preempted between
    completing the work and freeing it, frees it once it runs again and
    asks for the GIL. While this sleeps, a thread waiting for the GIL takes
    it, and a preempted one shows as running (``R`` in
    ``/proc/self/task/<tid>/stat``) until it is done. Where ``/proc`` is
    missing, one short sleep."""
    end = time.monotonic() + limit
    me = threading.get_native_id()
    while True:
        time.sleep(0.002)
        if not _others_running(me) or time.monotonic() >= end:
            return


def _others_running(me: int) -> bool:
    """Whether a thread of this process other than ``me`` is running or runnable."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return False
    for tid in tids:
        if tid == str(me):
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        if stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] == b"R":
            return True
    return False


# (registered before bytecp.saving.handles registers its drain: threading
# runs its exit hooks last registered first, so this one runs after it)
getattr(threading, "_register_atexit", lambda fn: None)(_settle)


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
    keep = device.type == "cpu"
    finish(group, [dist.all_gather(sizes, size, group=group, async_op=True)], keep=keep)
    lengths = [int(s.item()) for s in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data.to(device)
    outs = [torch.empty_like(padded) for _ in range(world_size)]
    finish(group, [dist.all_gather(outs, padded, group=group, async_op=True)], keep=keep)
    return [o[:n].cpu() for o, n in zip(outs, lengths, strict=True)]


def broadcast_bytes(data: torch.Tensor | None, src: int, group: Any, device: torch.device) -> torch.Tensor:
    """(every rank of ``group``) Global rank ``src``'s ``data`` (CPU
    ``uint8``; ``None`` on the other ranks): the size, then the payload."""
    size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64, device=device)
    keep = device.type == "cpu"
    finish(group, [dist.broadcast(size, src=src, group=group, async_op=True)], keep=keep)
    buf = data.to(device) if data is not None else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    if buf.numel():
        finish(group, [dist.broadcast(buf, src=src, group=group, async_op=True)], keep=keep)
    return buf.cpu()


class StoreSilent(TimeoutError):
    """The rendezvous store did not answer a roll call in time: the process
    hosting it (rank 0 under ``env://``/``tcp://``) is stopped or hung."""


def roll_call(store: Any, prefix: str, rank: int, world_size: int, seconds: float) -> set[int]:
    """(every survivor of a broken collective; :meth:`bytecp.dist.DistContext._collective_failed`)
    Answer under ``prefix`` in ``store`` and return the ranks that answered
    within ``seconds``. The store calls run on a daemon thread: a store whose
    host is stopped (SIGSTOP) never answers, and its client would wait for the
    group's timeout; past ``seconds`` + 2 this raises :class:`StoreSilent`."""
    box: dict[str, Any] = {}

    def ask() -> None:
        try:
            store.append(prefix + "alive", f"{rank},")
            if store.add(prefix + "answers", 1) >= world_size:
                store.set(prefix + "all", "1")
            try:
                store.wait([prefix + "all"], datetime.timedelta(seconds=seconds))
            except Exception:  # a timeout: someone did not answer
                pass
            box["alive"] = {int(r) for r in store.get(prefix + "alive").decode().split(",") if r}
        except Exception as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    t = threading.Thread(target=ask, name="bytecp-roll-call", daemon=True)
    _roll_calls.add(t)
    t.start()
    t.join(seconds + 2.0)
    if "error" in box:
        raise box["error"]
    if "alive" not in box:
        raise StoreSilent(f"the rendezvous store did not answer within {seconds + 2.0:g} s")
    return set(box["alive"])


def default_store() -> Any:
    """The default process group's rendezvous store (None when torch does not expose it)."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:
        return None
