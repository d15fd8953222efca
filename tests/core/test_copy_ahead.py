"""An eager save of a state unchanged since the previous one copies while it
describes the state (:mod:`bytecp.saving.ahead`): the guess is taken only
when the description hits the kept placement, and whatever happens between
saves -- values changed in place, a parameter given new memory, an
optimizer state given other (empty) memory by ``set_``, a storage freed (no
guess starts then) and grown again (at the same address or not),
a save that fails after the guess started, the arena poisoned between saves
in debug mode -- every file is byte for byte a blocking save's of the same
state."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import bytecp
from bytecp.saving.staging import POOL
from bytecp.storage_api import open_storage
from bytecp.tools.inspect import verify

from .helpers import same_bits


def _contents(root: Path) -> list[bytes]:
    return sorted(p.read_bytes() for p in (root / "data").rglob("*.bin"))


def _job() -> tuple[nn.Module, torch.optim.Optimizer, dict[str, object]]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(300, 301), nn.ReLU(), nn.Linear(301, 7), nn.Linear(7, 7))
    opt = torch.optim.Adam(m.parameters())
    return m, opt, {"model": m, "optimizer": opt}


def _step(m: nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    m(torch.randn(4, 300, generator=torch.Generator().manual_seed(i))).sum().backward()
    opt.step()
    opt.zero_grad()


def _same_as_blocking(tmp_path: Path, state: dict[str, object], m: nn.Module, name: str) -> None:
    # (from a copy: a blocking save's views of the live tensors leave their storages unresizable)
    bytecp.save(str(tmp_path / f"{name}-sync"), copy.deepcopy(state))
    assert _contents(tmp_path / name) == _contents(tmp_path / f"{name}-sync"), name
    checked, problems = verify(open_storage(str(tmp_path / name)))
    assert checked and not problems, (name, problems)
    got = bytecp.load_state_dict(str(tmp_path / name))["model"]
    assert all(same_bits(got[k], v) for k, v in m.state_dict().items()), name


@pytest.mark.parametrize("debug", [False, True])
def test_eager_saves_copy_while_describing_and_write_what_a_blocking_save_writes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, debug: bool) -> None:
    if debug:  # the arena is poisoned at each release: the guess writes the padding again
        monkeypatch.setenv("BYTECP_DEBUG_BUFFERS", "1")
    m, opt, state = _job()
    _step(m, opt, 0)
    for i in range(3):  # described, laid out, planned; then reused whole once
        bytecp.async_save(str(tmp_path / f"warm{i}"), state).wait(timeout=60)
    guessed = POOL.guessed
    whole = True
    events = ["same", "same", "new memory", "same", "freed and grown", "same", "same", "emptied", "same", "same"]
    for i, what in enumerate(events):
        _step(m, opt, i + 1)  # every value changes in place, as training does
        w = m[2].weight
        if what == "new memory":  # the same parameter object, other memory: described afresh
            w.data = w.detach().clone()
        elif what == "freed and grown":  # a framework freeing a storage in place, then filling it again
            keep = w.detach().clone()
            w.untyped_storage().resize_(0)
            assert POOL.copy_ahead(checksums=False) is None  # a guess would read freed memory: none starts
            w.untyped_storage().resize_(keep.numel() * keep.element_size())
            with torch.no_grad():
                w.copy_(keep)
        elif what == "emptied":  # an optimizer state given other, empty memory (``set_``): never read through
            emptied = opt.state[m[0].weight]["exp_avg"]
            kept = emptied.clone()
            emptied.set_(torch.empty(0))
        before, reused = POOL.guessed, POOL.reused
        bytecp.async_save(str(tmp_path / f"s{i}"), state).wait(timeout=60)
        _same_as_blocking(tmp_path, state, m, f"s{i}")
        if what == "emptied":  # (the next step needs it)
            emptied.set_(kept)
        if what == "same" and whole:  # the save before reused the placement whole: this one's guess is taken
            assert POOL.guessed == before + 1, (i, what)
        if what in ("new memory", "emptied"):  # a guess ran (the last save reused the placement whole), not taken
            assert POOL.guessed == before, (i, what)
        whole = POOL.reused > reused
    assert POOL.guessed >= guessed + 3


def test_a_save_that_fails_after_its_guess_started_leaves_the_next_save_sound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m, opt, state = _job()
    _step(m, opt, 0)
    for i in range(3):
        bytecp.async_save(str(tmp_path / f"warm{i}"), state).wait(timeout=60)
    _step(m, opt, 1)
    monkeypatch.setenv("BYTECP_FAULT_ERROR", "stage:0")  # after the guess started, before the snapshot took it
    with pytest.raises(Exception, match="stage"):
        bytecp.async_save(str(tmp_path / "failed"), state).wait(timeout=60)
    monkeypatch.delenv("BYTECP_FAULT_ERROR")
    assert not (tmp_path / "failed" / "metadata.json").exists()
    for i in range(3):
        _step(m, opt, 2 + i)
        bytecp.async_save(str(tmp_path / f"after{i}"), state).wait(timeout=60)
        _same_as_blocking(tmp_path, state, m, f"after{i}")


def test_incremental_eager_saves_of_a_few_changed_boxes_take_no_guess(tmp_path: Path) -> None:
    """A manager's eager saves of a state most of which is frozen copy the
    boxes that changed: no guess is taken (one that starts after a full save
    is stopped once the state is described), and every step loads bitwise."""
    torch.manual_seed(1)
    m = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 4))
    for p in m[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam([p for p in m.parameters() if p.requires_grad])
    state = {"model": m, "optimizer": opt}
    mgr = bytecp.CheckpointManager(str(tmp_path / "run"), every_n_steps=1, keep_last=None, async_save=True)
    guessed = POOL.guessed
    for step in range(1, 7):
        m(torch.randn(4, 256, generator=torch.Generator().manual_seed(step))).sum().backward()
        opt.step()
        opt.zero_grad()
        mgr.maybe_save(step, state)
        mgr.wait()
        got = bytecp.load_state_dict(str(tmp_path / "run" / f"step-{step}"))["model"]
        assert all(same_bits(got[k], v) for k, v in m.state_dict().items()), step
    assert POOL.guessed == guessed


def test_a_guess_its_save_lost_is_ended_before_the_arena_is_used_again(tmp_path: Path) -> None:
    """A guess whose save was interrupted between starting it and taking it
    (a KeyboardInterrupt there) still writes into the arena: the pool ends it
    before the next stage, of any kind, uses the arena."""
    m, opt, state = _job()
    _step(m, opt, 0)
    for i in range(3):
        bytecp.async_save(str(tmp_path / f"warm{i}"), state).wait(timeout=60)
    for i, lazy in enumerate([True, False, False]):
        _step(m, opt, 1 + i)
        lost = POOL.copy_ahead(checksums=False)  # started, never taken
        assert lost is not None
        bytecp.async_save(str(tmp_path / f"s{i}"), state, lazy=lazy).wait(timeout=60)
        assert lost.run.stopped, i
        _same_as_blocking(tmp_path, state, m, f"s{i}")
