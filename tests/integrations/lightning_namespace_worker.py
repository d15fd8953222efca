"""A Lightning run written against ``lightning.pytorch`` (``import lightning as L``):
fit 4 steps with a bytecp strategy and ModelCheckpoint, then resume from the
latest checkpoint to step 6 and compare with an uninterrupted run
(tests/integrations/test_lightning_namespace.py)."""

from __future__ import annotations

import json
import sys
from typing import Any

import lightning as L
import torch
from bytecp.adapters.lightning import PACKAGE, BytecpSingleDeviceStrategy, latest_checkpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.steps_run = 0  # training steps this fit ran (a resume from step 4 of 6 runs 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps_run += 1
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)), batch_size=8)  # 2 steps an epoch


def fit(run: str | None, steps: int, ckpt_path: str | None = None) -> Net:
    model = Net()
    callbacks = [L.pytorch.callbacks.ModelCheckpoint(dirpath=run, filename="{step}", every_n_train_steps=2,
                                                     save_top_k=-1)] if run else []
    trainer = L.Trainer(strategy=BytecpSingleDeviceStrategy(device="cpu"), max_steps=steps, callbacks=callbacks,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=bool(run))
    trainer.fit(model, data(), ckpt_path=ckpt_path)
    return model


def main(run: str) -> None:
    fit(run, 4)
    latest = latest_checkpoint(run)
    resumed = fit(None, 6, ckpt_path=latest)
    straight = fit(None, 6)
    same = all(torch.equal(a, b) for a, b in zip(resumed.state_dict().values(), straight.state_dict().values(),
                                                   strict=True))
    print(json.dumps({"package": PACKAGE, "latest": latest, "same": same, "resumed_steps": resumed.steps_run,
                      "pytorch_lightning_imported": "pytorch_lightning" in sys.modules}))


if __name__ == "__main__":
    main(sys.argv[1])
