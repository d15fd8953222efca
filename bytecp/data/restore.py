"""A load's decision for one per-rank value that is a data loader: restore the
rank's saved state as it is, reshard the position, refuse, or (opted in)
approximate.

Called by the load's match phase on every rank
(:class:`bytecp.loading.matching`'s slot builder), before anything of the
live state changes: a refusal raised here stops the load on every rank with
nothing read into the state. Decided from the checkpoint's merged position
(O(1) of it) and the live object alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from bytecp.data.positions import SavedData
from bytecp.data.registry import Resharded, resharder_for, unwrap
from bytecp.errors import DataReshardError

__all__ = ["Restored", "restore_data", "MODES"]

#: ``data_reshard=`` values: ``"exact"`` refuses what cannot continue exactly;
#: ``"approximate"`` proceeds with the nearest position and a warning naming the count
MODES = ("exact", "approximate")

_OPT_IN = "load with data_reshard='approximate' to accept that"


@dataclasses.dataclass(frozen=True)
class Restored:
    """What the load restores instead of the rank's saved state: ``value``
    (``None`` with ``as_saved``: rank ``r % saved_world_size``'s saved
    state, as before), an action after the apply phase, a warning."""

    value: Any = None
    as_saved: bool = False
    after: Callable[[], None] | None = None
    warning: str | None = None


def _label(fqn: str, live: Any, kind: str | None) -> str:
    inner = unwrap(live)
    return f"data loader {fqn!r} ({type(inner).__name__}{f', {kind}' if kind else ''})"


def restore_data(
    fqn: str, live: Any, record: Mapping[str, Any] | None, saved_world: int, rank: int, world: int,
    read: Callable[[int], Any], mode: str,
) -> Restored | None:
    """(every rank, match phase) None: restore the rank's saved state as
    before (the same layout; or a value that is not data, or a checkpoint
    without a recorded position: the caller warns at another world size).
    Else what to restore. Raises :class:`DataReshardError` (one line: the
    loader and the samples that would repeat or be skipped) when the
    position cannot continue exactly and ``mode`` is ``"exact"``."""
    if record is None:
        return None
    res = resharder_for(live)
    saved = SavedData.of(fqn, record, saved_world, read)
    kind = saved.kind
    if saved_world == world:  # as before, unless the live loader's own layout changed (workers, batching, DP size)
        if res is None or res.kind != kind or rank not in saved.recorded:
            return None
        if res.same_layout(unwrap(live), saved.position(rank)):
            return None
    label = _label(fqn, live, kind or (res.kind if res is not None else None))
    where = f"saved by {saved_world} ranks, loaded by {world}"
    if kind is None:
        kinds = sorted({str(k) for k in saved.column("kind")})
        why = (f"{label}: different loader kinds on different saved ranks ({', '.join(kinds)}; {where})"
               if len(kinds) > 1 else
               f"{label}: no resharder knows this kind of loader ({where}); give it a reshard method or "
               "register a resharder (docs/extending.md)")
        return _refuse(DataReshardError(f"{why}: an unknown number of samples would repeat or be skipped"),
                       mode, rank, saved_world, label)
    if res is None or res.kind != kind:
        now = "no resharder" if res is None else f"kind {res.kind}"
        return _refuse(DataReshardError(
            f"{label}: saved as kind {kind}, the loader here has {now} ({where}): an unknown number of samples "
            "would repeat or be skipped"), mode, rank, saved_world, label)
    try:
        out = res.reshard(unwrap(live), saved, rank, world)
    except DataReshardError as e:
        return _refuse(e, mode, rank, saved_world, label)
    if isinstance(out, Resharded):
        return Restored(out.state, after=out.after, warning=out.note and f"{label}: {out.note}")
    return Restored(out)


def _count(e: DataReshardError) -> str:
    parts = [f"{e.repeat} sample(s) seen twice" if e.repeat else "",
             f"{e.skip} sample(s) skipped" if e.skip else ""]
    said = " and ".join(p for p in parts if p)
    return said or "an unknown number of samples repeated or skipped"


def _refuse(e: DataReshardError, mode: str, rank: int, saved_world: int, label: str) -> Restored:
    """The refusal (``mode="exact"``), or the approximation and its warning."""
    msg = str(e) if str(e).startswith(label) else f"{label}: {e}"
    if mode != "approximate":
        raise DataReshardError(f"{msg}; {_OPT_IN}", repeat=e.repeat, skip=e.skip)
    if e.approximate is None:
        return Restored(as_saved=True, warning=(
            f"data_reshard='approximate': {label} restores the position saved by rank {rank % saved_world}: "
            f"{_count(e)} ({msg})"))
    value = e.approximate
    after = value.after if isinstance(value, Resharded) else None
    state = value.state if isinstance(value, Resharded) else value
    note = f"; and {value.note}" if isinstance(value, Resharded) and value.note else ""
    return Restored(state, after=after, warning=f"data_reshard='approximate': {_count(e)} ({msg}){note}")
