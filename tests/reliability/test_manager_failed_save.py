"""The manager reports a failed or timed-out asynchronous save and the next
save proceeds: the error is logged, sent to the recorders (``save_failed``)
and listed in ``manager.failed``; training is never stopped by it, nothing
of the failed save stays on disk, and the next save commits."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from bytecp import recorder
from bytecp.manager import CheckpointManager


class Events:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, str]]] = []

    def on_report(self, report: object) -> None:
        pass

    def on_start(self, *args: object, **kwargs: object) -> None:
        pass

    def on_event(self, name: str, value: float, labels: dict[str, str]) -> None:
        self.events.append((name, dict(labels)))


@pytest.mark.parametrize("fault,why", [
    ({"BYTECP_FAULT_ERROR": "write:0"}, "RuntimeError"),
    ({"BYTECP_FAULT_DELAY": "write:0:3.2"}, "TimeoutError"),  # past save_timeout_s=3: never commits
], ids=["failed", "timed-out"])
def test_failed_async_save_is_reported_and_the_next_save_proceeds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture,
                                                                  fault: dict[str, str], why: str) -> None:
    state = {"w": torch.arange(1000.0)}
    mgr = CheckpointManager(str(tmp_path), every_n_steps=1, async_save=True, save_timeout_s=3.0, keep_last=2)
    events = recorder.add_recorder(Events())
    try:
        mgr.save(1, state)
        mgr.wait()
        for k, v in fault.items():
            monkeypatch.setenv(k, v)
        with caplog.at_level(logging.ERROR, logger="bytecp.manager"):
            mgr.save(2, state)
            assert mgr._pending is not None
            mgr._pending.wait_done()
            for k in fault:
                monkeypatch.delenv(k)
            state["w"] += 1
            mgr.save(3, state)  # does not raise step 2's error
            mgr.wait()
    finally:
        recorder.remove_recorder(events)
    assert [u for u, _ in mgr.failed] == [str(tmp_path / "step-2")]
    assert why in mgr.failed[0][1], mgr.failed
    assert [lab for n, lab in events.events if n == "save_failed"] == [{"reason": why}]
    assert "step-2 failed" in caplog.text and "next save proceeds" in caplog.text
    assert [p for p in (tmp_path / "step-2").rglob("*") if p.is_file()] == []  # nothing of step 2 left
    assert mgr.latest().step == 3
    back = {"w": torch.zeros(1000)}
    assert mgr.restore(back) == 3 and torch.equal(back["w"], torch.arange(1000.0) + 1)
