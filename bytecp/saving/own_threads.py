"""Torch's intra-op parallelism kept out of the threads a save runs beside training.

A torch operation large enough to split (more than 32,768 elements) runs
on the calling thread's OpenMP team; a thread other than the training
thread that runs one gets a team of its own (``torch.get_num_threads()``
threads), whose threads then contend for the cores with the training
thread's team. Measured on the 2-core benchmark host with a save every
four steps (``benchmarks/lazy_call.py``, docs/benchmarks.md): once a save's
copy thread split its copies, a 740-tensor GPT's training step took 64-66
ms against 20-21 ms, in the steps between saves as well as beside them.
(One load whose reader threads split a copy left no such trace.)

:func:`serial_torch` is what every thread bytecp starts for a save calls
first (the async save's thread, the copy-ahead helper, the copy and write
threads): torch runs that thread's operations on the thread itself. It sets
the thread's own OpenMP thread count (``omp_set_num_threads``, an
OpenMP per-thread setting) after torch's per-thread set-up, and leaves
``torch.set_num_threads`` -- which is process-wide, and would change the
training thread's count -- alone. Without an OpenMP runtime in the process,
nothing is done.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

import torch

__all__ = ["serial_torch"]

_RESOLVED: list[Callable[[int], object] | None] = []
_LOCK = threading.Lock()
_LOCAL = threading.local()


def _omp_set_num_threads() -> Callable[[int], object] | None:
    """The process's ``omp_set_num_threads`` (torch loads its OpenMP runtime
    into the global namespace), or None."""
    with _LOCK:
        if not _RESOLVED:
            try:
                fn = ctypes.CDLL(None).omp_set_num_threads
                fn.argtypes, fn.restype = [ctypes.c_int], None
            except (OSError, AttributeError):  # pragma: no cover - a torch without OpenMP
                fn = None
            _RESOLVED.append(fn)
        return _RESOLVED[0]


def serial_torch() -> None:
    """(first thing in each thread bytecp starts for a save; once per thread)
    Torch runs this thread's operations on it alone, never on a team of its own."""
    if getattr(_LOCAL, "done", False):
        return
    _LOCAL.done = True
    fn = _omp_set_num_threads()
    if fn is None:
        return
    torch.get_num_threads()  # torch's own set-up of this thread first: it would set the thread's count again
    fn(1)
