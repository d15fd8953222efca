"""CUDA copies between the device and the host: pinned host memory, one copy
stream per device, and events that order every copy after the work that
produced its data. No function here synchronizes a device: the only waits
are on events of bytecp's own copies (or, for the training stream, an
event it waits for on the GPU).

Used by the save stagers (:mod:`bytecp.saving.staging`: device-to-host
copies of CUDA boxes into a pinned arena, or into a memory-tier arena
registered here), the save pipeline's describe phase (the caller's streams
marked ready, on the caller's thread), a lazy save's optimizer hook (the
training stream waits for the copies' event), prewarm (the arenas pinned
before the first save) and the load reader (:mod:`bytecp.loading.reader`:
reads into pinned slabs, host-to-device copies on a side stream while the
next read runs).

Host memory is pinned by registering an ordinary page-aligned mapping with
``cudaHostRegister`` (as ``torch.distributed.checkpoint``'s pinned stager
does): torch's own pinned allocator rounds every allocation up to a power
of two (a 4.2 GB arena would pin 8 GB), and a memory-tier arena is a shared
file mapping that only registration can pin. Where registration fails (a
locked-memory limit), copies still run, at pageable speed, and a warning
says why once.

Nothing here touches CUDA unless a CUDA tensor is involved: CPU jobs never
initialize it.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

__all__ = [
    "PinnedBuffer", "register", "unregister", "is_registered", "ready_events", "copy_stream",
    "DeviceToHost", "wait_events", "STATS",
]

log = logging.getLogger("bytecp")

#: ``cudaHostRegisterPortable``: pinned for every CUDA context of the process
_PORTABLE = 1


class _Stats:
    """What this process pinned and copied (tests and the GPU check read it)."""

    def __init__(self) -> None:
        self.registered = 0  # successful cudaHostRegister calls
        self.registered_bytes = 0
        self.register_failures = 0
        self.device_to_host = 0  # batches of device-to-host copies enqueued
        self.host_to_device = 0  # host-to-device copies enqueued by loads


STATS = _Stats()

_lock = threading.Lock()
#: address -> bytes of every range this process registered
_registered: dict[int, int] = {}
_warned = False


def _cudart() -> Any:
    return torch.cuda.cudart()


def register(ptr: int, nbytes: int) -> bool:
    """Pin ``nbytes`` of host memory at ``ptr`` (page-aligned, mapped) for
    CUDA copies; True when it is pinned (now or already). Never raises: a
    failure is logged once and the memory stays pageable."""
    global _warned
    if nbytes <= 0 or not torch.cuda.is_available():
        return False
    with _lock:
        if _registered.get(ptr, 0) >= nbytes:
            return True
        if ptr in _registered:  # registered smaller: register again at the new size
            _cudart().cudaHostUnregister(ptr)
            del _registered[ptr]
        err = _cudart().cudaHostRegister(ptr, nbytes, _PORTABLE)
        code = int(getattr(err, "value", err))
        if code != 0:
            STATS.register_failures += 1
            if not _warned:
                _warned = True
                log.warning("bytecp: could not pin %d bytes of host memory for CUDA copies (cudaHostRegister "
                            "error %d): device copies run at pageable speed; raise the locked-memory limit "
                            "(ulimit -l) to pin them", nbytes, code)
            _clear_error()
            return False
        _registered[ptr] = nbytes
        STATS.registered += 1
        STATS.registered_bytes += nbytes
        return True


def _clear_error() -> None:
    """Reset the runtime's sticky last error after a failed runtime call, so
    torch's next check does not report it."""
    get_last = getattr(_cudart(), "cudaGetLastError", None)
    if get_last is not None:
        get_last()


def unregister(ptr: int) -> None:
    """Unpin the range registered at ``ptr`` (nothing if none). The caller
    makes sure no copy into or out of it is in flight."""
    with _lock:
        if _registered.pop(ptr, None) is not None:
            _cudart().cudaHostUnregister(ptr)


def is_registered(ptr: int) -> bool:
    """Whether ``ptr`` starts a range this process pinned."""
    with _lock:
        return ptr in _registered


