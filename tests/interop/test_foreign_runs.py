"""A run folder written by another checkpointer: CheckpointManager.restore
resumes from its newest checkpoint of any format bytecp reads, then saves
bytecp checkpoints beside it; step folders no format reads are an error
naming them, never a silent fresh start; nothing of theirs is deleted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import bytecp
from bytecp.interop.runs import foreign_checkpoints, step_of
from bytecp.manager import CheckpointManager


def _trainer_checkpoint(run: Path, step: int, model: nn.Module) -> Path:
    """What the Hugging Face Trainer leaves: ``checkpoint-<step>/model.safetensors``."""
    folder = run / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    return folder


def test_step_folder_names_of_each_framework() -> None:
    assert [step_of(n) for n in ("step-12", "global_step7", "iter_0000300", "checkpoint-40",
                                 "epoch=1-step=99.ckpt", "step_5", "latest", "step-x", "epoch=0-step=6-v1.ckpt",
                                 "global_step2_universal")] == \
        [12, 7, 300, 40, 99, 5, None, None, 6, 2]


def test_restore_from_another_format_then_save_beside_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    torch.manual_seed(0)
    old = nn.Linear(4, 3)
    _trainer_checkpoint(run, 10, nn.Linear(4, 3))
    _trainer_checkpoint(run, 20, old)
    found, unreadable = foreign_checkpoints(str(run))
    assert [(c.step, c.format) for c in found] == [(10, "huggingface"), (20, "huggingface")] and not unreadable

    model = nn.Linear(4, 3)
    mgr = CheckpointManager(str(run), every_n_steps=1, keep_last=1)
    assert mgr.restore({"model": model}) == 20
    assert torch.equal(model.weight, old.weight) and torch.equal(model.bias, old.bias)

    # the job goes on in bytecp; retention keeps one bytecp checkpoint and never
    # touches the other format's folders (it did not write them)
    for step in (21, 22):
        with torch.no_grad():
            model.weight.add_(1.0)
        mgr.save(step, {"model": model})
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-10", "checkpoint-20", "step-21", "step-22"]
    assert sorted(p.name for p in (run / "step-21").iterdir()) == ["base.json", "data"]  # a retired base
    fresh = nn.Linear(4, 3)
    assert CheckpointManager(str(run)).restore({"model": fresh}) == 22
    assert torch.equal(fresh.weight, old.weight + 2.0)


def test_unreadable_newer_step_folder_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "global_step30").mkdir(parents=True)
    (run / "global_step30" / "weights.bin").write_bytes(b"\0" * 64)
    mgr = CheckpointManager(str(run))
    with pytest.raises(bytecp.ResumeDecisionError, match=r"no format bytecp reads .*global_step30"):
        mgr.restore({"model": nn.Linear(2, 2)})
    # an older unreadable folder under a loadable newer checkpoint is left alone
    _trainer_checkpoint(run, 40, nn.Linear(2, 2))
    assert mgr.restore({"model": nn.Linear(2, 2)}) == 40
    assert (run / "global_step30" / "weights.bin").exists()


def test_a_pure_bytecp_run_reads_no_other_folder(tmp_path: Path) -> None:
    run = tmp_path / "run"
    mgr = CheckpointManager(str(run), every_n_steps=1)
    mgr.save(3, {"x": torch.ones(2)})
    (run / "notes").mkdir()
    x = torch.zeros(2)
    assert mgr.restore({"x": x}) == 3 and torch.equal(x, torch.ones(2))
    assert foreign_checkpoints(str(run), after_step=3) == ([], [])
