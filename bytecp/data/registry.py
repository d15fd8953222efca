"""Resharders: how each kind of data loader records its position at a save and
continues it under another data-parallel layout at a load; the registry by
loader kind and the ``reshard`` method users give their own loaders.

Who calls what, and when:

- save, every rank (the adapter describing the state): :func:`claims` says
  whether a stateful value is a data loader saved per rank, and
  :func:`position_of` returns its position (small JSON, ``"kind"`` added),
  kept beside the value as :attr:`bytecp.tree.state.PerRank.data`;
- commit, coordinator: every rank's position merged into the checkpoint's
  compact form (:mod:`bytecp.data.positions`);
- load, every rank (the match phase): :func:`resharder_for` of the live
  object; the load decides with :meth:`Resharder.same_layout` whether the
  rank's saved state is restored as it is, else calls
  :meth:`Resharder.reshard` (:mod:`bytecp.data.restore`).

The core names built-in resharders as lazy ``"module:attr"`` strings, each
with the module that must already be imported for one of its objects to
exist (``needs``): nothing is imported for a job that does not use it.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bytecp.errors import ConfigError, DataReshardError
from bytecp.plugins import RESHARDERS_GROUP, entry_point_targets
from bytecp.tree.state import is_json_leaf

if TYPE_CHECKING:
    from bytecp.data.positions import SavedData

__all__ = ["Resharder", "Resharded", "register_resharder", "resharder_for", "claims", "position_of",
           "looks_like_loader", "unwrap", "has_hook"]


class Resharder:
    """One kind of data loader (or sampler, or dataset): its position at a
    save and the state that continues it at a load under another layout.

    Subclass it, set :attr:`kind` and override :meth:`detect`,
    :meth:`position` and :meth:`reshard` (and :meth:`same_layout` when the
    layout can change at the same world size); register an instance with
    :func:`register_resharder`. One instance serves every call: keep no
    per-call state on it.
    """

    #: the name recorded in the checkpoint (``"torchdata"``); a load refuses
    #: to reshard a position of another kind
    kind: str = ""

    def detect(self, obj: Any) -> bool:
        """(every rank, save and load) Whether this resharder handles ``obj``
        (a value of the state: a loader, sampler or stateful dataset)."""
        return False

    def position(self, obj: Any, state: Any) -> dict[str, Any]:
        """(every rank, save) This rank's position: small, JSON-able, from
        the live ``obj`` and the ``state`` its ``state_dict()`` just
        returned. Keys understood by every tool: ``epoch``, ``samples``
        (samples this data-parallel rank consumed in the epoch) and
        ``dp_size`` (data-parallel ranks reading disjoint slices); the rest
        is the kind's own. Values alike on every rank are stored once."""
        return {}

    def same_layout(self, obj: Any, position: dict[str, Any]) -> bool:
        """(every rank, load at the saving world size) Whether ``obj`` reads
        its data as the saved rank of ``position`` did (same data-parallel
        size, workers, batching): then that rank's state is restored as it
        is; else :meth:`reshard` runs."""
        return True

    def reshard(self, obj: Any, saved: SavedData, rank: int, world_size: int) -> Any:
        """(every rank, load under another layout) The state to hand
        ``obj.load_state_dict`` so that this rank continues the saved data
        stream exactly (or a :class:`Resharded` with an action to run after
        it). ``saved`` holds the merged positions and reads any saved rank's
        state on demand; read only what this rank needs. Raise
        :class:`~bytecp.errors.DataReshardError` naming how many samples
        would repeat or be skipped when exactness is impossible."""
        raise DataReshardError(f"{type(self).__name__} does not reshard {type(obj).__name__}")


@dataclasses.dataclass(frozen=True)
class Resharded:
    """What :meth:`Resharder.reshard` may return instead of the bare state:
    ``after`` runs once the state is loaded (the load's apply phase: nothing
    changes before the whole load has succeeded); ``note`` is a warning the
    load gives (e.g. the epoch ends as the new world size ends it)."""

    state: Any
    after: Callable[[], None] | None = None
    note: str | None = None


#: kind -> (resharder, or "module:attr" not yet imported; the module that must be imported for its objects to exist)
_RESHARDERS: dict[str, tuple[Resharder | str, str | None]] = {
    "torchdata": ("bytecp.adapters.data.torchdata:TorchdataResharder", "torchdata.stateful_dataloader"),
    "hf_datasets": ("bytecp.adapters.data.hf_datasets:HFIterableResharder", "datasets"),
    "torchtitan": ("bytecp.adapters.torchtitan.data:TorchtitanResharder", "torchtitan.components.dataloader"),
    "megatron_lm": ("bytecp.adapters.megatron.data:MegatronLMResharder", "bytecp.adapters.megatron.data"),
    "deepspeed": ("bytecp.adapters.deepspeed.data:DeepSpeedLoaderResharder", "bytecp.adapters.deepspeed.data"),
}
_lock = threading.RLock()
_discovered = False


