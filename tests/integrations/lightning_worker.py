"""One rank of a PyTorch Lightning job that checkpoints through bytecp's
plugin; spawned by ``test_lightning.py`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``
in the environment, as torchrun sets them).

``python lightning_worker.py CONFIG_JSON``: a list of jobs run one after
the other in this process; each names the strategy
(``mp``: ``BytecpModelParallelStrategy`` with FSDP2 ``fully_shard``; ``ddp``;
``single``), the checkpoint directory, where to resume from, and what to
record. Each rank writes ``<out>/rank<r>-<tag>.json`` (losses by global
step, what the async-save probe saw, the error a failed save raised, and
after a resume which tensors equal bitwise those gathered when the
checkpoint was saved); rank 0 writes the full model and optimizer tensors
gathered at each save (``state-step<N>.pt``).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

import pytorch_lightning as pl
import torch
from bytecp.adapters.lightning import (
    BytecpCheckpointIO,
    BytecpDDPStrategy,
    BytecpModelParallelStrategy,
    BytecpSingleDeviceStrategy,
)
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (collective for a DTensor: every rank calls it in the same order)."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


class Net(pl.LightningModule):
    """A small MLP whose row counts (13, 5) shard unevenly over 2 and 3 ranks."""

    def __init__(self, shard: bool) -> None:
        super().__init__()
        self.shard = shard
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 13), nn.Tanh(), nn.Linear(13, 5), nn.Tanh(), nn.Linear(5, 1))
        self.losses: dict[int, float] = {}
        self.ids: dict[int, list[int]] = {}

    def configure_model(self) -> None:
        if self.shard:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if len(batch) == 3:  # (sample ids, x, y): which samples each step trained on
            ids, x, y = batch
            self.ids[self.global_step] = [int(i) for i in ids]
        else:
            x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses[self.global_step] = loss.item()
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def gathered_state(module: Net, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer-state tensor as a full tensor, by name."""
    out = {f"model.{n}": full(p) for n, p in module.named_parameters()}
    names = {id(p): n for n, p in module.named_parameters()}
    for p, st in optimizer.state.items():
        for k, v in st.items():
            out[f"optim.{names[id(p)]}.{k}"] = full(v) if isinstance(v, torch.Tensor) else torch.tensor(v)
    return out


class Probe(Callback):
    """Records what the test checks: the state at each save, whether a save
    had committed when training went on, the state right after a resume."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.rank = int(os.environ.get("RANK", "0"))
        self.seen: list[dict[str, Any]] = []
        self.restored: dict[str, Any] = {}
        self.io: BytecpCheckpointIO | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        io = trainer.strategy.checkpoint_io
        self.io = io if isinstance(io, BytecpCheckpointIO) else None

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        state = gathered_state(pl_module, trainer.optimizers[0])  # type: ignore[arg-type]
        if self.rank == 0:
            torch.save(state, os.path.join(self.cfg["out"], f"state-step{trainer.global_step}.pt"))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.cfg.get("resume"):
            state = gathered_state(pl_module, trainer.optimizers[0])  # type: ignore[arg-type]
            saved = torch.load(os.path.join(self.cfg["ref"], f"state-step{self.cfg['resume_step']}.pt"))
            self.restored = {
                "global_step": trainer.global_step,
                "epoch": trainer.current_epoch,
                "lr": trainer.optimizers[0].param_groups[0]["lr"],
                "keys_equal": sorted(state) == sorted(saved),
                "bitwise_equal": [k for k in saved if k in state and torch.equal(state[k], saved[k])],
                "different": [k for k in saved if k not in state or not torch.equal(state[k], saved[k])],
            }

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        handle = self.io.handle if self.io is not None else None
        if handle is not None and (not self.seen or self.seen[-1]["url"] != handle.url):
            # the first step after a save was started: is that save still in flight?
            self.seen.append({
                "url": handle.url,
                "step": trainer.global_step,
                "done_when_training_went_on": handle.done(),
                "metadata_when_training_went_on": os.path.exists(os.path.join(handle.url, "metadata.json")),
            })
        fail = self.cfg.get("fail_write")
        if fail is not None and trainer.global_step == fail["from_step"]:
            # let the save in flight commit, then make the next one fail in its write phase on one rank
            if handle is not None:
                handle.wait()
            os.environ["BYTECP_FAULT_ERROR"] = f"write:{fail['rank']}"


def build(cfg: dict[str, Any]) -> tuple[pl.Trainer, Net, Probe]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    io = BytecpCheckpointIO(lazy=cfg.get("lazy", False))
    kind = cfg["strategy"]
    if kind == "mp":
        strategy: Any = BytecpModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1, checkpoint_io=io)
    elif kind == "native_mp":  # Lightning's own strategy and checkpoints (torch DCP + meta.pt)
        from pytorch_lightning.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    elif kind == "ddp":
        strategy = BytecpDDPStrategy(process_group_backend="gloo", checkpoint_io=io)
    else:
        strategy = BytecpSingleDeviceStrategy(device="cpu", checkpoint_io=io)
    probe = Probe(cfg)
    ckpt = ModelCheckpoint(dirpath=cfg["ckpt_dir"], filename="{step}", every_n_train_steps=cfg["every"],
                           save_top_k=cfg["top_k"], monitor="step", mode="max")
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, num_nodes=1, strategy=strategy, max_steps=cfg["max_steps"],
        callbacks=[probe, ckpt], logger=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=bool(cfg.get("ids")), num_sanity_val_steps=0,
    )
    return trainer, Net(shard=kind in ("mp", "native_mp")), probe


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    rank = int(os.environ.get("RANK", "0"))
    g = torch.Generator().manual_seed(1)
    if cfg.get("ids"):  # Lightning gives each rank a DistributedSampler over 48 numbered samples
        data = TensorDataset(torch.arange(48), torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g))
        # torch's RandomSampler: Lightning swaps it for a DistributedSampler(shuffle=True) (torchdata's own,
        # from shuffle=True, it would wrap in a DistributedSamplerWrapper of no known order)
        loader = StatefulDataLoader(data, batch_size=cfg["ids"], sampler=torch.utils.data.RandomSampler(data))
    else:
        data = TensorDataset(torch.randn(40, 8, generator=g), torch.randn(40, 1, generator=g))
        # every rank sees the same batches: the losses do not depend on the world size
        loader = StatefulDataLoader(data, batch_size=8, shuffle=False)
    trainer, model, probe = build(cfg)
    record: dict[str, Any] = {"rank": rank, "tag": cfg["tag"]}
    try:
        trainer.fit(model, loader, ckpt_path=cfg.get("resume"))
    except Exception as e:
        record["error"] = f"{type(e).__name__}: {e}"
        record["traceback"] = traceback.format_exc()
    os.environ.pop("BYTECP_FAULT_ERROR", None)
    record.update(losses=model.losses, ids=model.ids, seen=probe.seen, restored=probe.restored,
                  global_step=trainer.global_step, epoch=trainer.current_epoch)
    return record


def main() -> None:
    """Run each configured training job in turn, in this process."""
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    for cfg in json.loads(sys.argv[1]):
        record = run(cfg)
        with open(os.path.join(cfg["out"], f"rank{rank}-{cfg['tag']}.json"), "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
