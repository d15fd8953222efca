"""``BytecpCheckpointManager`` in one process with torchtitan's real
optimizer and scheduler containers: the policy fields and the errors a user
sees (the trainer-level cases are in test_torchtitan.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 is installed by `make torchtitan-install`")

from bytecp.adapters.torchtitan import BytecpCheckpointManager  # noqa: E402
from torchtitan.components.optimizer import OptimizersContainer, default_adamw  # noqa: E402
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer  # noqa: E402

import bytecp  # noqa: E402
from bytecp.errors import StateMismatchError  # noqa: E402


class TrainState:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]


def _manager(folder: Path, seed: int = 0, manager: Any = BytecpCheckpointManager,
             **config: Any) -> tuple[Any, nn.Module, TrainState]:
    """A tiny model with torchtitan's real optimizer and scheduler containers
    under ``manager`` (bytecp's, or torchtitan's own DCP one)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    opt_config = default_adamw(lr=1e-2)
    opt_config.implementation = "for-loop"
    optimizers = OptimizersContainer(opt_config, model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=10)
    train = TrainState()
    cfg = manager.Config(enable=True, folder=str(folder), **config)
    mgr = cfg.build(dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
                    states={"train_state": train}, sd_adapter=None)
    return mgr, model, train


def _train(model: nn.Module, mgr: BytecpCheckpointManager, train: TrainState, steps: int) -> None:
    for _ in range(steps):
        train.step += 1
        model(torch.randn(4, 8)).square().mean().backward()
        mgr.maybe_wait_for_staging()
        mgr.states["optimizer"].step()
        mgr.states["optimizer"].zero_grad()
        mgr.states["lr_scheduler"].step()
        mgr.save(train.step, last_step=train.step == 6)


@pytest.mark.parametrize("mode", ["disabled", "async", "lazy"])
def test_interval_retention_last_step_and_resume(tmp_path: Path, mode: str) -> None:
    mgr, model, train = _manager(tmp_path, interval=2, keep_latest_k=2, async_mode=mode)
    _train(model, mgr, train, 6)
    mgr.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4", "step-6"]
    assert list(bytecp.load_state_dict(str(tmp_path / "step-6"))) == ["model"]  # last_save_model_only
    full = bytecp.load_state_dict(str(tmp_path / "step-4"))
    assert full["train_state"] == {"step": 4} and full["lr_scheduler"] == {"last_epoch": 4}

    again, model2, train2 = _manager(tmp_path, seed=1, load_step=4)
    assert again.load(step=4) and train2.step == 4
    for k, v in model2.state_dict().items():
        assert torch.equal(v, full["model"][k]), k
    for k, v in again.states["optimizer"].state_dict().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, full["optimizer"][k]), k


def test_errors_name_the_setting(tmp_path: Path) -> None:
    mgr, model, train = _manager(tmp_path, interval=2)
    _train(model, mgr, train, 2)
    other, _, _ = _manager(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"load_step=3: .*committed steps in .*: 2\)"):
        other.load(step=3)
    bad, _, _ = _manager(tmp_path, exclude_from_loading=["dataloader"])
    with pytest.raises(ValueError, match="exclude_from_loading names 'dataloader'"):
        bad.load()
    model_only = tmp_path / "seed"
    bytecp.save(str(model_only / "step-9"), {"model": model.state_dict()}, framework="torchtitan")
    full, _, _ = _manager(tmp_path / "new", initial_load_path=str(model_only / "step-9"),
                          initial_load_model_only=False)
    with pytest.raises(StateMismatchError, match="holds no lr_scheduler, optimizer, train_state state .*"
                                                 "initial_load_model_only=True, or list them"):
        full.load()
    fresh, _, _ = _manager(tmp_path / "empty")
    assert fresh.load() is False


