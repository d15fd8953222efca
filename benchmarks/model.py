"""A GPT-like model sized so that its parameters plus Adam state take N GB.

Every rank builds the same model on the CPU from the same seed, wraps it for
its framework (DDP, FSDP1, FSDP2, FSDP2 x TP on a dp x tp=2 mesh, or none),
and trains one step so the Adam
state exists. State bytes = 3 x fp32 parameters (weights, exp_avg,
exp_avg_sq) plus Adam's step counters.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT", "Block", "config_for_gb", "build", "train_step", "state_bytes",
           "fingerprint", "FRAMEWORKS"]

FRAMEWORKS = ("fsdp2", "ddp", "fsdp1", "plain", "fsdp2_tp")

#: bytes of state per parameter: fp32 weight + exp_avg + exp_avg_sq
_BYTES_PER_PARAM = 12


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the model."""

    #: transformer blocks
    layers: int
    #: hidden size (a multiple of 64: heads of 64)
    hidden: int
    #: vocabulary size (token embedding and untied output head)
    vocab: int
    #: positions
    seq: int = 128

    @property
    def heads(self) -> int:
        return max(1, self.hidden // 64)

    @property
    def params(self) -> int:
        h, v = self.hidden, self.vocab
        block = 12 * h * h + 13 * h  # qkv, proj, fc1, fc2 (+ biases) and two LayerNorms
        return self.layers * block + 2 * v * h + self.seq * h + 2 * h

    @property
    def state_gb(self) -> float:
        return self.params * _BYTES_PER_PARAM / 1e9


def config_for_gb(gb: float) -> GPTConfig:
    """The config whose parameters + Adam state come closest to ``gb`` GB."""
    layers, vocab = (12, 8192) if gb >= 0.5 else (4, 1024)
    target = gb * 1e9 / _BYTES_PER_PARAM
    a, b = 12 * layers, 2 * vocab
    h = (-b + math.sqrt(b * b + 4 * a * target)) / (2 * a)
    best = min((GPTConfig(layers=layers, hidden=m * 64, vocab=vocab) for m in
                (max(1, math.floor(h / 64)), max(1, math.ceil(h / 64)))),
               key=lambda c: abs(c.state_gb - gb))
    return best


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        h = cfg.hidden
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        # qkv's rows grouped by head (q, k, v of head 0, then head 1, ...): a
        # column-parallel qkv gives each TP rank whole heads
        q, k, v = self.qkv(self.ln1(x)).view(b, t, -1, 3, h // self.heads).unbind(3)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def build(cfg: GPTConfig, framework: str, *, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The wrapped model and its Adam optimizer, trained one step (every rank calls it)."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"unknown framework {framework!r}; known: {FRAMEWORKS}")
    torch.manual_seed(seed)
    model: nn.Module = GPT(cfg)
    if framework == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for blk in model.blocks:  # type: ignore[union-attr]
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif framework == "fsdp2_tp":
        _fsdp2_tp(model)
    elif framework == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    elif framework == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-4)
    train_step(model, optim, cfg, seed=seed)
    return model, optim


def _fsdp2_tp(model: nn.Module) -> None:
    """torchtitan's layout on a dp x tp=2 mesh: qkv and fc1 column-parallel,
    proj and fc2 row-parallel; norms and embeddings outside the TP plan, so
    FSDP2 shards them over dp only and both TP ranks hold the same box."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    world = dist.get_world_size()
    if world % 2:
        raise ValueError(f"fsdp2_tp needs an even world size (dp x tp=2), not {world}")
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    plan = {"qkv": ColwiseParallel(), "fc1": ColwiseParallel(), "proj": RowwiseParallel(), "fc2": RowwiseParallel()}
    for blk in model.blocks:  # type: ignore[union-attr]
        parallelize_module(blk, mesh["tp"], plan)
        fully_shard(blk, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


def forward_backward(model: nn.Module, cfg: GPTConfig, *, seed: int = 0, tokens: int = 32) -> None:
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(cfg.vocab, (1, min(tokens, cfg.seq) + 1), generator=g)
    logits = model(idx[:, :-1])
    F.cross_entropy(logits.reshape(-1, cfg.vocab), idx[:, 1:].reshape(-1)).backward()


def train_step(model: nn.Module, optim: torch.optim.Optimizer, cfg: GPTConfig, *, seed: int = 0) -> None:
    """One forward/backward/Adam step on a tiny batch (enough to create Adam state)."""
    forward_backward(model, cfg, seed=seed)
    optim.step()
    optim.zero_grad(set_to_none=True)


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def state_bytes(model: nn.Module, optim: torch.optim.Optimizer) -> int:
    """Bytes of tensors this rank holds: parameters, buffers and optimizer state."""
    n = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    n += sum(_local(b).numel() * b.element_size() for b in model.buffers())
    for st in optim.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                n += _local(v).numel() * v.element_size()
    return n


def fingerprint(model: nn.Module, framework: str) -> float:
    """Sum of all parameter values over the whole model (every rank calls it; same result).

    Sharded frameworks sum their local shards and all-reduce (FSDP1's padding
    is zero); replicated ones sum locally. Used to check that a load put the
    saved values back.
    """
    local = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        local += _local(p.detach()).double().sum() / _copies(p)
    if framework in ("fsdp1", "fsdp2", "fsdp2_tp") and dist.is_initialized():
        dist.all_reduce(local)
    return float(local)


def _copies(p: torch.Tensor) -> int:
    """How many ranks hold each element of a DTensor (1 for other tensors)."""
    mesh = getattr(p, "device_mesh", None)
    if mesh is None or not dist.is_initialized():
        return 1
    boxes = math.prod(n for n, pl in zip(mesh.shape, p.placements, strict=True) if not pl.is_replicate())  # type: ignore[attr-defined]
    return dist.get_world_size() // boxes


def describe(cfg: GPTConfig) -> dict[str, Any]:
    return {**dataclasses.asdict(cfg), "params": cfg.params, "state_gb": round(cfg.state_gb, 3)}
