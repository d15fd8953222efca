"""Save on a signal: a scheduler's "you will be stopped" (SIGTERM with a grace
period under Slurm and Kubernetes) becomes one last checkpoint.

Used by :class:`~bytecp.manager.CheckpointManager` (``save_on_signal=``).
The handler only records the signal (it runs between two Python bytecodes of
the training thread, where no collective may start). At each
``maybe_save(step, ...)`` every rank learns whether any rank has been
signalled from the manager's vote (:mod:`bytecp.tools.cadence`: one
all-reduce of one integer on a gloo group of its own, never the training's
group, nor the background saves' group), so every rank learns it at the same
step even when the signal reached them at different moments, or reached only
one. The manager then saves that step on every rank and ends the process.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterable
from types import FrameType

from bytecp.errors import ConfigError

__all__ = ["Preemption", "signals_from"]

log = logging.getLogger("bytecp")


def signals_from(spec: bool | int | Iterable[int]) -> list[int]:
    """``True`` -> [SIGTERM]; a signal number or several; ``False`` -> []."""
    if spec is False or spec is None:
        return []
    if spec is True:
        return [int(signal.SIGTERM)]
    if isinstance(spec, int):
        return [int(spec)]
    return [int(s) for s in spec]


class Preemption:
    """Signal handlers and the per-step vote of one manager (all ranks)."""

    def __init__(self, signums: list[int]) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError("save_on_signal needs the CheckpointManager to be created on the main thread "
                              "(Python delivers signals there)")
        self.received: int | None = None
        self._previous = {s: signal.signal(s, self._handle) for s in signums}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            log.warning("bytecp: %s received: the next maybe_save saves the current step on every rank, "
                        "then the process exits", signal.Signals(signum).name)
        self.received = signum

    def agreed_elsewhere(self) -> None:
        """(every rank, once the manager's vote says some rank was signalled) This rank acts as signalled."""
        if self.received is None:
            self.received = int(signal.SIGTERM)  # another rank was signalled

    def restore_handlers(self) -> None:
        """Put back the handlers that were there before (the manager is done with them)."""
        for s, h in self._previous.items():
            signal.signal(s, h)
