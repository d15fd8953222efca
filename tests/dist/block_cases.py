"""Functions the 2-rank pool runs for the block-checksum tests: an FSDP2 model
loading a checkpoint saved by one process (every rank reads its rows of each
chunk: partial reads, checked block by block)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import bytecp


class Wide(nn.Module):
    """A 1024 x 1000 fp32 weight (4,096,000 bytes: four blocks) and a small head."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(1000, 1024, bias=False)
        self.head = nn.Linear(8, 8)


def saved_model() -> Wide:
    torch.manual_seed(0)
    return Wide()


def load_fsdp2(url: str) -> dict[str, Any]:
    """(every rank) FSDP2 over the ranks, other weights; load ``url``; -> this rank's rows of
    ``lin.weight`` and where they start, or the error every rank raised."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(7)
    model = Wide()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model.lin, mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:
        bytecp.load(url, {"model": model}, io_threads=4)
    except Exception as e:  # noqa: BLE001 - the outcome is the report
        return {"error": f"{type(e).__name__}: {e}"}
    local = model.lin.weight.to_local().detach().clone()
    rows = 1024 // dist.get_world_size()
    return {"rows": local, "first": dist.get_rank() * rows}
