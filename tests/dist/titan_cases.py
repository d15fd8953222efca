"""torchtitan's own Llama3 model and parallelisms (``Module.parallelize``
with ``ParallelDims``, ``apply_fsdp_to_decoder``) for the layout matrix:
FSDP2 x TP with and without sequence parallel, FSDP2 alone, TP alone,
and the unparallelized model in one process. A tiny config (2 layers,
hidden 32, a vocabulary of 37). The optimizer state comes from one AdamW
step on gradients set from the parameters (no forward: FlexAttention has
no CPU backward), enough to lay out real optimizer state.

torchtitan assumes CUDA; :func:`_cpu` points its device helpers at the CPU
(test-only shims, as in the notes on torchtitan on this machine)."""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

#: layout -> (dp_shard, tp, sequence parallel); None: one process, no parallelism
TITAN = {
    "titan_fsdp_tp": (2, 2, False),
    "titan_fsdp_tp_sp": (2, 2, True),
    "titan_fsdp": (4, 1, False),
    "titan_tp": (1, 4, True),
    "titan_plain": None,
}


def available() -> str | None:
    """Why torchtitan cannot run here, or None."""
    return None if importlib.util.find_spec("torchtitan") else "torchtitan is not installed (make install-test)"


def _cpu() -> None:
    """Import torchtitan's device helpers while torch reports "cpu" as the
    available device (they fall back to cuda otherwise); torch itself is
    left as it was."""
    import torch._utils as tu

    if "torchtitan.tools.utils" in sys.modules:
        return
    original = tu._get_available_device_type
    tu._get_available_device_type = lambda: "cpu"  # type: ignore[assignment]
    try:
        import torchtitan.distributed  # noqa: F401  (binds device_type at import)
        import torchtitan.tools.utils as tt

        tt.device_type, tt.device_module = "cpu", torch.cpu
    finally:
        tu._get_available_device_type = original  # type: ignore[assignment]


#: torchtitan's parallel dimensions by (dp, tp, world), made once a rank
_DIMS: dict[tuple[int, int, int], Any] = {}


def build(layout: str, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """(every rank, or one process for ``titan_plain``) The model laid out so, and its AdamW."""
    _cpu()
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.common.rope import ComplexRoPE
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        _build_llama3_layers,
        _output_linear_init,
    )
    from torchtitan.models.llama3.model import Llama3Model
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    dim, heads, vocab = 32, 4, 37
    rope = ComplexRoPE.Config(dim=dim // heads, max_seq_len=64, theta=500000, scaling="llama")
    cfg = Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=_build_llama3_layers(fuse_qkv=True, n_layers=2, dim=dim, n_heads=heads, hidden_dim=64,
                                    rope=rope, attn_backend="flex"),
    )
    shape = TITAN[layout]
    set_llama3_sharding_config(cfg, enable_sp=bool(shape and shape[2]))
    torch.manual_seed(seed)
    model = cfg.build()
    model.init_states(buffer_device=torch.device("cpu"))
    if shape is not None:
        dp, tp, _ = shape
        key = (dp, tp, dist.get_world_size())
        if key not in _DIMS:  # its meshes made once a rank (tests/dist/layout_cases.py: _MESHES)
            _DIMS[key] = ParallelDims(dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=1, ep=1,
                                      world_size=dist.get_world_size(), spmd_backend="partial_dtensor")
        pd = _DIMS[key]
        if tp > 1:
            model.parallelize(pd)
        if dp > 1:
            apply_fsdp_to_decoder(model, pd.get_mesh(["fsdp"]), param_dtype=torch.float32,
                                  reduce_dtype=torch.float32, pp_enabled=False)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, foreach=False)
    return model, opt, 0


def train(model: nn.Module, opt: torch.optim.Optimizer, stage: int, steps: int = 2) -> None:
    """Two AdamW steps on gradients derived from the parameters (each laid out as its parameter)."""
    for step in range(steps):
        for p in model.parameters():
            p.grad = p.detach() * (0.5 + step)
        opt.step()
        opt.zero_grad()


__all__ = ["TITAN", "available", "build", "train"]
