"""Progress reporting for the long one-process tools (``verify``, ``export``, ``gc``).

The tools call ``start(total)`` once, then ``advance(n)`` as work is done,
from any thread; they never print. The CLI passes :func:`terminal_bar`, a
tqdm bar on stderr that is on only when stderr is a terminal (never in
logs, pipes or CI output); library callers get :data:`NO_PROGRESS`.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Protocol

__all__ = ["Progress", "NO_PROGRESS", "terminal_bar"]


class Progress(Protocol):
    def start(self, total: int) -> None:
        """The amount of work (bytes or files), known before it begins."""

    def advance(self, n: int) -> None:
        """``n`` more units done (thread-safe)."""

    def close(self) -> None:
        """The work ended (done or failed)."""


class _NoProgress:
    def start(self, total: int) -> None:
        pass

    def advance(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


NO_PROGRESS: Progress = _NoProgress()


class _Bar:
    """A tqdm bar created at ``start`` (the total is known only then)."""

    def __init__(self, desc: str, unit: str, stream: Any) -> None:
        self.desc, self.unit, self.stream = desc, unit, stream
        self.bar: Any = None
        self.lock = threading.Lock()

    def start(self, total: int) -> None:
        import shutil

        from tqdm import tqdm

        # a terminal that reports no size (a fresh pseudo-terminal) gets 80x24,
        # not tqdm's zero-width bar that prints nothing
        cols, rows = shutil.get_terminal_size((80, 24))
        with self.lock:
            if self.bar is None:
                binary = self.unit == "B"
                self.bar = tqdm(total=total, desc=self.desc, unit=self.unit, unit_scale=binary,
                                unit_divisor=1024 if binary else 1000, file=self.stream, leave=False,
                                ncols=cols, nrows=rows)

    def advance(self, n: int) -> None:
        with self.lock:
            if self.bar is not None:
                self.bar.update(n)

    def close(self) -> None:
        with self.lock:
            if self.bar is not None:
                self.bar.close()
                self.bar = None


def terminal_bar(desc: str, unit: str = "B", *, enabled: bool | None = None, stream: Any = None) -> Progress:
    """A progress bar on ``stream`` (stderr) when it is a terminal, else :data:`NO_PROGRESS`.

    ``enabled`` forces it on or off (``--no-progress``)."""
    stream = sys.stderr if stream is None else stream
    if enabled is None:
        isatty = getattr(stream, "isatty", None)
        enabled = bool(isatty and isatty())
    return _Bar(desc, unit, stream) if enabled else NO_PROGRESS
