"""``BytecpCheckpointIO`` in one process (no torch.distributed): the mapping of
Lightning's checkpoint dict onto bytecp, asynchronous saves, removals that
wait for the save in flight, failures, and the errors a user can meet.
The multi-process behaviour is in ``test_lightning.py``."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("pytorch_lightning", reason="pytorch-lightning is not installed (make test installs it)")

from bytecp.adapters.lightning import (  # noqa: E402
    BytecpCheckpointIO,
    BytecpDDPStrategy,
    BytecpModelParallelStrategy,
    latest_checkpoint,
)
from pytorch_lightning.plugins.io import TorchCheckpointIO  # noqa: E402

from bytecp.errors import ConfigError, StateMismatchError  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    return model, torch.optim.Adam(model.parameters(), lr=0.5)


def checkpoint(model: nn.Module, opt: torch.optim.Optimizer | None, step: int) -> dict[str, Any]:
    """What a bytecp strategy hands the IO: Lightning's dict with the live objects."""
    ck: dict[str, Any] = {"epoch": 0, "global_step": step, "state_dict": model,
                          "loops": {"fit_loop": {"epoch_progress": {"total": {"completed": step}}}},
                          "callbacks": {"ModelCheckpoint{'monitor': 'step'}": {"best_model_score": torch.tensor(step)}}}
    if opt is not None:
        ck.update(optimizer_states=[opt], lr_schedulers=[{"last_epoch": step}])
    return ck


def test_roundtrip_fills_the_live_objects_bitwise(tmp_path: Path) -> None:
    model, opt = trained()
    io = BytecpCheckpointIO()
    io.save_checkpoint(checkpoint(model, opt, 7), tmp_path / "step=7.ckpt")
    io.wait()
    m2, o2 = fresh()
    state = io.load_into(tmp_path / "step=7.ckpt", m2, [o2])
    for (n, a), b in zip(model.state_dict().items(), m2.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    sa, sb = opt.state_dict(), o2.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i, st in sa["state"].items():
        for k, v in st.items():
            assert torch.equal(v, sb["state"][i][k]), (i, k)
    assert state["global_step"] == 7 and state["lr_schedulers"] == [{"last_epoch": 7}]
    assert torch.equal(state["callbacks"]["ModelCheckpoint{'monitor': 'step'}"]["best_model_score"], torch.tensor(7))
    assert "state_dict" not in state and "optimizer_states" not in state


def test_async_save_returns_before_the_commit_and_removal_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = trained()
    io = BytecpCheckpointIO()
    io.save_checkpoint(checkpoint(model, opt, 1), tmp_path / "step=1.ckpt")
    io.wait()
    monkeypatch.setenv("BYTECP_FAULT_DELAY", "commit:0:1.0")
    io.save_checkpoint(checkpoint(model, opt, 2), tmp_path / "step=2.ckpt")
    assert io.handle is not None and not io.handle.done()
    assert not (tmp_path / "step=2.ckpt" / "metadata.json").exists()
    io.remove_checkpoint(tmp_path / "step=1.ckpt")  # save_top_k: deferred until step 2 commits
    assert (tmp_path / "step=1.ckpt" / "metadata.json").exists()
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "step=1.ckpt")
    io.wait()
    assert (tmp_path / "step=2.ckpt" / "metadata.json").exists()
    assert not (tmp_path / "step=1.ckpt").exists()
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "step=2.ckpt")


def test_a_failed_save_deletes_nothing_and_raises_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = trained()
    io = BytecpCheckpointIO()
    io.save_checkpoint(checkpoint(model, opt, 1), tmp_path / "step=1.ckpt")
    io.wait()
    monkeypatch.setenv("BYTECP_FAULT_DELAY", "write:0:0.5")
    monkeypatch.setenv("BYTECP_FAULT_ERROR", "write:0")
    io.save_checkpoint(checkpoint(model, opt, 2), tmp_path / "step=2.ckpt")
    io.remove_checkpoint(tmp_path / "step=1.ckpt")
    with pytest.raises(Exception, match="injected failure in phase 'write'"):
        io.wait()
    io.wait()  # raised once: Lightning's second teardown after the error does not raise it again
    io.remove_checkpoint(tmp_path / "step=1.ckpt")  # still refused: the last save failed
    assert (tmp_path / "step=1.ckpt" / "metadata.json").exists()
    assert not (tmp_path / "step=2.ckpt" / "metadata.json").exists()
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "step=1.ckpt")
    monkeypatch.delenv("BYTECP_FAULT_ERROR")
    monkeypatch.delenv("BYTECP_FAULT_DELAY")
    io.save_checkpoint(checkpoint(model, opt, 3), tmp_path / "step=3.ckpt")  # the error is not raised again here
    io.wait()
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "step=3.ckpt")