class PinnedBuffer:
    """``nbytes`` of page-aligned host memory, faulted in now and pinned for
    CUDA copies (registered; pageable where that fails). ``tensor`` is its
    bytes; :meth:`close` unpins it (also when it is garbage collected)."""

    def __init__(self, nbytes: int) -> None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self._map = mmap.mmap(-1, max(nbytes, 1), flags=flags)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)  # keeps the mapping alive
        self.nbytes = self.tensor.numel()
        self.ptr = self.tensor.data_ptr()
        self.pinned = register(self.ptr, self.nbytes)
        self._finalizer = weakref.finalize(self, unregister, self.ptr) if self.pinned else None

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()


def ready_events(tensors: Iterable[torch.Tensor]) -> dict[int, Any]:
    """(the caller's thread, when a save is asked for) An event on the current
    stream of each CUDA device among ``tensors``: copies made later, on
    any thread and stream, wait for it and so see the tensors as they are
    now, whatever the caller queues meanwhile. {} without CUDA tensors."""
    out: dict[int, Any] = {}
    for t in tensors:
        if t.device.type == "cuda":
            index = t.device.index if t.device.index is not None else torch.cuda.current_device()
            if index not in out:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(index))
                out[index] = ev
    return out


_streams: dict[int, Any] = {}


def copy_stream(device: torch.device | int) -> Any:
    """bytecp's copy stream on ``device`` (one per device and process, of
    the lowest priority: kernels of higher-priority streams go first)."""
    index = device if isinstance(device, int) else device.index
    if index is None:
        index = torch.cuda.current_device()
    with _lock:
        s = _streams.get(index)
        if s is None:
            s = _streams[index] = torch.cuda.Stream(device=index)  # priority 0: CUDA's lowest
        return s


class DeviceToHost:
    """Device-to-host copies of one stage, on each device's copy stream,
    after the ``ready`` events (else after each device's current stream as
    it is now). Holds every source until :meth:`wait` has seen its copy
    done, so no source's memory is reused while it is read.

    Inside :meth:`on` (the stager's loop over its boxes) each :meth:`copy`
    is queued at once, so the DMA runs while the loop lays out the next
    boxes. ``events`` are recorded once everything is queued: a lazy save
    hands them to the training stream (its optimizer step waits for them
    on the GPU); :meth:`wait` is the host's wait for them (the stage's own
    thread, before the staged bytes are read)."""

    def __init__(self, ready: dict[int, Any] | None = None) -> None:
        self._ready = dict(ready or {})
        self._sources: list[torch.Tensor] = []
        self._streams: dict[int, Any] = {}
        self._current: int | None = None
        self.events: dict[int, Any] = {}

    def _stream(self, index: int) -> Any:
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = copy_stream(index)
            ready = self._ready.get(index)
            if ready is None:
                stream.wait_stream(torch.cuda.current_stream(index))
            else:
                stream.wait_event(ready)
        return stream

    @contextlib.contextmanager
    def on(self, device: torch.device | None) -> Iterator[None]:
        """Queue the copies made inside on ``device``'s copy stream (None: no device, nothing to set)."""
        if device is None:
            yield
            return
        index = device.index if device.index is not None else torch.cuda.current_device()
        with torch.cuda.stream(self._stream(index)):
            self._current = index
            try:
                yield
            finally:
                self._current = None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``dst.copy_(src)`` (``src`` on a CUDA device, ``dst`` host memory)."""
        index = src.device.index if src.device.index is not None else torch.cuda.current_device()
        if self._current == index:
            dst.copy_(src, non_blocking=True)
        else:
            with torch.cuda.stream(self._stream(index)):
                dst.copy_(src, non_blocking=True)
        self._sources.append(src)

    def queued(self) -> dict[int, Any]:
        """Record each used stream's event after what was queued; -> them."""
        for index, stream in self._streams.items():
            ev = torch.cuda.Event()
            ev.record(stream)
            self.events[index] = ev
        if self._streams:
            STATS.device_to_host += 1
        return self.events

    def wait(self) -> None:
        """(host) Wait until every copy queued is done; the sources are let go."""
        if self._streams and not self.events:
            self.queued()
        wait_events(self.events.values())
        self._sources.clear()


def wait_events(events: Sequence[Any] | Iterable[Any]) -> None:
    """The host waits for each event (never for a whole device)."""
    for ev in events:
        ev.synchronize()
