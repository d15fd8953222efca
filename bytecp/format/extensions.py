"""Loading bytecp's compiled extensions, each checked before anything uses it.

bytecp has two: the serving deltas' kernels (``bytecp/format/_kernels.c``,
:mod:`bytecp.format.kernels`) and the checked reads of local files
(``bytecp/format/_reads.c``, :mod:`bytecp.format.checked_reads`). Both are
built at install time where a C compiler is (pyproject.toml's
``ext-modules``, optional), and both are used the same way, which this
module says once: an environment variable turns one off (``0``) or
requires it (``1``; a :class:`ConfigError` where it cannot be used); a
build is used only when its ``ABI`` number is the one its Python expects
and it passes that Python's self-check; a build that is there but wrong
warns once (a stale install, a compiler's mistake); one that is not built
is an install without a compiler, said nothing of. Each module loads its
extension at its first use (:func:`first`: once per process, under a lock,
as the reader threads of a first load ask at once).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from bytecp.errors import ConfigError

__all__ = ["Extension", "first"]


@dataclasses.dataclass(frozen=True)
class Extension:
    """One compiled extension and how its Python speaks of it."""

    #: the module's import name (``bytecp.format._kernels``)
    module: str
    #: the interface its Python expects (the module's ``ABI``)
    abi: int
    #: the setting that turns it off (0) or requires it (1)
    env: str
    #: what it is, in messages ("kernels", "checked reads")
    what: str
    #: what runs without it, in messages ("serving deltas run in NumPy")
    instead: str
    #: what ``0`` means, in the setting's error ("NumPy kernels only")
    off: str
    log: logging.Logger

    def load(self, self_check: Callable[[Any], str | None],
             quiet: Callable[[Any, str], bool] = lambda k, why: False) -> ModuleType | None:
        """The module when it is built, current and passes ``self_check``
        (which returns why it cannot be used, or None); else None, with a
        warning where a build is there but unusable -- unless ``quiet(module,
        why)`` says that is no fault of the build (a CPU without an
        instruction it needs)."""
        want = os.environ.get(self.env, "").strip()
        if want not in ("", "0", "1"):
            raise ConfigError(f"{self.env}={want!r}: use 0 ({self.off}) or 1 (require the compiled {self.what})")
        if want == "0":
            return None
        why: str | None
        try:
            k = importlib.import_module(self.module)
        except ImportError as e:
            k, why = None, f"not built ({e})"
        else:
            got = getattr(k, "ABI", None)
            why = None if got == self.abi else f"a build of another version (ABI {got}, this bytecp's is {self.abi}): reinstall"
            why = why or self_check(k)
        if why is None:
            return k
        if want == "1":
            raise ConfigError(f"{self.env}=1 but bytecp's compiled {self.what} are {why}; reinstall bytecp where a C "
                              f"compiler is, or unset {self.env}")
        if k is not None and not quiet(k, why):
            self.log.warning("bytecp: the compiled %s (%s) are not used: %s; %s", self.what, self.module, why,
                             self.instead)
        return None


_LOCK = threading.RLock()


def _after_fork() -> None:
    global _LOCK
    _LOCK = threading.RLock()  # (a fork while another thread loaded: the child's copy would stay held)


os.register_at_fork(after_in_child=_after_fork)


def first(loaded: list[ModuleType | None], load: Callable[[], ModuleType | None]) -> ModuleType | None:
    """``loaded[0]``, made by ``load`` at the first call (once, under a lock)."""
    if not loaded:
        with _LOCK:
            if not loaded:
                loaded.append(load())
    return loaded[0]
