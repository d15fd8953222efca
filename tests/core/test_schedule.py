"""The orders of a save (bytecp.saving.schedule) in one process: which
phases run, in which order, on which thread; the phases hand each other
frozen values and leave no state on the pipeline."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import bytecp
from bytecp.saving.pipeline import SavePipeline
from bytecp.saving.results import SavePlanResult

from .helpers import same_bits

PHASES = ("describe", "share", "snapshot", "plan", "stage", "write", "commit", "report")


def _record(monkeypatch: pytest.MonkeyPatch) -> tuple[list[tuple[str, str]], list[SavePipeline], list[Any]]:
    """Every phase call as (phase, 'caller' | 'background'); the pipelines built; the plans returned."""
    calls: list[tuple[str, str]] = []
    pipelines: list[SavePipeline] = []
    plans: list[Any] = []
    main = threading.get_ident()
    init = SavePipeline.__init__

    def recording_init(self: SavePipeline, *a: Any, **kw: Any) -> None:
        init(self, *a, **kw)
        pipelines.append(self)

    monkeypatch.setattr(SavePipeline, "__init__", recording_init)
    for name in PHASES:
        def wrap(fn: Any, name: str = name) -> Any:
            def phase(self: SavePipeline, *a: Any, **kw: Any) -> Any:
                calls.append((name, "caller" if threading.get_ident() == main else "background"))
                out = fn(self, *a, **kw)
                if name == "plan":
                    plans.append(out)
                return out
            return phase
        monkeypatch.setattr(SavePipeline, name, wrap(getattr(SavePipeline, name)))
    return calls, pipelines, plans


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 3))
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(4, 32)).pow(2).mean().backward()
    opt.step()
    return {"model": m, "optimizer": opt}


C, B = "caller", "background"


@pytest.mark.parametrize("kw,expected", [
    ({}, [("describe", C), ("share", C), ("snapshot", C), ("plan", B), ("stage", B), ("write", B), ("commit", B),
          ("report", B)]),
    ({"lazy": True}, [("describe", C), ("share", B), ("snapshot", B), ("plan", B), ("stage", B), ("write", B),
                      ("commit", B), ("report", B)]),
    ({"memory_budget_bytes": 4096}, [("describe", C), ("plan", C), ("stage", C), ("write", B),
                                     ("commit", B), ("report", B)]),
], ids=["eager", "lazy", "budgeted"])
def test_each_async_order_runs_its_phases_in_sequence(tmp_path: Path, monkeypatch, kw, expected) -> None:
    calls, pipelines, plans = _record(monkeypatch)
    state = _state()
    want = {k: v.clone() for k, v in state["model"].state_dict().items()}
    bytecp.async_save(str(tmp_path / "ck"), state, **kw).wait(timeout=60)
    assert calls == expected
    # the plan is a frozen value; the pipeline keeps its inputs (the incremental base is one) and the kept failure only
    assert isinstance(plans[0], SavePlanResult)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plans[0].save_id = "x"
    assert set(vars(pipelines[0])) == {"storage", "state", "opts", "ctx", "trace", "stager", "version", "incremental", "_kept",
                                       "serving"}
    assert pipelines[0]._kept is None
    got = bytecp.load_state_dict(str(tmp_path / "ck"))["model"]
    assert all(same_bits(v, got[k]) for k, v in want.items())


def test_a_save_runs_every_phase_on_the_caller_thread(tmp_path: Path, monkeypatch) -> None:
    calls, _, _ = _record(monkeypatch)
    bytecp.save(str(tmp_path / "ck"), _state())
    assert calls == [(p, C) for p in ("describe", "plan", "stage", "write", "commit", "report")]
