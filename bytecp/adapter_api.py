"""What a framework adapter provides, and the registry that finds one.

Adapters live in ``bytecp.adapters`` and are named here as
``"module:Class"`` strings, imported only when needed; the core never
imports a framework. Call order (all ranks):

save: ``detect(state)`` -> ``save_tree(state, ctx)`` -> the core flattens,
plans and writes the tree -> ``parallelism(state, ctx)`` is recorded in the
metadata.
load: ``detect`` -> the core reads the metadata -> ``load_tree(state, ctx,
md)`` returns the target tree and a ``finalize`` callback -> the core fills
the target tensors in place and rebuilds slots -> ``finalize(values)``
hands modules/optimizers/stateful objects their loaded state.

Writing one, its replica hints and its contract suite
(``bytecp.adapters.testing``): docs/extending.md.
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import dataclasses
import importlib
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from bytecp.dist import DistContext
from bytecp.errors import ConfigError
from bytecp.format.metadata import Metadata
from bytecp.plugins import ADAPTERS_GROUP, entry_point_targets
from bytecp.tree.skeleton import Node

__all__ = [
    "Adapter", "AdapterCall", "LoadTarget", "register_adapter", "get_adapter", "detect_adapter", "excluded",
    "excluding", "looking", "current_look", "describing_once", "keeps_descriptions",
]

Finalize = Callable[[dict[str, Any]], None]


#: the names the load in progress leaves out (``bytecp.load(..., exclude=)``), set by the load pipeline
_EXCLUDED: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("bytecp_excluded", default=())


def excluded(fqn: str, names: Sequence[str] | None = None) -> bool:
    """Whether ``fqn`` is left out of the load in progress: one of the names
    given to ``exclude=`` (or ``names``), or under one (``name.`` or, for the
    ``/``-named entries of other formats -- Megatron's ``rng_state/shard_0.0_1.2``
    -- ``name/``).

    (an adapter's ``load_tree`` and finalizer, every rank) The core leaves
    the state's own entries under those names alone; an adapter that adds
    entries of its own (a DeepSpeed engine's optimizer, its counters) builds
    no target for an excluded one."""
    for n in _EXCLUDED.get() if names is None else names:
        if fqn == n or fqn.startswith((n + ".", n + "/")):
            return True
    return False


@contextlib.contextmanager
def excluding(names: Sequence[str]) -> Iterator[None]:
    """(the load pipeline) :func:`excluded` answers for ``names`` inside."""
    token = _EXCLUDED.set(tuple(names))
    try:
        yield
    finally:
        _EXCLUDED.reset(token)


#: the look at the live state in progress (a save's describe phase), if any
_LOOK: contextvars.ContextVar[object | None] = contextvars.ContextVar("bytecp_look", default=None)


@contextlib.contextmanager
def looking() -> Iterator[None]:
    """(the save pipeline's describe phase, every rank) One look at the live
    state: nothing changes it inside, so an adapter may check what a module
    or an optimizer is made of once and reuse the answer for ``detect``,
    ``save_tree`` and ``parallelism`` (:func:`current_look` names the look)."""
    token = _LOOK.set(object())
    try:
        yield
    finally:
        _LOOK.reset(token)


def current_look() -> object | None:
    """(adapters) The look in progress (a new object for each), or None outside one."""
    return _LOOK.get()


#: whether an adapter may keep the description it makes for the next save (False inside describing_once)
_KEEP: contextvars.ContextVar[bool] = contextvars.ContextVar("bytecp_keep_descriptions", default=True)


@contextlib.contextmanager
def describing_once() -> Iterator[None]:
    """(a follower's walk of the state it serves, :func:`bytecp.serving.staging.state_boxes`)
    Adapters describe the state inside afresh and keep nothing of it: a
    description kept between saves holds views of the state's tensors, and a
    follower swaps their storages, which it does only where nothing else holds them."""
    token = _KEEP.set(False)
    try:
        yield
    finally:
        _KEEP.reset(token)


def keeps_descriptions() -> bool:
    """(adapters that keep descriptions between saves) False inside :func:`describing_once`."""
    return _KEEP.get()


class LoadTarget:
    """A target tree plus the callback that applies rebuilt values.

    ``elsewhere``: names (dotted prefixes) that other ranks of the job load
    and this one does not hold at all -- a pipeline stage's view of the other
    stages' layers. A strict load does not count what the checkpoint holds
    under them as unexpected on this rank; nothing under them is read here.
    """

    def __init__(self, tree: Any, finalize: Finalize, elsewhere: Sequence[str] = (),
                 check: Finalize | None = None) -> None:
        self.tree = tree
        self.finalize = finalize
        self.elsewhere = tuple(elsewhere)
        #: called with the values rebuilt at matching (objects read, tensors not yet), before any tensor
        #: is read: a :class:`~bytecp.errors.StateMismatchError` there refuses the load, the state untouched
        self.check = check


@dataclasses.dataclass
class AdapterCall:
    """The per-call state of an adapter: one save or load on one rank.

    Adapters are stateless between calls (one instance may serve several
    saves, even concurrently with a background save): everything a call
    learns about the live state lives here and dies with the call.
    Framework adapters subclass it for their own per-call facts.
    """

    state: dict[str, Any]
    dist: DistContext
    #: the checkpoint being loaded (None on save)
    md: Metadata | None = None
    #: its skeleton by FQN (empty on save)
    nodes: dict[str, Node] = dataclasses.field(default_factory=dict)
    #: ``id(param) -> FQN`` for the parameters an optimizer may hold
    param_names: dict[int, str] = dataclasses.field(default_factory=dict)


class Adapter(abc.ABC):
    """Turns one framework's training state into the core's state tree.

    Implementations keep no per-call state on ``self`` (see :class:`AdapterCall`).
    """

    #: the name recorded as the checkpoint's framework
    name: str = "?"
    #: whether every in-place change of this framework's tensors moves their
    #: version counter (``tensor._version``); False where it writes through
    #: ``.data``: incremental saves then write every box
    tracks_versions: bool = True

    @classmethod
    @abc.abstractmethod
    def detect(cls, state: dict[str, Any]) -> bool:
        """Whether this adapter handles ``state`` (called on every rank)."""

    @abc.abstractmethod
    def save_tree(self, state: dict[str, Any], ctx: DistContext) -> Any:
        """The state tree to save (views of the live tensors, no copies)."""

    @abc.abstractmethod
    def load_tree(self, state: dict[str, Any], ctx: DistContext, md: Metadata) -> LoadTarget:
        """Target tree whose tensors are filled in place, and the finalizer."""

    def parallelism(self, state: dict[str, Any], ctx: DistContext) -> dict[str, Any]:
        """How the saving job was parallelized (recorded, shown by ``inspect``)."""
        return {"world_size": ctx.world_size}


_ADAPTERS: dict[str, str | type[Adapter]] = {
    "megatron": "bytecp.adapters.megatron.adapter:MegatronAdapter",
    "deepspeed": "bytecp.adapters.deepspeed:DeepSpeedAdapter",
    "fsdp1": "bytecp.adapters.fsdp1:FSDP1Adapter",
    "fsdp2": "bytecp.adapters.fsdp2:FSDP2Adapter",
    "ddp": "bytecp.adapters.ddp:DDPAdapter",
    "plain": "bytecp.adapters.plain:PlainAdapter",
}
#: detection order: most specific first; "plain" accepts anything
_ORDER = ["megatron", "deepspeed", "fsdp1", "fsdp2", "ddp", "plain"]
#: a built-in adapter's framework module: while the process has not imported
#: it, no state can hold that framework's objects, so detection skips the
#: adapter without importing it (``torch.distributed.fsdp`` pulls in DTensor
#: and sympy: about 0.7 s on a plain module's first load)
_NEEDS = {"megatron": "megatron.core", "deepspeed": "deepspeed", "fsdp1": "torch.distributed.fsdp",
          "fsdp2": "torch.distributed.tensor"}
_BUILT_IN = dict(_ADAPTERS)
#: the adapter that accepts any state: reaching it in detection is a miss
_CATCH_ALL = "plain"
#: guards ``_ADAPTERS``, ``_ORDER`` and ``_discovered`` (registrations may come from any thread)
_lock = threading.RLock()
_discovered = False


def register_adapter(name: str, adapter: str | type[Adapter], *, before: str | None = "plain") -> None:
    """Add an adapter (``"module:Class"`` or a class), tried before ``before``.

    (any thread, any time before the save or load that needs it) Registering
    a known name replaces its adapter and keeps its place in the detection
    order; ``before=None`` (or an unknown name) appends it. Installed
    packages may instead declare an entry point in the ``bytecp.adapters``
    group (see :mod:`bytecp.plugins`).
    """
    with _lock:
        _ADAPTERS[name] = adapter
        if name not in _ORDER:
            _ORDER.insert(_ORDER.index(before) if before in _ORDER else len(_ORDER), name)


def _discover() -> bool:
    """Register the installed ``bytecp.adapters`` entry points once per
    process (the first lookup that misses); whether any name was added."""
    global _discovered
    with _lock:
        if _discovered:
            return False
        _discovered = True
        added = [n for n in entry_point_targets(ADAPTERS_GROUP).items() if n[0] not in _ADAPTERS]
        for name, target in added:
            register_adapter(name, target)
        return bool(added)


def _resolve(name: str) -> type[Adapter] | None:
    with _lock:
        entry = _ADAPTERS[name]
    if not isinstance(entry, str):
        return entry
    module, _, attr = entry.partition(":")
    try:
        cls: type[Adapter] = getattr(importlib.import_module(module), attr)
    except ImportError:
        return None  # the framework is not installed: it cannot be in use
    with _lock:
        if _ADAPTERS.get(name) == entry:  # unless re-registered meanwhile
            _ADAPTERS[name] = cls
    return cls


def get_adapter(name: str) -> Adapter:
    """A new instance of the adapter registered as ``name`` (``framework=``)."""
    with _lock:
        known = name in _ADAPTERS
    if not known and _discover():
        with _lock:
            known = name in _ADAPTERS
    if not known:
        with _lock:
            names = sorted(_ADAPTERS)
        raise ConfigError(
            f"unknown framework {name!r}; known: {names} (register others with "
            "bytecp.adapter_api.register_adapter or a 'bytecp.adapters' entry point)"
        )
    cls = _resolve(name)
    if cls is None:
        raise ConfigError(f"framework {name!r} is not available here (its package failed to import)")
    return cls()


def detect_adapter(state: dict[str, Any], framework: str | None = None) -> Adapter:
    """The adapter for ``framework`` if given, else the first that detects ``state``.

    (every rank, once per save or load) Reaching the catch-all ``plain``
    reads the installed entry points first (once per process) and tries
    the adapters they add.
    """
    if framework is not None:
        return get_adapter(framework)
    tried: set[str] = set()
    while True:
        with _lock:
            order = list(_ORDER)
        for name in order:
            if name in tried:
                continue
            if name == _CATCH_ALL and _discover():
                break  # entry-point adapters come before the catch-all: look again
            tried.add(name)
            with _lock:
                unused = _ADAPTERS[name] == _BUILT_IN.get(name) and _NEEDS.get(name, "sys") not in sys.modules
            if unused:
                continue
            cls = _resolve(name)
            if cls is not None and cls.detect(state):
                return cls()
        else:
            raise ConfigError("no adapter accepts this state")  # pragma: no cover - plain accepts all
