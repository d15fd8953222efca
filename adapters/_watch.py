"""A save's description of modules and optimizers, kept while their structure is unchanged.

Describing a state -- its state dicts, the names of its tensors, the tree
the core flattens -- costs tens of microseconds per tensor, on the training
thread, at every save; a rank of a mixture-of-experts model holds tens of
thousands of tensors. Between two saves of a training job almost nothing
of it changes: the same modules hold the same parameter objects in the
same memory, the optimizer the same state tensors; only their values move
(in place) and a few plain values (the learning rate, a step counter). So
the module adapters (plain, DDP, FSDP2: those whose class says
``reuses_descriptions``) keep each module's and each optimizer's flattened
description (a :class:`~bytecp.tree.state.Prebuilt` piece) and, at the next
save, check only what the description is made of:

- a module tree (:class:`ModuleWatch`): each module's class, its
  ``_modules``, ``_parameters`` and ``_buffers`` (the same dicts holding the
  same keys and the same objects), its non-persistent buffer names and its
  state-dict hooks; and per tensor, its memory (``is_set_to`` the view taken
  when it was described: the same storage, offset, sizes and strides, so a
  ``.data =`` swap or a reshape is seen), its data pointer (a storage
  reallocated in place) and its dtype; a DTensor's local tensor and layout
  (``_spec``) by identity, its local tensor's memory;
- an optimizer (:class:`OptimizerWatch`): its parameter groups' parameters,
  its state's parameters, each state's keys, the very tensor objects in
  them with their memory and dtype, and that its other values are still
  plain scalars (read afresh at every save, with the groups' hyperparameters).

Any difference, and the whole state is described afresh (and the pieces
built again). What is not a module or an optimizer at the top of the state
(dataloaders, RNG, counters, user dicts) is described afresh at every save.
A module whose state dict is not made by ``nn.Module`` alone -- a class
overriding ``state_dict``, ``_save_to_state_dict`` or ``get_extra_state``, a
state-dict hook (FSDP2's own pre-hook, a no-op on a module whose
parameters are the sharded ones it had, excepted), or an optimizer with
state-dict hooks or another ``state_dict`` -- is never kept: its state is
described at every save, as it always was.

The checks run in C loops over lists of the objects kept (``map``, list
comparison): about a microsecond per tensor. Objects are kept alive while
their description is (their ids stay unique); the modules and optimizers at
the top of the state are held weakly, and their descriptions dropped with
them.

Called by :class:`~bytecp.adapters.plain.PlainAdapter.save_tree` (every
rank, the save pipeline's describe phase, inside
:func:`bytecp.adapter_api.looking`: each watch checks once per look), and
by the module adapters' ``detect`` and ``parallelism`` (:func:`holds_module`,
:func:`holds_parameter`, :func:`parameters`), which then walk no module
tree whose structure is known.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from bytecp.adapter_api import Adapter, AdapterCall, current_look, keeps_descriptions
from bytecp.dist import DistContext
from bytecp.tree.skeleton import key_ok
from bytecp.tree.state import Prebuilt, prebuild

__all__ = [
    "ModuleWatch", "OptimizerWatch", "DescribeStats", "DESCRIBE_STATS", "reuses", "describe", "parameters",
    "holds_module", "holds_parameter", "forget_all",
]

_chain = itertools.chain.from_iterable
_DICTS = operator.attrgetter("_modules", "_parameters", "_buffers")
_NON_PERSISTENT = operator.attrgetter("_non_persistent_buffers_set")
_HOOKS = operator.attrgetter("_state_dict_pre_hooks", "_state_dict_hooks")
_DTYPE = operator.attrgetter("dtype")
_LOCAL = operator.attrgetter("_local_tensor")
_SPEC = operator.attrgetter("_spec")
_IS_SET_TO = torch.Tensor.is_set_to
_PTR = torch.Tensor.data_ptr
#: non-tensor optimizer-state values read afresh at every save (anything else: described afresh)
_SCALARS = frozenset({int, float, bool, str, type(None)})


def reuses(cls: type) -> bool:
    """Whether adapter class ``cls`` itself (not a base class) says its
    description of a module or an optimizer depends only on what the watches
    check (``reuses_descriptions = True`` in the class body)."""
    return bool(cls.__dict__.get("reuses_descriptions", False))


# -- tensors -----------------------------------------------------------------
def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t) is not torch.Tensor and type(t) is not nn.Parameter and hasattr(t, "_local_tensor")


class _Memory:
    """The memory and dtype of tensors as described: plain tensors by a view
    taken then (``is_set_to``), DTensors by their local tensor and layout."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        plain: list[torch.Tensor] = []
        dts: list[torch.Tensor] = []
        for t in tensors:
            (dts if _is_dtensor(t) else plain).append(t)
        self.plain, self.dts = plain, dts
        self.refs = [t.detach() for t in plain]
        self.dtypes = list(map(_DTYPE, plain))
        #: data pointers: a storage reallocated in place (``untyped_storage().resize_``) is still
        #: ``is_set_to`` its view, but the piece's shards name the old address
        self.ptrs = list(map(_PTR, plain))
        self.locals = list(map(_LOCAL, dts))
        self.specs = list(map(_SPEC, dts))
        self.local_refs = [t.detach() for t in self.locals]
        self.local_dtypes = list(map(_DTYPE, self.locals))
        self.local_ptrs = list(map(_PTR, self.locals))

    def same(self) -> bool:
        if (not all(map(_IS_SET_TO, self.plain, self.refs)) or list(map(_DTYPE, self.plain)) != self.dtypes
                or list(map(_PTR, self.plain)) != self.ptrs):
            return False
        if not self.dts:
            return True
        return (list(map(id, map(_LOCAL, self.dts))) == list(map(id, self.locals))
                and list(map(id, map(_SPEC, self.dts))) == list(map(id, self.specs))
                and all(map(_IS_SET_TO, self.locals, self.local_refs))
                and list(map(_DTYPE, self.locals)) == self.local_dtypes
                and list(map(_PTR, self.locals)) == self.local_ptrs)


