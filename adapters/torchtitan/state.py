"""The state tree of torchtitan's checkpointed objects (``framework="torchtitan"``).

torchtitan hands its checkpoint manager ``Stateful`` objects whose
``state_dict()`` is already flat and canonical: ``ModelWrapper`` (model
FQNs, fused ``wqkv`` split by its hooks), ``OptimizersContainer``
(``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``), the LR schedulers,
the dataloader (one value per rank) and the trainer's train state. This
adapter saves exactly those state dicts, as torch's DCP does: a DTensor
becomes this rank's box, a plain tensor a whole tensor, anything else a
value. A load fills the tensors of a fresh ``state_dict()`` in place and
hands it back through ``load_state_dict`` (torchtitan then fuses, copies
and unflattens), so any parallelism loads any other.

Called by the core on every rank: ``save_tree`` when
:class:`~bytecp.adapters.torchtitan.BytecpCheckpointManager` saves,
``load_tree`` (then ``finalize``) when it loads. Never detected: the
manager selects it by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from bytecp.adapter_api import Adapter, LoadTarget
from bytecp.dist import DistContext
from bytecp.format.metadata import Metadata
from bytecp.tree.state import PerRank, Slot

from .._dtensor import dtensor_leaf, is_dtensor, mesh_info
from ..plain import is_stateful, per_rank_leaf, per_rank_slot

__all__ = ["TorchtitanStateAdapter", "PER_RANK_KEYS"]

#: top-level keys whose value differs on every rank (torchtitan's dataloader)
PER_RANK_KEYS = frozenset({"dataloader"})

Finalize = Callable[[dict[str, Any]], None]


def _state_dict(v: Any) -> Any:
    return v.state_dict() if is_stateful(v) else v


def _leaf(t: torch.Tensor) -> Any:
    return dtensor_leaf(t) if is_dtensor(t) else t.detach()  # type: ignore[arg-type]


def _save_value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return _leaf(v)
    if isinstance(v, dict):  # OrderedDict too (nn.Module.state_dict)
        return {k: _save_value(x) for k, x in v.items()}
    return v


def _first_dtensor(v: Any) -> Any:
    if is_dtensor(v):
        return v
    if isinstance(v, dict):
        for x in v.values():
            found = _first_dtensor(x)
            if found is not None:
                return found
    return None


class TorchtitanStateAdapter(Adapter):
    """torchtitan's ``Stateful`` objects (or their plain state dicts) by key."""

    name = "torchtitan"

    @classmethod
    def detect(cls, state: dict[str, Any]) -> bool:
        return False  # chosen by name only (framework="torchtitan")

    def save_tree(self, state: dict[str, Any], ctx: DistContext) -> Any:
        """(every rank) Views of the live state dicts, no copies."""
        return {k: self._per_rank(v) if k in PER_RANK_KEYS else _save_value(_state_dict(v))
                for k, v in state.items()}

    @staticmethod
    def _per_rank(v: Any) -> PerRank:
        """The dataloader's state, with its data position (:mod:`bytecp.data`) when it is a stateful object."""
        return per_rank_leaf(v) if is_stateful(v) else PerRank(v)

    def load_tree(self, state: dict[str, Any], ctx: DistContext, md: Metadata) -> LoadTarget:
        """(every rank) Targets: the tensors of each object's fresh state dict,
        filled in place; ``finalize`` puts the loaded values into those dicts
        and calls each object's ``load_state_dict``."""
        finalizers: list[Finalize] = []
        tree: dict[str, Any] = {}
        for key, obj in state.items():
            # a DCP checkpoint torchtitan's own backend wrote keeps each rank's dataloader
            # under its own name (dataloader.dp_rank_<r>): an ordinary value there
            if key in PER_RANK_KEYS and (key in md.per_rank or not any(o.startswith(f"{key}.") for o in md.objects)):
                tree[key] = per_rank_slot(obj) if is_stateful(obj) else Slot(per_rank=True)
                finalizers.append(self._apply_whole(key, obj))
                continue
            sd = _state_dict(obj)
            tree[key] = self._targets(sd, key, finalizers)
            if is_stateful(obj):
                finalizers.append(self._apply_loaded(obj, sd))

        def finalize(values: dict[str, Any]) -> None:
            for f in finalizers:
                f(values)

        return LoadTarget(tree, finalize)

    @staticmethod
    def _apply_loaded(obj: Any, sd: Any) -> Finalize:
        def apply(values: dict[str, Any]) -> None:
            obj.load_state_dict(sd)  # its tensors were filled in place, its values put back

        return apply

    @staticmethod
    def _apply_whole(key: str, obj: Any) -> Finalize:
        def apply(values: dict[str, Any]) -> None:
            if key in values and is_stateful(obj):
                obj.load_state_dict(values[key])

        return apply

    def _targets(self, sd: Any, fqn: str, finalizers: list[Finalize]) -> Any:
        if isinstance(sd, torch.Tensor):
            return _leaf(sd)
        if not isinstance(sd, dict):
            return Slot(default=sd)
        out: dict[str, Any] = {}
        for k, v in sd.items():
            name = f"{fqn}.{k}"
            if isinstance(v, torch.Tensor | dict):
                out[k] = self._targets(v, name, finalizers)
            else:
                out[k] = Slot(default=v)

                def put(values: dict[str, Any], parent: dict[str, Any] = sd, key: str = k, name: str = name) -> None:
                    if name in values:
                        parent[key] = values[name]

                finalizers.append(put)
        return out

    def parallelism(self, state: dict[str, Any], ctx: DistContext) -> dict[str, Any]:
        out: dict[str, Any] = {"world_size": ctx.world_size}
        model = state.get("model")
        found = _first_dtensor(_state_dict(model)) if model is not None else None
        if found is not None:
            out.update(mesh_info(found))
        return out
