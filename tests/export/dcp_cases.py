"""Functions the DCP export test runs on every gloo rank: a tiny model with
Adam trained under FSDP2 and saved by bytecp, and the same model under
FSDP2 at another world size loading the export with ``dcp.load``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import bytecp


class Tiny(torch.nn.Module):
    """Odd sizes, so FSDP2's dim-0 shards are uneven at 2 and 3 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(37, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))
        self.head = torch.nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = torch.relu(layer(h))
        return self.head(h)


def _sharded(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Tiny()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _full(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """(every rank: collectives) model and optimizer as full CPU tensors, keyed as DCP users key them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optim": osd}


def train_and_save(url: str, steps: int = 2) -> dict[str, Any] | None:
    """Train ``steps`` steps, save model, optimizer, a train-state dict and a
    tuple with bytecp; rank 0 returns the full state and the values saved."""
    model, opt = _sharded()
    g = torch.Generator().manual_seed(10 + dist.get_rank())
    for _ in range(steps):
        model(torch.randint(0, 37, (4, 8), generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    extra = {"train": {"step": steps, "tokens": 1234}, "lrs": (0.5, 0.25)}
    bytecp.save(url, {"model": model, "optim": opt, **extra}, step=steps)
    full = _full(model, opt)
    return {**full, **extra} if dist.get_rank() == 0 else None


def load_exported(out: str) -> dict[str, Any] | None:
    """A fresh FSDP2 model at this world size loads the DCP export as DCP
    users do; rank 0 returns its full state and the values loaded."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _sharded(seed=1)
    msd, osd = get_state_dict(model, opt)
    state: dict[str, Any] = {"model": msd, "optim": osd, "train": {"step": 0, "tokens": 0}, "lrs": (0.0, 0.0)}
    dcp.load(state, checkpoint_id=out)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full = _full(model, opt)
    return {**full, "train": state["train"], "lrs": state["lrs"]} if dist.get_rank() == 0 else None