def test_overwrite_replaces_a_checkpoint_of_the_same_name(tmp_path: Path) -> None:
    model, opt = trained()
    io = BytecpCheckpointIO(async_save=False)
    io.save_checkpoint(checkpoint(model, opt, 1), tmp_path / "last.ckpt")
    io.save_checkpoint(checkpoint(model, opt, 2), tmp_path / "last.ckpt")
    assert io.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 2


def test_weights_only_checkpoint_cannot_resume_training(tmp_path: Path) -> None:
    model, _ = trained()
    io = BytecpCheckpointIO(async_save=False)
    io.save_checkpoint(checkpoint(model, None, 4), tmp_path / "w.ckpt")
    m2, o2 = fresh()
    with pytest.raises(ConfigError, match="save_weights_only=True"):
        io.load_into(tmp_path / "w.ckpt", m2, [o2])
    io.load_into(tmp_path / "w.ckpt", m2, [])  # validate/test: the weights alone
    assert torch.equal(m2[0].weight, model[0].weight)


def test_model_keys_checked_when_strict(tmp_path: Path) -> None:
    model, opt = trained()
    io = BytecpCheckpointIO(async_save=False)
    io.save_checkpoint(checkpoint(model, opt, 1), tmp_path / "c.ckpt")
    bigger = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2), nn.Linear(2, 2))
    with pytest.raises(StateMismatchError, match=r"missing from the checkpoint \(2\): \['model.3.weight', 'model.3.bias'\]"):
        io.load_into(tmp_path / "c.ckpt", bigger, [])
    io.load_into(tmp_path / "c.ckpt", bigger, [], strict=False)
    assert torch.equal(bigger[2].weight, model[2].weight)


def test_a_checkpoint_not_saved_by_the_plugin_is_named(tmp_path: Path) -> None:
    import bytecp

    model, opt = trained()
    bytecp.save(str(tmp_path / "plain"), {"model": model, "optimizer": opt})
    m2, o2 = fresh()
    with pytest.raises(ConfigError, match="not saved by bytecp's Lightning plugin"):
        BytecpCheckpointIO().load_into(tmp_path / "plain", m2, [o2])
    with pytest.raises(ConfigError, match="not saved by bytecp's Lightning plugin"):
        BytecpCheckpointIO().load_checkpoint(tmp_path / "plain")


def test_a_plain_state_dict_needs_a_bytecp_strategy(tmp_path: Path) -> None:
    model, _ = trained()
    with pytest.raises(ConfigError, match="use a bytecp strategy"):
        BytecpCheckpointIO().save_checkpoint({"state_dict": copy.deepcopy(model.state_dict())}, tmp_path / "x")


def test_options_are_validated() -> None:
    with pytest.raises(ConfigError, match="lazy=True needs async_save=True"):
        BytecpCheckpointIO(async_save=False, lazy=True)
    with pytest.raises(ConfigError, match=r"save_options may not set \['step'\]"):
        BytecpCheckpointIO(save_options={"step": 3})
    with pytest.raises(ConfigError, match=r"load_options may not set \['strict'\]"):
        BytecpCheckpointIO(load_options={"strict": False})


def test_strategies_take_only_bytecp_checkpoint_io() -> None:
    io = BytecpCheckpointIO(lazy=True)
    assert BytecpDDPStrategy(checkpoint_io=io).checkpoint_io is io
    assert BytecpModelParallelStrategy(checkpoint_io=io).checkpoint_io is io
    assert isinstance(BytecpDDPStrategy().checkpoint_io, BytecpCheckpointIO)
    with pytest.raises(ConfigError, match="checkpoints through BytecpCheckpointIO, not TorchCheckpointIO"):
        BytecpDDPStrategy(checkpoint_io=TorchCheckpointIO())
    strategy = BytecpModelParallelStrategy()
    with pytest.raises(ConfigError, match="not TorchCheckpointIO"):
        strategy.checkpoint_io = TorchCheckpointIO()


def test_latest_checkpoint_of_a_missing_directory(tmp_path: Path) -> None:
    assert latest_checkpoint(str(tmp_path / "nothing-here")) is None


def test_trainer_plugins_set_the_options() -> None:
    import pytorch_lightning as pl

    io = BytecpCheckpointIO(lazy=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=BytecpDDPStrategy(), plugins=[io],
                         logger=False, enable_progress_bar=False, enable_model_summary=False)
    assert trainer.strategy.checkpoint_io is io
    with pytest.raises(ConfigError, match="not TorchCheckpointIO"):
        pl.Trainer(accelerator="cpu", devices=1, strategy=BytecpDDPStrategy(), plugins=[TorchCheckpointIO()],
                   logger=False)


def test_public_names_resolve() -> None:
    import bytecp.adapters.lightning as plugin

    for name in plugin.__all__:
        assert getattr(plugin, name) is not None, name
