"""The checkpoints the resume matrix (test_resume_matrix.py) builds its run
folders from, each written once per session by the tool it stands for:

- ``plain``: ``CheckpointManager`` saves of ``{"model": nn.Linear(4, 3)}``
  (weights = the step) at steps 10 and 20, and the Hugging Face Trainer's
  ``checkpoint-10``/``checkpoint-20`` of the same model (``model.safetensors``);
- ``titan``: torchtitan 0.3.0's ``BytecpCheckpointManager`` at steps 10 and
  20, and torchtitan's own DCP ``CheckpointManager`` at the same steps;
- ``lightning``: a real ``Trainer.fit`` with ``BytecpSingleDeviceStrategy``
  and ``BytecpModelCheckpoint(every_n_train_steps=10)`` (``step-10.ckpt``,
  ``step-20.ckpt``), and the Hugging Face Trainer's folders of its module;
- ``killed``: a bytecp save killed in its commit phase (a child process
  ending with ``BYTECP_FAULT_EXIT=commit:0``): data, index and lease, no
  ``metadata.json``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import bytecp

STEPS = (10, 20)


def plain_model(step: float = 0.0) -> nn.Linear:
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.fill_(step)
        model.bias.fill_(step)
    return model


def hf_checkpoint(folder: Path, sd: dict[str, torch.Tensor]) -> None:
    """What the Hugging Face Trainer leaves: ``checkpoint-<step>/model.safetensors``."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file({k: v.detach().contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"))


class TrainState:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]


def titan_manager(folder: str, manager: Any = None, seed: int = 0, **config: Any) -> tuple[Any, nn.Module, TrainState]:
    """torchtitan's real optimizer and scheduler containers around a tiny model, under ``manager``."""
    from bytecp.adapters.torchtitan import BytecpCheckpointManager
    from torchtitan.components.optimizer import OptimizersContainer, default_adamw
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    opt_config = default_adamw(lr=1e-2)
    opt_config.implementation = "for-loop"
    optimizers = OptimizersContainer(opt_config, model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=30)
    train = TrainState()
    cfg = (manager or BytecpCheckpointManager).Config(enable=True, folder=folder, **config)
    mgr = cfg.build(dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
                    states={"train_state": train}, sd_adapter=None)
    return mgr, model, train


def _titan(base: Path) -> None:
    import torch.distributed as dist
    from torchtitan.components.checkpoint import CheckpointManager

    for name, manager in (("titan", None), ("titan_dcp", CheckpointManager)):
        mgr, model, train = titan_manager(str(base / name), manager, interval=10, keep_latest_k=0,
                                          last_save_model_only=False)
        for step in STEPS:
            train.step = step
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float(step))
            if manager is not None and not dist.is_initialized():  # torchtitan's DCP manager needs a group
                dist.init_process_group("gloo", init_method=f"file://{base}/pg", rank=0, world_size=1)
            mgr.save(step)
        mgr.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    for step in STEPS:  # the train state of torchtitan's DCP checkpoints says their step
        assert (base / "titan_dcp" / f"step-{step}" / ".metadata").exists()


def _lightning(base: Path) -> None:
    import pytorch_lightning as pl
    from bytecp.adapters.lightning import (
        BytecpCheckpointIO,
        BytecpModelCheckpoint,
        BytecpSingleDeviceStrategy,
    )

    trainer = pl.Trainer(strategy=BytecpSingleDeviceStrategy(device="cpu", checkpoint_io=BytecpCheckpointIO(
        async_save=False)), max_steps=STEPS[-1], logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[BytecpModelCheckpoint(dirpath=str(base / "lightning"), filename="step-{step}",
                                         auto_insert_metric_name=False, every_n_train_steps=10, save_top_k=-1)],
        default_root_dir=str(base))
    module = LitModule()
    trainer.fit(module, module.loader())
    for step in STEPS:
        hf_checkpoint(base / "lightning_hf" / f"checkpoint-{step}", module.state_dict())


class LitModule:
    """A tiny LightningModule (built on first use: the Lightning import waits for the test that needs it)."""

    def __new__(cls) -> Any:
        import pytorch_lightning as pl

        class Lit(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                torch.manual_seed(0)
                self.layer = nn.Linear(4, 2)
                self.started_at: int | None = None

            def training_step(self, batch: Any, _: int) -> torch.Tensor:
                return self.layer(batch).square().mean()

            def on_train_start(self) -> None:
                self.started_at = self.trainer.global_step  # the step a resume restored

            def configure_optimizers(self) -> Any:
                return torch.optim.SGD(self.parameters(), lr=0.01)

            def loader(self) -> Any:
                return torch.utils.data.DataLoader(torch.randn(64, 4), batch_size=2)

        return Lit()


_KILL = """
import sys, torch
from torch import nn
import bytecp
m = nn.Linear(4, 3)
bytecp.save(sys.argv[1], {"model": m}, step=30)
"""


def _killed(base: Path) -> None:
    env = {**os.environ, "BYTECP_FAULT_EXIT": "commit:0",
           "PYTHONPATH": str(Path(bytecp.__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", _KILL, str(base / "killed" / "step-30")], env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 17, out.stderr[-2000:]
    names = {p.relative_to(base / "killed" / "step-30").parts[0] for p in (base / "killed" / "step-30").rglob("*")}
    assert {"data", "leases"} <= names and "metadata.json" not in names, names


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    base = tmp_path_factory.mktemp("resume-artifacts")
    from bytecp.manager import CheckpointManager

    mgr = CheckpointManager(str(base / "plain"), every_n_steps=10, keep_last=None, incremental=False)
    for step in STEPS:
        mgr.save(step, {"model": plain_model(step)})
        hf_checkpoint(base / "plain_hf" / f"checkpoint-{step}", plain_model(step).state_dict())
    _titan(base)
    _lightning(base)
    _killed(base)
    yield base
