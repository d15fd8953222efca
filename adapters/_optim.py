"""Optimizer state keyed by parameter FQN, shared by every adapter.

``optim.state.<param fqn>.<key>`` in the checkpoint, whatever framework
saved it, so optimizer state reshards like the parameters and loads under
any other framework. Each adapter answers one question through
:class:`ParamState`: *where does this parameter's state live* -- under which
FQN(s), as which leaf (a full tensor, a DTensor's box, a flat shard cut into
the original parameters' ranges), and how to allocate a local state tensor
when the optimizer has none yet. Everything else -- walking
``optimizer.state_dict()``, param groups named by FQN, filling the
optimizer's existing state tensors in place on load -- is written once here.

Called by the adapters' ``save_tree`` (:func:`optimizer_tree`) and
``load_tree`` (:func:`optimizer_target`), on every rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from bytecp.errors import CorruptCheckpointError, StateMismatchError
from bytecp.format.metadata import Metadata
from bytecp.tree.dtypes import dtype_from_name
from bytecp.tree.skeleton import Node
from bytecp.tree.state import Slot, Whole

__all__ = ["ParamState", "optimizer_tree", "optimizer_target", "param_groups_for_load", "check_group"]

Finalize = Callable[[dict[str, Any]], None]


@dataclasses.dataclass(frozen=True)
class ParamState:
    """Where the optimizer state of one parameter lives in the checkpoint.

    A parameter may map to several entries (an FSDP1 flat parameter holds
    pieces of several original parameters); their state tensors are views
    of the same local tensor.
    """

    #: the FQN the checkpoint stores this state under
    fqn: str
    #: the global shape of that parameter: state tensors saved with this
    #: shape are sharded like it (and filled in place on load)
    shape: tuple[int, ...]
    #: a local state tensor of the parameter -> the leaf saved for this entry
    leaf: Callable[[torch.Tensor], Any]
    #: a fresh local state tensor for the parameter (when the optimizer has
    #: none of the right shape and dtype)
    new: Callable[[torch.dtype], torch.Tensor]
    #: whether an existing local state tensor can be filled in place
    fits: Callable[[torch.Tensor, torch.dtype], bool]


Places = Callable[[int, torch.Tensor], list[ParamState]]


class ParamIds(list[int]):
    """The parameter ids ``start .. start + n - 1`` of one param group: the
    list ``Optimizer.load_state_dict`` takes, whose ``in`` costs O(1) while
    the list is as made. torch asks ``param_id in group["params"]`` once for
    every state tensor it loads, which a plain list answers by a scan: a load
    of 10,000 parameters' Adam state spent 0.3 s in those scans alone.
    Any change to the list (a hook's) makes ``in`` a scan again; a copy of
    it, or a pickle unpickled, is a plain list; ``ParamIds(iterable)`` is a
    list of those ids, scanned."""

    def __init__(self, start: Any = (), n: int | None = None) -> None:
        if n is None:  # (as list(iterable): what code that rebuilds a list by its type passes)
            super().__init__(start)
            self._span: range | None = None
            return
        super().__init__(range(start, start + n))
        self._span = range(start, start + n)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return list, (list(self),)

    def __copy__(self) -> list[int]:
        return list(self)

    def __deepcopy__(self, memo: Any) -> list[int]:
        return list(self)

    def __contains__(self, x: object) -> bool:
        span = self._span
        if span is not None and type(x) is int:
            return x in span
        return list.__contains__(self, x)


def _changes_list(name: str) -> Callable[..., Any]:
    method = getattr(list, name)

    def changed(self: ParamIds, *args: Any, **kwargs: Any) -> Any:
        self._span = None
        return method(self, *args, **kwargs)

    changed.__name__ = name
    return changed


for _name in ("__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend", "insert", "pop",
              "remove", "clear", "sort", "reverse"):
    setattr(ParamIds, _name, _changes_list(_name))


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def optimizer_tree(opt: torch.optim.Optimizer, places: Places) -> dict[str, Any]:
    """(every rank, save) ``{"state": {fqn: {key: leaf}}, "param_groups": [...]}``
    with parameters named by FQN; ``places(i, param)`` says where parameter
    ``i`` of the optimizer's state dict lives."""
    osd = opt.state_dict()
    params = _params(opt)
    state: dict[str, Any] = {}
    for i, st in osd["state"].items():
        for place in places(i, params[i]):
            state[place.fqn] = {k: place.leaf(v) if isinstance(v, torch.Tensor) else v for k, v in st.items()}
    groups = []
    for g in osd["param_groups"]:
        g2 = {k: v for k, v in g.items() if k != "params"}
        g2["params"] = [place.fqn for i in g["params"] for place in places(i, params[i])]
        groups.append(g2)
    return {"state": state, "param_groups": Whole(groups)}


def optimizer_target(
    opt: torch.optim.Optimizer, key: str, md: Metadata, nodes: dict[str, Node], places: Places
) -> tuple[dict[str, Any], Finalize, Finalize]:
    """(every rank, load) The target tree for optimizer ``key``, the
    finalizer that calls ``opt.load_state_dict`` and the check of its param
    groups that runs before any tensor is read (a refused load leaves the
    state untouched). State tensors shaped like
    their parameter are read straight into the optimizer's existing state
    (in place, no new memory) or into fresh ones; other entries (``step``,
    hyperparameters) are rebuilt from the checkpoint."""
    params = _params(opt)
    per_param = [places(i, p) for i, p in enumerate(params)]
    target: dict[str, Any] = {}
    local: dict[int, dict[str, torch.Tensor]] = {}  # param index -> key -> local state tensor
    rebuilt: dict[int, dict[str, str]] = {}  # param index -> key -> fqn of the rebuilt value
    for i, p in enumerate(params):
        for place in per_param[i]:
            node = nodes.get(f"{key}.state.{place.fqn}")
            if node is None or node.kind != "dict":
                continue
            entries: dict[str, Any] = {}
            for k, child in node.items:
                info = md.tensors.get(child.name) if child.kind == "tensor" else None
                if info is not None and tuple(info["shape"]) == place.shape and place.shape:
                    t = local.setdefault(i, {}).get(k)
                    if t is None:
                        dtype = dtype_from_name(info["dtype"])
                        existing = opt.state.get(p, {}).get(k)
                        t = existing if isinstance(existing, torch.Tensor) and place.fits(existing, dtype) else place.new(dtype)
                        local[i][k] = t
                    entries[k] = place.leaf(t)
                else:
                    entries[k] = Slot()
                    rebuilt.setdefault(i, {}).setdefault(k, f"{key}.state.{place.fqn}.{k}")
            target[place.fqn] = entries

    def groups_for(values: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The saved param groups as ``opt.load_state_dict`` wants them
        (:class:`StateMismatchError` when they stand for other parameters)."""
        saved_groups = values.get(f"{key}.param_groups")
        if saved_groups is None:
            return None
        current, pos = [], 0
        for g in opt.param_groups:
            current.append([place.fqn for j in range(pos, pos + len(g["params"])) for place in per_param[j]])
            pos += len(g["params"])
        # parameters whose state the checkpoint holds (a pipeline stage's may be
        # absent from the saved groups, which list the coordinator's stage)
        stored = {place.fqn for places in per_param for place in places
                  if f"{key}.state.{place.fqn}" in nodes}
        return param_groups_for_load(key, saved_groups, opt, current, stored)

    checked: list[Any] = []  # (the saved groups checked at match, and what they became: not made twice)

    def check(values: dict[str, Any]) -> None:  # (at match, before any tensor is read)
        checked[:] = [values.get(f"{key}.param_groups"), groups_for(values)]

    def finalize(values: dict[str, Any]) -> None:
        saved = values.get(f"{key}.param_groups")
        groups = checked[1] if checked and checked[0] is saved else groups_for(values)
        if groups is None:
            return
        osd_state: dict[int, dict[str, Any]] = {}
        for i in set(local) | set(rebuilt):
            st: dict[str, Any] = dict(local.get(i, {}))
            for k, fqn in rebuilt.get(i, {}).items():
                st[k] = values[fqn]
            osd_state[i] = st
        opt.load_state_dict({"state": osd_state, "param_groups": groups})

    return {"state": target, "param_groups": Slot()}, finalize, check


def check_group(key: str, j: int, saved: list[str], current: list[list[str]], stored: set[str] | frozenset[str]
                ) -> None:
    """Saved param group ``j`` (parameters ``saved``, by FQN) stands for the
    optimizer's group ``j`` (``current[j]``): the same parameters, or another
    pipeline stage's group -- the state of all of group ``j``'s parameters is
    stored, and the saved group holds none of the parameters the optimizer's
    other groups hold. Else :class:`StateMismatchError` naming both sides."""
    everyone = {fqn for names in current for fqn in names}
    other_stage = bool(current[j]) and set(current[j]) <= stored and set(saved) & everyone <= set(current[j])
    if sorted(saved) != sorted(current[j]) and not other_stage:
        extra, lacking = sorted(set(saved) - set(current[j])), sorted(set(current[j]) - set(saved))
        differ = "; ".join(
            ([f"the checkpoint's holds {_few(extra)}, the optimizer's does not"] if extra else [])
            + ([f"the optimizer's holds {_few(lacking)}, the checkpoint's does not"] if lacking else []))
        raise StateMismatchError(
            f"optimizer {key!r} param group {j}: {differ} (a weight tied in one model and not in the other counts "
            f"once there); build the optimizer over the parameters it was saved with, or load without it "
            f"(exclude=[{key!r}]) and start its state afresh")


def _few(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def param_groups_for_load(
    key: str, saved_groups: list[dict[str, Any]], opt: torch.optim.Optimizer, current: list[list[str]],
    stored: set[str] | frozenset[str] = frozenset(),
) -> list[dict[str, Any]]:
    """Saved param groups (parameters named by FQN) as ``opt.load_state_dict``
    wants them: hyperparameters from the checkpoint, parameters by position.
    ``current[j]`` are the FQNs group ``j`` of ``opt`` holds now; ``stored``
    those whose state the checkpoint holds. Pipeline stages save the
    coordinator's groups, naming its stage's parameters only: a group whose
    parameters all have stored state takes the hyperparameters of the saved
    group at its position (every stage builds its groups alike) when that
    group holds none of the parameters the optimizer's other groups hold."""
    if not isinstance(saved_groups, list) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list) for g in saved_groups):
        raise CorruptCheckpointError(
            f"optimizer {key!r}: the checkpoint's param groups are not a list of groups each naming its "
            f"'params' ({type(saved_groups).__name__}); the checkpoint is damaged: load an earlier one, or load "
            f"without the optimizer (exclude=[{key!r}])")
    if len(saved_groups) != len(opt.param_groups):
        raise StateMismatchError(
            f"optimizer {key!r}: the checkpoint has {len(saved_groups)} param groups, "
            f"the optimizer {len(opt.param_groups)}; build its param groups as they were when it was saved, "
            f"or load without it (exclude=[{key!r}]) and start its state afresh"
        )
    groups = []
    pos = 0
    for j, (sg, cg) in enumerate(zip(saved_groups, opt.param_groups, strict=True)):
        check_group(key, j, sg["params"], current, stored)
        g = {k: v for k, v in sg.items() if k != "params"}
        g["params"] = ParamIds(pos, len(cg["params"]))
        groups.append(g)
        pos += len(cg["params"])
    return groups
