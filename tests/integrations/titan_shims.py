"""What torchtitan 0.3.0's trainer needs to run on CPU with gloo (test processes only).

Each shim answers a failure seen without it (see docs/torchtitan.md,
"How it is tested"); the library never applies them. :func:`install` must
run before ``torchtitan`` is imported.
"""

from __future__ import annotations

import types
from typing import Any

import torch

__all__ = ["install"]


def _cpu_memory_functions() -> None:
    """torchtitan's memory monitor calls CUDA-style functions on its device module."""
    cpu: Any = torch.cpu
    cpu.get_device_name = lambda *a, **k: "cpu"
    cpu.get_device_properties = lambda *a, **k: types.SimpleNamespace(total_memory=1 << 34, name="cpu")
    cpu.reset_peak_memory_stats = lambda *a, **k: None
    cpu.empty_cache = lambda *a, **k: None
    cpu.memory_stats = lambda *a, **k: {}
    cpu.current_device = lambda *a, **k: 0


def _force_sum_reduction() -> None:
    """gloo has no PREMUL_SUM: FSDP2 must reduce with SUM once torchtitan
    has disabled its gradient division."""
    import torchtitan.distributed.fsdp as fsdp
    from torch.distributed.fsdp import FSDPModule

    original = fsdp.disable_fsdp_gradient_division

    def disable(model: torch.nn.Module) -> None:
        original(model)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = disable


def _sdpa_for_flex() -> None:
    """FlexAttention has no CPU backward and compiles its mask: build masks
    eagerly and attend with causal ``scaled_dot_product_attention`` (it
    ignores document masking, which these tests do not rely on)."""
    import torch.nn.functional as F
    import torchtitan.models.common.attention as attention
    from torch.nn.attention.flex_attention import create_block_mask

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
             enable_gqa: bool = False, **_: Any) -> tuple[torch.Tensor, None]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa), None

    attention._compiled_create_block_mask = create_block_mask
    attention.FlexAttention._compiled_flex_attn = staticmethod(sdpa)


def install() -> None:
    """Apply every shim; idempotent."""
    import torch._utils
    import torch.distributed as dist

    if getattr(torch, "_bytecp_titan_shims", False):
        return
    # torchtitan assumes cuda unless torch reports another device type
    torch._utils._get_available_device_type = lambda: "cpu"  # type: ignore[assignment]
    _cpu_memory_functions()
    # torch 2.13 has no public set_timeout
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout  # type: ignore[attr-defined]
    _force_sum_reduction()
    _sdpa_for_flex()
    torch._bytecp_titan_shims = True  # type: ignore[attr-defined]
