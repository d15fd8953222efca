"""Targets of one load that share memory (a Megatron fp32 model's parameters
and its distributed optimizer's main parameters, views of them) are never
filled by two reader threads at once: they are read in waves, the later
target of the state after the earlier one, whatever the threads' timing, and
without a copy of their bytes held meanwhile. Read straight into the shared
memory at once, one thread's bytes could land between another's read and its
checksum (a sound checkpoint refused: ``checksum mismatch``), and which
values stayed was a race.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import bytecp
from bytecp.loading.reader import Target, target_waves
from bytecp.tree.regions import Region


def _t(view: torch.Tensor) -> Target:
    return Target("x", Region((0,) * view.dim(), tuple(view.shape)), view)


def test_targets_whose_memory_meets_are_read_in_later_waves() -> None:
    a = torch.zeros(10, 10)
    b = torch.zeros(10)
    c = torch.zeros(4, 4)
    views = [a, a.view(-1)[50:60], b, a[:, 3], c[0], c[1], torch.zeros(0)]
    # a slice of a after a; a column of a after both (it meets each)
    assert target_waves([_t(v) for v in views]) == [0, 1, 0, 2, 0, 0, 0]
    assert target_waves([_t(c[0]), _t(c[1]), _t(c[2:])]) == [0, 0, 0]  # adjacent rows do not meet
    assert target_waves([_t(c[:, 0]), _t(c[:, 1])]) == [0, 1]  # interleaved columns: taken as meeting
    params = [torch.zeros(8) for _ in range(3)]  # a model's parameters, then mains that are views of them
    assert target_waves([_t(p) for p in params] + [_t(p[2:6]) for p in params]) == [0, 0, 0, 1, 1, 1]


@pytest.fixture()
def ck(tmp_path: Path) -> tuple[str, dict[str, torch.Tensor]]:
    """A model weight and its optimizer main saved with different values (as a TP save's
    replicas that drifted apart by rounding record them), and other tensors, 8 x 1 MiB each."""
    torch.manual_seed(0)
    saved = {"model": {"w": torch.randn(512, 512), "u": torch.randn(256, 1024)},
             "optim": {"w": torch.randn(512 * 512), "v": torch.randn(1 << 18)},
             "other": [torch.randn(1 << 18) for _ in range(4)]}
    bytecp.save(str(tmp_path / "ck"), saved)
    return str(tmp_path / "ck"), {"model.w": saved["model"]["w"], "optim.w": saved["optim"]["w"],
                                  "model.u": saved["model"]["u"], "optim.v": saved["optim"]["v"]}


@pytest.mark.parametrize("optim_last", [True, False])
def test_shared_memory_holds_the_later_entry_whatever_the_threads_timing(
        ck: tuple[str, dict[str, torch.Tensor]], optim_last: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    url, want = ck
    monkeypatch.setenv("BYTECP_FAULT_HANDOFF", "*:0.002")  # widen every read -> check -> place hand-off
    monkeypatch.setattr("bytecp.loading.reader.READ_BATCH_MIN_BYTES", 64 << 10)  # many batches, many threads
    for _ in range(8):
        mem = torch.zeros(512, 512)
        model = {"w": mem, "u": torch.zeros(256, 1024)}
        optim = {"w": mem.view(-1), "v": torch.zeros(1 << 18)}
        others = [torch.zeros(1 << 18) for _ in range(4)]
        state = {"model": model, "optim": optim, "other": others} if optim_last else \
            {"optim": optim, "model": model, "other": others}
        bytecp.load(url, state, io_threads=8)
        later = want["optim.w"].view(512, 512) if optim_last else want["model.w"]
        assert torch.equal(mem, later)
        assert torch.equal(model["u"], want["model.u"]) and torch.equal(optim["v"], want["optim.v"])


def test_the_megatron_case_is_reproduced_without_megatron(ck: tuple[str, dict[str, torch.Tensor]],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The shape of the Megatron-Core MoE failure: two loads in one process, the second filling
    a model and the optimizer mains that are views of it, with eight reader threads: no
    checksum error, and the optimizer's values in the shared memory."""
    url, want = ck
    monkeypatch.setenv("BYTECP_FAULT_HANDOFF", "read,check:0.002")
    mem = torch.zeros(512, 512)
    bytecp.load(url, {"model": {"w": mem}}, strict=False, io_threads=8)
    assert torch.equal(mem, want["model.w"])
    for _ in range(4):
        bytecp.load(url, {"model": {"w": mem, "u": torch.zeros(256, 1024)},
                          "optim": {"w": mem.view(-1), "v": torch.zeros(1 << 18)}}, strict=False, io_threads=8)
        assert torch.equal(mem.view(-1), want["optim.w"])
    assert os.environ["BYTECP_FAULT_HANDOFF"]