def _poison_dcp_hf_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch DCP's load and its Hugging Face reader raise if anything calls them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import hf_storage

    def poisoned(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("torch DCP's Hugging Face reader was used")

    monkeypatch.setattr(hf_storage.HuggingFaceStorageReader, "__init__", poisoned)
    monkeypatch.setattr(dcp, "load", poisoned)


def test_initial_load_in_hf_reads_through_bytecp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchtitan's llama3 debug model and state-dict adapter: a safetensors
    directory of ``to_hf`` (bf16 on disk, one tensor the model lacks) read by
    bytecp, never by DCP's reader; equal to ``from_hf`` of the files, cast."""
    from safetensors.torch import load_file, save_file
    from torchtitan.models.llama3 import model_registry

    spec = model_registry("debugmodel")
    adapter = spec.state_dict_adapter(spec.model, None)
    torch.manual_seed(0)
    source = spec.model.build()
    source.init_weights()
    hf = {k: v.to(torch.bfloat16).contiguous() for k, v in adapter.to_hf(source.state_dict()).items()}
    hf["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # ignored, as torchtitan's reader does
    (tmp_path / "hf").mkdir()
    save_file(hf, str(tmp_path / "hf" / "model.safetensors"))

    torch.manual_seed(1)
    model = spec.model.build()
    model.init_weights()
    opt_config = default_adamw(lr=1e-2)
    opt_config.implementation = "for-loop"
    optimizers = OptimizersContainer(opt_config, model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=10)
    cfg = BytecpCheckpointManager.Config(enable=True, folder=str(tmp_path / "ck"), initial_load_in_hf=True,
                                         initial_load_path=str(tmp_path / "hf"))
    mgr = cfg.build(dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
                    states={}, sd_adapter=adapter)
    assert not torch.equal(model.lm_head.weight, source.lm_head.weight.to(torch.bfloat16).float())
    _poison_dcp_hf_reader(monkeypatch)
    assert mgr.load()
    ref = adapter.from_hf(load_file(str(tmp_path / "hf" / "model.safetensors")))
    live = model.state_dict()
    assert set(live) <= set(ref)
    for k, v in live.items():
        assert v.dtype == torch.float32 and torch.equal(v, ref[k].float()), k

    del hf["model.norm.weight"]
    save_file(hf, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(bytecp.BytecpError, match=r"initial_load_in_hf: 1 of the model's tensors "
                                                 r"\(model.norm.weight, .*not in .*hf"):
        mgr.load()


def test_a_folder_of_dcp_checkpoints_resumes_bitwise(tmp_path: Path) -> None:
    """torchtitan's DCP backend saved step 4 (model tensors flattened to the top,
    as it does); bytecp's manager on the same folder resumes from it bitwise:
    model, optimizer, scheduler and train state."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        _dcp_then_bytecp(tmp_path / "run")
    finally:
        dist.destroy_process_group()


def _dcp_then_bytecp(tmp_path: Path) -> None:
    from torchtitan.components.checkpoint import CheckpointManager

    mgr, model, train = _manager(tmp_path, manager=CheckpointManager, interval=2, last_save_model_only=False)
    optimizers, schedulers = mgr.states["optimizer"], mgr.states["lr_scheduler"]
    for _ in range(4):
        train.step += 1
        model(torch.randn(4, 8)).square().mean().backward()
        optimizers.step()
        optimizers.zero_grad()
        schedulers.step()
        mgr.save(train.step)
    mgr.close()
    assert (tmp_path / "step-4" / ".metadata").exists()
    want_opt = {k: v.clone() for k, v in optimizers.state_dict().items() if isinstance(v, torch.Tensor)}

    again, model2, train2 = _manager(tmp_path, seed=1)
    assert again.load() and train2.step == 4
    for k, v in model2.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
    got = again.states["optimizer"].state_dict()
    for k, v in want_opt.items():
        assert torch.equal(got[k], v), k
    assert again.states["lr_scheduler"].state_dict() == schedulers.state_dict()


def test_a_stray_newer_step_folder_is_never_a_fresh_start(tmp_path: Path) -> None:
    """bytecp's step-10 and step-20, and a step-30 holding one stray file: the
    manager's ``load()`` refuses naming step-30 (it once read the listing's
    error as "no checkpoints" and trained from step 0 over the run), also with
    ``initial_load_path`` set; ``load_step=20`` still loads what was asked."""
    mgr, model, train = _manager(tmp_path / "run", interval=10, keep_latest_k=0)
    _train(model, mgr, train, 20)
    mgr.close()
    (tmp_path / "run" / "step-30").mkdir()
    (tmp_path / "run" / "step-30" / "stray.txt").write_text("x")
    seed = tmp_path / "seed"
    bytecp.save(str(seed / "step-0"), {"model": model.state_dict()}, framework="torchtitan")
    for config in ({}, {"initial_load_path": str(seed / "step-0")}):
        again, _, train2 = _manager(tmp_path / "run", seed=1, **config)
        with pytest.raises(bytecp.ResumeDecisionError, match=r"step-30.*newer than any checkpoint that loads"):
            again.load()
        assert train2.step == 0
    explicit, _, train3 = _manager(tmp_path / "run", seed=1, load_step=20)
    assert explicit.load(step=20) and train3.step == 20
