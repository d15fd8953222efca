"""Building many small objects at once without the cyclic collector.

A reader that turns a large ``metadata.json`` into Python objects (200,000
tensors: about a million dicts, lists, strings and skeleton nodes) starts
collections of the whole heap as it goes, each traversing every object
the process holds: the same parse of a MoE's skeleton took 0.15 s with
collections paused and 0.2-1.2 s without, depending on what else the
training process held. Used by :meth:`bytecp.format.metadata.Metadata.from_bytes`,
:meth:`bytecp.tree.skeleton.Node.from_json` and the coordinator's merge of
a job's first union (on a thread: the pauses of several threads nest).
Nothing is lost: what is garbage is collected once the collector runs
again.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["gc_paused", "pause_gc", "resume_gc", "heap_frozen"]

#: (depth of the pauses open in every thread, whether the collector was on before the first)
_PAUSES = [0, False]
#: (depth of the freezes open in every thread, whether the first froze the heap itself, the count it froze)
_FROZEN: list[Any] = [0, False, 0]
_LOCK = threading.Lock()


def pause_gc() -> None:
    """Pause the cyclic collector until a matching :func:`resume_gc`, which
    any thread may call. Pauses of several threads nest: the last one to
    end turns the collector back on, if it was on before the first began
    (two threads each saving and restoring ``gc.isenabled()`` could leave
    it off for good, or turn it on under the other's pause)."""
    with _LOCK:
        if _PAUSES[0] == 0:
            _PAUSES[1] = gc.isenabled()
            gc.disable()
        _PAUSES[0] += 1


def resume_gc() -> None:
    """End one :func:`pause_gc`."""
    with _LOCK:
        if _PAUSES[0] == 0:  # (one a forked child's forking thread opened before the fork: forgotten)
            return
        _PAUSES[0] -= 1
        if _PAUSES[0] == 0 and _PAUSES[1]:
            gc.enable()


def _forget_pauses() -> None:
    """(a forked child) The parent's other threads, and their pauses, are
    gone: none is open, and the collector is on if it was before them (a
    heap the parent froze stays frozen in the child: nothing of it is the
    child's to collect)."""
    global _LOCK
    _LOCK = threading.Lock()
    if _PAUSES[0] and _PAUSES[1]:
        gc.enable()
    _PAUSES[0] = 0
    _FROZEN[0] = 0


os.register_at_fork(after_in_child=_forget_pauses)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the block (nesting is harmless,
    in one thread or several: :func:`pause_gc`)."""
    pause_gc()
    try:
        yield
    finally:
        resume_gc()


@contextlib.contextmanager
def heap_frozen() -> Iterator[None]:
    """Inside the block, the collector passes over every object that existed
    when it began (``gc.freeze()``; ``gc.unfreeze()`` at its end), while
    objects made since are collected as usual.

    An async save's background thread runs in one: a save of tens of
    thousands of tensors holds enough objects for its whole run to start a
    collection of the oldest generation, which traverses every object of the
    training process (0.26-0.30 s for a 20,120-tensor state beside its
    model) and holds the GIL throughout: the training thread stopped for it
    at every checkpoint. Frozen, that collection traverses only what was made
    since. Nothing is kept from being collected for good: the garbage among
    the frozen objects (there is little: they were alive a moment before) is
    collected after the block. A process that froze its heap itself
    (``gc.get_freeze_count()`` not 0: a server's warm-up) keeps its freeze:
    then the block does nothing; and a freeze the process makes while the
    block is open (more objects frozen at its end than it froze) is kept
    too, the block's with it. Blocks of several threads nest: the last to
    end unfreezes."""
    with _LOCK:
        if _FROZEN[0] == 0:
            _FROZEN[1] = gc.get_freeze_count() == 0
            if _FROZEN[1]:
                gc.freeze()
                _FROZEN[2] = gc.get_freeze_count()
        _FROZEN[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            if _FROZEN[0]:  # (0: a forked child's, its parent's block forgotten)
                _FROZEN[0] -= 1
                if _FROZEN[0] == 0 and _FROZEN[1] and gc.get_freeze_count() <= _FROZEN[2]:
                    gc.unfreeze()