# -- modules -----------------------------------------------------------------
_CLASS_OK: dict[type, bool] = {}


def _class_ok(cls: type) -> bool:
    """Whether instances of ``cls`` make their state dict as ``nn.Module`` does."""
    ok = _CLASS_OK.get(cls)
    if ok is None:
        ok = (getattr(cls, "state_dict", None) is nn.Module.state_dict
              and getattr(cls, "_save_to_state_dict", None) is nn.Module._save_to_state_dict
              and getattr(cls, "get_extra_state", nn.Module.get_extra_state) is nn.Module.get_extra_state)
        if len(_CLASS_OK) < 4096:
            _CLASS_OK[cls] = ok
    return ok


def _idempotent_pre_hook(hook: Any) -> bool:
    """FSDP2's state-dict pre-hook: it reshards the parameters, nothing when
    they are the sharded ones already (which the watch checks)."""
    fn = getattr(hook, "__func__", hook)
    return (getattr(fn, "__module__", "").startswith("torch.distributed.fsdp._fully_shard")
            and getattr(fn, "__name__", "") == "to_sharded_hook")


def _once_per_look(watch: ModuleWatch | OptimizerWatch) -> bool:
    """``watch._check()``, asked once per look at the live state (outside a look: every time)."""
    look = current_look()
    seen, answer = watch._memo  # (one attribute: a describe on another thread never mixes two)
    if look is None or seen is not look:
        answer = watch._check()
        watch._memo = (look, answer)
    return answer


