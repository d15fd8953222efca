"""Prewarm: the staging arena is allocated before the first asynchronous
save, so that save allocates nothing (it blocks like the later ones)."""

from __future__ import annotations

from pathlib import Path

import bytecp
from bytecp.saving.staging import POOL

from .helpers import same_bits
from .test_async import model_and_opt


def test_prewarm_allocates_the_arena_the_first_save_uses(tmp_path: Path) -> None:
    m, opt = model_and_opt()
    state = {"model": m, "optim": opt}
    POOL.release()
    before = POOL.allocations
    bytecp.prewarm(state)
    assert POOL.allocations == before + 1
    bytecp.prewarm(state)  # again: the arena is large enough
    for lazy in (False, True):
        bytecp.async_save(str(tmp_path / f"c{lazy}"), state, lazy=lazy).wait()
    assert POOL.allocations == before + 1
    m2, opt2 = model_and_opt(seed=1)
    bytecp.load(str(tmp_path / "cTrue"), {"model": m2, "optim": opt2})
    for k, v in m.state_dict().items():
        assert same_bits(v, m2.state_dict()[k])
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            assert same_bits(v, opt2.state_dict()["state"][i][k])


def test_manager_prewarms_on_its_first_step(tmp_path: Path) -> None:
    m, opt = model_and_opt()
    POOL.release()
    before = POOL.allocations
    mgr = bytecp.CheckpointManager(str(tmp_path), every_n_steps=2, async_save=True)
    state = {"model": m, "optim": opt}
    assert not mgr.maybe_save(1, state)  # not a save step, yet the arena is there
    assert POOL.allocations == before + 1
    mgr.maybe_save(2, state)
    mgr.wait()
    assert POOL.allocations == before + 1
