"""DeepSpeed-MoE experts by their global index.

A ``deepspeed.moe.layer.MoE`` layer of ``num_experts`` experts over ``ep_size``
expert-parallel ranks builds ``num_experts / ep_size`` of them on each rank,
named by their local index (``moe.deepspeed_moe.experts.deepspeed_experts.0``
on every rank, a different expert on each). DeepSpeed's own checkpoint names
them by global index (``ep_rank * num_local_experts + local``), and so does
bytecp: the names do not depend on the expert-parallel size, so a checkpoint
loads at another one (each rank reads its own experts, the others are
another rank's: :func:`other_experts`).

Used by :mod:`.adapter` on every rank (save and load): the
module's leaves and targets, the optimizer's parameter names and a load's
``elsewhere`` names go through :class:`ExpertNames`. No collective runs.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["ExpertNames", "EXPERTS", "expert_parallel_size"]

#: where an MoE layer keeps its local experts, below the layer
EXPERTS = "deepspeed_moe.experts.deepspeed_experts"


class _Layer:
    """One MoE layer: where its experts are named, and which global indices this rank holds."""

    def __init__(self, path: str, layer: Any) -> None:
        from deepspeed.utils import groups

        self.base = f"{path}.{EXPERTS}." if path else f"{EXPERTS}."
        self.local = int(layer.num_local_experts)
        self.total = self.local * int(layer.ep_size)
        self.offset = int(groups._get_expert_parallel_rank(layer.expert_group_name)) * self.local


class ExpertNames:
    """The expert renaming of one root module (an engine's module)."""

    def __init__(self, module: nn.Module) -> None:
        self.layers = [_Layer(path, m) for path, m in module.named_modules()
                       if type(m).__name__ == "MoE" and hasattr(m, "deepspeed_moe") and hasattr(m, "ep_size")]

    def __bool__(self) -> bool:
        return bool(self.layers)

    def __call__(self, name: str) -> str:
        """``name`` (a clean module name) with a local expert index made global."""
        for layer in self.layers:
            if name.startswith(layer.base):
                idx, _, rest = name[len(layer.base):].partition(".")
                if idx.isdigit():
                    return f"{layer.base}{int(idx) + layer.offset}{'.' + rest if rest else ''}"
        return name

    def other_experts(self) -> list[str]:
        """The global expert names (prefixes) other expert-parallel ranks hold."""
        return [f"{layer.base}{g}" for layer in self.layers for g in range(layer.total)
                if not layer.offset <= g < layer.offset + layer.local]


def expert_parallel_size(group: dict[str, Any]) -> int:
    """The expert-parallel size of an optimizer param group of experts (``moe``: True), else 1."""
    if not group.get("moe"):
        return 1
    from deepspeed.utils import groups

    return int(groups._get_expert_parallel_world_size(group["name"]))