class ModuleWatch:
    """A module tree's structure and tensors as a save described them.

    The root is held weakly (its description dies with it), everything
    below strongly (so no other object takes their ids)."""

    def __init__(self, root: nn.Module) -> None:
        visits: list[nn.Module] = []  # in state_dict's order, a module reached twice visited twice

        def visit(m: nn.Module) -> None:
            visits.append(m)
            for child in m._modules.values():
                if child is not None:
                    visit(child)

        visit(root)
        self._root = weakref.ref(root)
        self._below = visits[1:]
        self.types = list(map(type, visits))
        self.describable = all(map(_class_ok, set(self.types)))
        dicts = list(_chain(map(_DICTS, visits)))
        self._dicts = dicts
        self._dict_ids = list(map(id, dicts))
        self._lens = list(map(len, dicts))
        # what the non-empty dicts hold (the others are checked empty by their lengths); once their
        # keys are the same, each value is looked up by its key in its dict (``_owner``: each key's dict)
        full_at = [i for i, n in enumerate(self._lens) if n]
        self._full = _getter(full_at)
        self._owner = _getter([i for i in full_at for _ in range(self._lens[i])])
        self._keys = list(_chain(self._full(dicts)))
        self._values = list(_chain(map(dict.values, self._full(dicts))))
        self._value_ids = list(map(id, self._values))
        # the non-persistent buffer names and the state-dict hooks: the containers themselves, which torch
        # changes in place (never replaced once a module is built), and what they held
        self._np_sets = list(map(_NON_PERSISTENT, visits))
        self._non_persistent = [set(s) for s in self._np_sets]
        # hooks: how many each module has, pre and post (a hook added or removed changes a count), and which
        self._hook_dicts = list(_chain(map(_HOOKS, visits)))
        self._hook_counts = list(map(len, self._hook_dicts))
        self._hooked = [i for i in range(len(visits)) if self._hook_counts[2 * i]]
        self._hooks = [h for i in self._hooked for h in visits[i]._state_dict_pre_hooks.values()]
        if any(self._hook_counts[1::2]) or not all(map(_idempotent_pre_hook, self._hooks)):
            self.describable = False
        tensors: dict[int, torch.Tensor] = {}
        for m, np in zip(visits, self._non_persistent, strict=True):
            for p in m._parameters.values():
                if p is not None:
                    tensors.setdefault(id(p), p)
            for name, b in m._buffers.items():
                if b is not None and name not in np:
                    tensors.setdefault(id(b), b)
        self._memory = _Memory(tensors.values())
        #: the modules below the root and the parameters, each once, as ``modules()`` and ``parameters()`` give them
        self.unique_modules = list(root.modules())[1:]
        self.unique_parameters = list(root.parameters())
        #: (the look it was last asked in, the answer)
        self._memo: tuple[object | None, bool] = (None, False)
        #: answers about the tree's structure (which classes its modules are of, ...), kept with it
        self.facts: dict[Any, Any] = {}

    @property
    def root(self) -> nn.Module | None:
        return self._root()


    def unchanged(self) -> bool:
        """Whether the tree is as described (asked once per look at the live state)."""
        return _once_per_look(self)

    def _check(self) -> bool:
        root = self._root()
        if root is None:
            return False
        visits = [root, *self._below]
        if list(map(type, visits)) != self.types:
            return False
        dicts = list(_chain(map(_DICTS, visits)))
        if list(map(id, dicts)) != self._dict_ids or list(map(len, dicts)) != self._lens:
            return False
        if list(_chain(self._full(dicts))) != self._keys:
            return False
        if list(map(id, map(dict.__getitem__, self._owner(dicts), self._keys))) != self._value_ids:
            return False
        if self._np_sets != self._non_persistent or list(map(len, self._hook_dicts)) != self._hook_counts:
            return False
        hooks = [h for i in self._hooked for h in visits[i]._state_dict_pre_hooks.values()]
        if list(map(id, hooks)) != list(map(id, self._hooks)):
            return False
        return self._memory.same()


_WATCHES: weakref.WeakKeyDictionary[nn.Module, ModuleWatch] = weakref.WeakKeyDictionary()
_lock = threading.RLock()


