"""Building many small objects at once without the cyclic collector.

A reader that turns a large ``metadata.json`` into Python objects (200,000
tensors: about a million dicts, lists, strings and skeleton nodes) starts
collections of the whole heap as it goes, each traversing every object
the process holds: the same parse of a MoE's skeleton took 0.15 s with
collections paused and 0.2-1.2 s without, depending on what else the
training process held. Used by :meth:`bytecp.format.metadata.Metadata.from_bytes`,
:meth:`bytecp.tree.skeleton.Node.from_json` and the coordinator's merge at
commit. Nothing is lost: what is garbage is collected once the collector
runs again.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["gc_paused"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the block (nesting is harmless:
    the outermost block turns the collector back on, if it was on)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