def register_resharder(kind: str, resharder: Resharder | type[Resharder] | str, *, needs: str | None = None) -> None:
    """Add (or replace) the resharder of ``kind``: an instance, a class, or
    ``"module:attr"`` imported on first use. ``needs``: a module that must be
    in ``sys.modules`` for the resharder to be tried (its framework's). Tried
    in registration order, after the objects' own ``reshard`` methods.
    Installed packages may declare a ``bytecp.resharders`` entry point
    instead (see :mod:`bytecp.plugins`)."""
    if not isinstance(kind, str) or not kind or kind.startswith("hook:"):
        raise ConfigError(f"a resharder's kind must be a name such as 'torchdata', got {kind!r}")
    if isinstance(resharder, type):
        resharder = resharder()
    if isinstance(resharder, Resharder) and resharder.kind != kind:
        resharder.kind = kind
    with _lock:
        _RESHARDERS[kind] = (resharder, needs)


def _resolve(kind: str) -> Resharder | None:
    with _lock:
        entry, needs = _RESHARDERS[kind]
    if needs is not None and needs not in sys.modules:
        return None  # its framework is not imported: no object of it can exist
    if isinstance(entry, Resharder):
        return entry
    module, _, attr = entry.partition(":")
    try:
        made = getattr(importlib.import_module(module), attr)
    except ImportError:
        return None
    found: Resharder = made() if isinstance(made, type) else made
    found.kind = kind
    with _lock:
        if _RESHARDERS.get(kind, (None,))[0] == entry:
            _RESHARDERS[kind] = (found, needs)
    return found


def _discover() -> bool:
    global _discovered
    with _lock:
        if _discovered:
            return False
        _discovered = True
        added = {k: v for k, v in entry_point_targets(RESHARDERS_GROUP).items() if k not in _RESHARDERS}
        for kind, target in added.items():
            _RESHARDERS[kind] = (target, None)
        return bool(added)


def unwrap(obj: Any) -> Any:
    """The object a ``bytecp.PerRankState`` wraps (else ``obj``)."""
    from bytecp.extras import PerRankState

    return obj.obj if isinstance(obj, PerRankState) else obj


def has_hook(obj: Any) -> bool:
    """Whether ``obj`` has the documented ``reshard(saved, rank, world_size)``
    method (``nn.Module.reshard`` of FSDP takes none, and modules are never data)."""
    import torch

    fn = getattr(obj, "reshard", None)
    if not callable(fn) or isinstance(obj, torch.nn.Module):
        return False
    try:
        inspect.signature(fn).bind(None, 0, 1)
    except (TypeError, ValueError):
        return False
    return True


class _Hook(Resharder):
    """An object's own ``reshard`` method (and ``data_position``, if any)."""

    def __init__(self, cls: type) -> None:
        self.kind = f"hook:{cls.__module__}.{cls.__qualname__}"

    def detect(self, obj: Any) -> bool:
        return has_hook(obj)

    def position(self, obj: Any, state: Any) -> dict[str, Any]:
        fn = getattr(obj, "data_position", None)
        return dict(fn()) if callable(fn) else {}

    def reshard(self, obj: Any, saved: SavedData, rank: int, world_size: int) -> Any:
        return obj.reshard(saved, rank, world_size)


def resharder_for(obj: Any) -> Resharder | None:
    """(every rank) The resharder of ``obj`` (a ``PerRankState`` is looked
    through): its own ``reshard`` method first, then the registered kinds in
    order (the installed entry points are read once, on the first miss)."""
    obj = unwrap(obj)
    if has_hook(obj):
        return _Hook(type(obj))
    while True:
        with _lock:
            kinds = list(_RESHARDERS)
        for kind in kinds:
            r = _resolve(kind)
            if r is not None and r.detect(obj):
                return r
        if not _discover():
            return None


def looks_like_loader(obj: Any) -> bool:
    """A stateful object whose class name says it is a data loader (saved per rank)."""
    obj = unwrap(obj)
    return (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
            and "dataloader" in type(obj).__name__.lower())


def claims(obj: Any) -> bool:
    """(every rank, save and load) Whether ``obj`` is a data source saved per
    rank: a loader by its class name, or an object a resharder handles."""
    return looks_like_loader(obj) or resharder_for(obj) is not None


def position_of(obj: Any, state: Any) -> dict[str, Any] | None:
    """(every rank, save) ``obj``'s position (``"kind"`` added) for the state
    it just returned; ``{"kind": None, "type": ...}`` for a data loader no
    resharder knows (a load under another layout then refuses it); None for
    per-rank values that are not data (RNG states)."""
    r = resharder_for(obj)
    inner = unwrap(obj)
    if r is None:
        if not looks_like_loader(obj):
            return None
        return {"kind": None, "type": f"{type(inner).__module__}.{type(inner).__qualname__}"}
    pos = dict(r.position(inner, state))
    pos["kind"] = r.kind
    if not is_json_leaf(pos):
        raise ConfigError(f"the {r.kind} resharder's position of {type(inner).__name__} is not JSON-able "
                          f"(ints, floats, strings, lists, dicts): {pos!r:.200}")
    return pos