def _known(root: nn.Module) -> ModuleWatch | None:
    with _lock:
        w = _WATCHES.get(root)
    return w if w is not None and w.unchanged() else None


def parameters(root: nn.Module) -> list[torch.Tensor]:
    """``list(root.parameters())``, without walking a tree whose structure is known."""
    w = _known(root)
    return list(w.unique_parameters) if w is not None else list(root.parameters())


def holds_module(root: nn.Module, cls: type | tuple[type, ...]) -> bool:
    """Whether a module of ``root``'s tree is a ``cls`` (an adapter's
    ``detect``), answered once while the tree's structure is known."""
    w = _known(root)
    if w is None:
        return any(isinstance(m, cls) for m in root.modules())
    key = ("module", cls)
    if key not in w.facts:
        w.facts[key] = isinstance(root, cls) or any(isinstance(m, cls) for m in w.unique_modules)
    return bool(w.facts[key])


def holds_parameter(root: nn.Module, test: Callable[[torch.Tensor], bool]) -> bool:
    """Whether a parameter of ``root`` passes ``test`` (a module-level
    function: the answer is kept by it), answered once while the tree's
    structure is known."""
    w = _known(root)
    if w is None:
        return any(test(p) for p in root.parameters())
    key = ("parameter", test)
    if key not in w.facts:
        w.facts[key] = any(test(p) for p in w.unique_parameters)
    return bool(w.facts[key])


# -- optimizers ----------------------------------------------------------------
def _optimizer_ok(opt: torch.optim.Optimizer) -> bool:
    cls = type(opt)
    return (getattr(cls, "state_dict", None) is torch.optim.Optimizer.state_dict
            and not getattr(opt, "_optimizer_state_dict_pre_hooks", None)
            and not getattr(opt, "_optimizer_state_dict_post_hooks", None))


class OptimizerWatch:
    """An optimizer's parameters and state as a save described them; its
    plain values (hyperparameters, scalar state) are read at every save.

    ``fqns``: each parameter's FQN in the state tree (the adapter's
    ``param_state``), in the order of its parameter groups."""

    def __init__(self, opt: torch.optim.Optimizer, key: str, fqns: Sequence[str]) -> None:
        self._opt = weakref.ref(opt)
        self.describable = _optimizer_ok(opt)
        groups = opt.param_groups
        self._params = list(_chain(g["params"] for g in groups))
        self._param_ids = list(map(id, self._params))
        pos = 0
        self._group_fqns: list[list[str]] = []
        for g in groups:
            self._group_fqns.append(list(fqns[pos:pos + len(g["params"])]))
            pos += len(g["params"])
        by_param = dict(zip(self._param_ids, fqns, strict=True))
        state = opt.state
        self._state_keys = list(state)
        self._state_key_ids = list(map(id, self._state_keys))
        self._inners = list(state.values())
        self._inner_ids = list(map(id, self._inners))
        self._inner_keys = list(_chain(self._inners))
        values = list(_chain(map(dict.values, self._inners)))
        tensors: list[int] = []
        scalars: list[int] = []
        self._scalar_fqns: list[str] = []
        i = 0
        for p, inner in zip(self._state_keys, self._inners, strict=True):
            fqn = by_param.get(id(p))
            for k, v in inner.items():
                if isinstance(v, torch.Tensor):
                    tensors.append(i)
                elif type(v) in _SCALARS and fqn is not None:
                    scalars.append(i)
                    self._scalar_fqns.append(f"{key}.state.{fqn}.{k}")
                else:  # a container or another object: walked as a tree of its own at every save
                    self.describable = False
                i += 1
            if fqn is None:
                self.describable = False
        self._tensor_at = _getter(tensors)
        self._scalar_at = _getter(scalars)
        self._tensors = self._tensor_at(values)
        self._tensor_ids = list(map(id, self._tensors))
        self._memory = _Memory(self._tensors)
        self._groups_fqn = f"{key}.param_groups"
        #: (the look it was last asked in, the answer)
        self._memo: tuple[object | None, bool] = (None, False)


    def unchanged(self) -> bool:
        """Whether the parameters and the state are as described (once per look)."""
        return _once_per_look(self)

    def _check(self) -> bool:
        opt = self._opt()
        if opt is None or not _optimizer_ok(opt):
            return False
        if list(map(id, _chain(g["params"] for g in opt.param_groups))) != self._param_ids:
            return False
        if [len(g["params"]) for g in opt.param_groups] != list(map(len, self._group_fqns)):
            return False
        state = opt.state
        if list(map(id, state)) != self._state_key_ids:
            return False
        inners = list(state.values())
        if list(map(id, inners)) != self._inner_ids or list(_chain(inners)) != self._inner_keys:
            return False
        values = list(_chain(map(dict.values, inners)))
        if list(map(id, self._tensor_at(values))) != self._tensor_ids:
            return False
        if not set(map(type, self._scalar_at(values))) <= _SCALARS:
            return False
        return self._memory.same()

    def objects(self) -> tuple[dict[str, Any], tuple[Any, ...]]:
        """(after :meth:`unchanged`) This save's plain values by FQN, as the
        adapter's tree holds them (scalar state first, then the groups), and
        the lists of FQNs inside them, kept between saves and never mutated."""
        opt = self._opt()
        assert opt is not None
        out: dict[str, Any] = {}
        if self._scalar_fqns:
            values = list(_chain(map(dict.values, opt.state.values())))
            out.update(zip(self._scalar_fqns, self._scalar_at(values), strict=True))
        groups = []
        for g, names in zip(opt.param_groups, self._group_fqns, strict=True):
            g2 = {k: v for k, v in g.items() if k != "params"}
            g2["params"] = names
            groups.append(g2)
        out[self._groups_fqn] = groups
        return out, tuple(self._group_fqns)


