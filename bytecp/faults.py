"""Fault injection for tests: make one rank fail, stall or die in one phase.

The pipelines call :func:`inject` at the start of each phase (all ranks).
It does nothing unless one of these environment variables names the phase
and this rank (comma-separated lists allowed):

- ``BYTECP_FAULT_DELAY=phase:rank:seconds`` sleeps there;
- ``BYTECP_FAULT_ERROR=phase:rank`` raises ``RuntimeError`` there;
- ``BYTECP_FAULT_EXIT=phase:rank`` ends the process there (a rank dying mid-save);
- ``BYTECP_FAULT_KILL=phase:rank:seconds`` sends the process SIGKILL that
  many seconds after it enters the phase (from a timer thread: the save goes
  on meanwhile, so the kill lands at an arbitrary point of what follows);
  ``phase:rank:seconds:pid`` kills process ``pid`` instead (a keeper, a
  server the save talks to), once per process however often the phase
  comes back.

Phases: ``plan``, ``union`` (a job's first save whose ranks' skeletons
differ: before they are sent, :func:`bytecp.saving.union.gather_union`),
``stage``, ``write``, ``commit``, ``committed`` (the coordinator: just after
metadata.json is written, before the outcome is broadcast; every other rank:
just after the outcome reaches it), ``read`` (load: before matching).
``commit`` runs on the coordinator only (the commit is its part of the
save's last collective): named with another rank, it never fires.

Hand-offs between threads (stress tests of reused buffers and of the
read -> check -> place sequence) are widened by random delays:
``BYTECP_FAULT_HANDOFF=point,point:seconds`` sleeps a uniformly random time
of up to ``seconds`` (default 0.002) at each named hand-off (``*``: every
one) each time a thread passes it (:func:`handoff`). The points: ``read``
(a load's bytes arrived in memory, not yet checked), ``check`` (checked,
not yet placed into the target), ``place`` (placed), ``release`` (a reused
buffer given back: a load's slab, a save's staging arena, the memory tier's
arena and mapping), ``stage`` (a save's box copied into the arena, not yet
written), ``write`` (a data file written from the arena).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

__all__ = ["inject", "handoff", "HANDOFF_POINTS", "COORDINATOR_PHASES"]

#: the hand-offs :func:`handoff` may widen
HANDOFF_POINTS = ("read", "check", "place", "release", "stage", "write")

#: the phases only the coordinator enters
COORDINATOR_PHASES = ("commit",)
#: the other processes' kills this process has set off (each fires once)
_KILLED: set[str] = set()


def _matches(var: str, phase: str, rank: int) -> list[list[str]]:
    spec = os.environ.get(var)
    if not spec:
        return []
    out = []
    for item in spec.split(","):
        parts = item.split(":")
        if parts[0] == phase and int(parts[1]) == rank:
            out.append(parts)
    return out


def inject(phase: str, rank: int) -> None:
    """(all ranks) Apply the faults the environment asks for in ``phase`` on ``rank``."""
    if _matches("BYTECP_FAULT_EXIT", phase, rank):
        os._exit(17)
    for parts in _matches("BYTECP_FAULT_KILL", phase, rank):
        delay = float(parts[2]) if len(parts) > 2 else 0.0
        if len(parts) > 3:  # another process: once (its pid may be reused after)
            if ":".join(parts) not in _KILLED:
                _KILLED.add(":".join(parts))
                threading.Timer(delay, _kill, (int(parts[3]),)).start()
            continue
        if delay <= 0:
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    for parts in _matches("BYTECP_FAULT_DELAY", phase, rank):
        time.sleep(float(parts[2]))
    if _matches("BYTECP_FAULT_ERROR", phase, rank):
        raise RuntimeError(f"injected failure in phase {phase!r} on rank {rank}")


def _handoff_spec(spec: str) -> tuple[frozenset[str], float]:
    points, _, seconds = spec.rpartition(":") if ":" in spec else (spec, "", "")
    names = frozenset(p.strip() for p in points.split(",") if p.strip())
    unknown = sorted(names - {"*", *HANDOFF_POINTS})
    if unknown:
        raise ValueError(f"BYTECP_FAULT_HANDOFF={spec!r}: unknown hand-off(s) {unknown}; known: "
                         f"{', '.join(HANDOFF_POINTS)} or *")
    return names, float(seconds) if seconds else 0.002


_SPEC: tuple[str, frozenset[str], float] = ("", frozenset(), 0.0)


def handoff(point: str) -> None:
    """(any thread) At hand-off ``point``: sleep up to the seconds
    ``BYTECP_FAULT_HANDOFF`` gives it (nothing when it names another point or
    is unset: one dictionary lookup)."""
    global _SPEC
    spec = os.environ.get("BYTECP_FAULT_HANDOFF")
    if not spec:
        return
    if spec != _SPEC[0]:
        _SPEC = (spec, *_handoff_spec(spec))
    _, names, seconds = _SPEC
    if point in names or "*" in names:
        time.sleep(random.uniform(0.0, seconds))


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