def _getter(positions: Sequence[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """The items of a sequence at ``positions``, as a tuple (in C)."""
    if not positions:
        return lambda values: ()
    if len(positions) == 1:
        (i,) = positions
        return lambda values: (values[i],)
    return operator.itemgetter(*positions)


# -- one state's description -------------------------------------------------
@dataclasses.dataclass
class _Entry:
    """The description of one state: its keys, the modules and optimizers at
    its top (weakly), their watches and pieces."""

    keys: list[Any]
    refs: dict[Any, weakref.ref[Any]]
    watches: dict[Any, ModuleWatch | OptimizerWatch]
    pieces: dict[Any, Prebuilt]
    param_names: dict[int, str]

    def holds(self, state: dict[str, Any]) -> bool:
        """(the cached describe) The same keys, the same modules and
        optimizers under them, nothing else turned into one, each unchanged."""
        if list(state) != self.keys:
            return False
        for k, v in state.items():
            ref = self.refs.get(k)
            if ref is None:
                if isinstance(v, (nn.Module, torch.optim.Optimizer)):
                    return False
            elif ref() is not v:
                return False
        return all(w.unchanged() for w in self.watches.values())


@dataclasses.dataclass
class DescribeStats:
    """How this process's saves described their state (read by tests and
    benchmarks): from the pieces kept, or afresh (pieces then kept or not)."""

    kept: int = 0
    described: int = 0


#: counted by :func:`describe`
DESCRIBE_STATS = DescribeStats()

#: descriptions kept, by (adapter class, rank, world size, the ids of the state's modules and optimizers)
_ENTRIES: dict[tuple[Any, ...], _Entry] = {}
_MAX_ENTRIES = 8


def _key(adapter: Adapter, state: dict[str, Any], ctx: DistContext) -> tuple[Any, ...]:
    held = tuple(id(v) for v in state.values() if isinstance(v, (nn.Module, torch.optim.Optimizer)))
    return (type(adapter), ctx.rank, ctx.world_size, held)


def _drop(key: tuple[Any, ...]) -> Callable[[Any], None]:
    def drop(_: Any) -> None:
        with _lock:
            _ENTRIES.pop(key, None)

    return drop


def forget_all() -> None:
    """Drop every kept description (the next save of each state describes it afresh)."""
    with _lock:
        _ENTRIES.clear()
        _WATCHES.clear()


def describe(adapter: Any, state: dict[str, Any], ctx: DistContext) -> dict[Any, Any]:
    """(every rank, describe) The adapter's state tree, each module and
    optimizer at the top of ``state`` as its :class:`Prebuilt` piece: the one
    kept from the last save when nothing it is made of changed, else
    described afresh and kept; everything else described afresh."""
    if not keeps_descriptions():  # a follower's walk: nothing kept, nothing reused
        with _lock:
            DESCRIBE_STATS.described += 1
        call = adapter.begin(state, ctx, None)
        return {k: adapter._save_value(call, v) for k, v in state.items()}
    key = _key(adapter, state, ctx)
    with _lock:
        entry = _ENTRIES.get(key)
        if entry is not None and entry.holds(state):
            DESCRIBE_STATS.kept += 1
            call = AdapterCall(state, ctx, None, {}, dict(entry.param_names))
            tree: dict[Any, Any] = {}
            for k, v in state.items():
                piece = entry.pieces.get(k)
                w = entry.watches.get(k)
                if piece is None:
                    tree[k] = adapter._save_value(call, v)
                elif isinstance(w, OptimizerWatch):
                    objects, shared = w.objects()
                    tree[k] = piece.with_objects(objects, shared)
                else:
                    tree[k] = piece
            return tree
        _ENTRIES.pop(key, None)
        DESCRIBE_STATS.described += 1
    call = adapter.begin(state, ctx, None)
    tree = {k: adapter._save_value(call, v) for k, v in state.items()}
    entry = _build(adapter, call, state, tree, key)
    if entry is None:
        return tree
    with _lock:
        while len(_ENTRIES) >= _MAX_ENTRIES:
            _ENTRIES.pop(next(iter(_ENTRIES)))
        _ENTRIES[key] = entry
    return {k: entry.pieces.get(k, sub) for k, sub in tree.items()}


def _build(adapter: Any, call: AdapterCall, state: dict[str, Any], tree: dict[Any, Any],
           key: tuple[Any, ...]) -> _Entry | None:
    """The entry (under ``key``) for ``state`` just described as ``tree``, or
    None when a module or an optimizer of it cannot be kept (see the module's
    docstring). The entry goes when one of them is collected."""
    watches: dict[Any, ModuleWatch | OptimizerWatch] = {}
    pieces: dict[Any, Prebuilt] = {}
    refs: dict[Any, weakref.ref[Any]] = {}
    for k, v in state.items():
        if not isinstance(v, (nn.Module, torch.optim.Optimizer)):
            continue
        if not key_ok(k) or type(k) is not str:
            return None
        w: ModuleWatch | OptimizerWatch
        shared: tuple[Any, ...] = ()
        if isinstance(v, nn.Module):
            mw = ModuleWatch(v)
            with _lock:
                _WATCHES[v] = mw
            w = mw
        else:
            params = [p for g in v.param_groups for p in g["params"]]
            fqns: list[str] = []
            for i, p in enumerate(params):
                places = adapter.param_state(call, i, p)
                if len(places) != 1:
                    return None
                fqns.append(places[0].fqn)
            ow = OptimizerWatch(v, k, fqns)
            w, shared = ow, tuple(ow._group_fqns)
        if not w.describable:
            return None
        piece = prebuild(tree[k], k, shared=shared)
        if isinstance(w, OptimizerWatch) and set(piece.flat.objects) != {*w._scalar_fqns, w._groups_fqn}:
            return None  # not the tree optimizer_tree makes: never kept
        watches[k], pieces[k], refs[k] = w, piece, weakref.ref(v, _drop(key))
    return _Entry(list(state), refs, watches, pieces, dict(call.param_names))
