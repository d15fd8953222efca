"""CheckpointManager with a memory tier (keeper://): memory checkpoints every
N steps, drained to storage every M, restored from the newest complete tier --
the local keeper, a peer when the local copy is gone, storage when no keeper
holds one."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import torch
from bytecp.storage.keeper_server import Keeper
from keepers import TOKEN, spec, start_keepers
from torch import nn

import bytecp
from bytecp.catalog import list_checkpoints


def model_and_opt(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(64, 129), nn.ReLU(), nn.Linear(129, 3))
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    step(m, opt)
    return m, opt


def step(m: nn.Module, opt: torch.optim.Optimizer) -> None:
    m(torch.randn(8, 64)).pow(2).mean().backward()
    opt.step()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(
        torch.equal(a.view(torch.uint8) if a.dim() else a.reshape(1).view(torch.uint8),
                    b.view(torch.uint8) if b.dim() else b.reshape(1).view(torch.uint8)))


def bitwise(m, opt, m2, opt2) -> None:  # type: ignore[no-untyped-def]
    for k, v in m.state_dict().items():
        assert same_bits(v, m2.state_dict()[k]), k
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            assert same_bits(v, opt2.state_dict()["state"][i][k]), (i, k)


def wait_for_storage(run: Path, step_: int) -> None:
    deadline = time.time() + 30
    while time.time() < deadline:
        if any(c.step == step_ for c in list_checkpoints(str(run))):
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step_} never drained to {run}")


@pytest.mark.parametrize("async_save", [False, True])
def test_memory_tier_drains_and_restores_from_the_fastest_tier(tmp_path: Path, async_save: bool) -> None:
    keepers: list[Keeper] = start_keepers(["h0", "h1"])
    try:
        opts = {"keepers": spec(keepers), "host": "h0", "token": TOKEN}
        mem_url = f"keeper://job/{tmp_path.name}-{async_save}"
        mk = lambda: bytecp.CheckpointManager(  # noqa: E731
            str(tmp_path / "run"), every_n_steps=4, memory_url=mem_url, memory_every_n_steps=2,
            memory_storage_options=opts, async_save=async_save, keep_last=2)
        m, opt = model_and_opt()
        mgr = mk()
        saved = {}
        for s in range(1, 7):
            step(m, opt)
            mgr.maybe_save(s, {"model": m, "optim": opt})
            if s == 4:
                mgr.wait()
                saved[4] = model_and_opt(seed=9)
                bytecp.load(mem_url + "/step-4", {"model": saved[4][0], "optim": saved[4][1]}, storage_options=opts)
        mgr.wait()
        wait_for_storage(tmp_path / "run", 4)
        # memory step 6 is newer than storage step 4: from the local keeper
        m2, opt2 = model_and_opt(seed=1)
        assert mk().restore({"model": m2, "optim": opt2}) == 6
        bitwise(m, opt, m2, opt2)
        # this host's keeper lost everything (a replaced host): from the peer
        keepers[0].op_delete({"paths": ["job"]}, memoryview(b""))
        m3, opt3 = model_and_opt(seed=2)
        mgr3 = mk()
        assert mgr3.restore({"model": m3, "optim": opt3}) == 6 and mgr3.restored_from == "memory"
        bitwise(m, opt, m3, opt3)
        # the newest memory checkpoint lost its data with every copy: skipped, never loaded in part;
        # step 4, complete in memory and as new as storage's newest, loads from memory
        keepers[1].op_delete({"paths": [f"{mem_url[len('keeper://'):]}/step-6/data"]}, memoryview(b""))
        m5, opt5 = model_and_opt(seed=4)
        mgr5 = mk()
        assert mgr5.restore({"model": m5, "optim": opt5}) == 4 and mgr5.restored_from == "memory"
        assert [u for u, _ in mgr5.skipped] == [mem_url + "/step-6"]
        bitwise(*saved[4], m5, opt5)
        # no keeper holds a copy: from storage, the drained step 4
        keepers[1].op_delete({"paths": ["job"]}, memoryview(b""))
        m4, opt4 = model_and_opt(seed=3)
        mgr4 = mk()
        assert mgr4.restore({"model": m4, "optim": opt4}) == 4 and mgr4.restored_from == "storage"
        bitwise(*saved[4], m4, opt4)
    finally:
        for k in keepers:
            k.close()


def test_a_checkpoint_evicted_at_one_keeper_is_never_restored_in_part(tmp_path: Path) -> None:
    """replicas=1: each file is held by one keeper, metadata.json by all. One
    keeper evicts step 2 while its peer does not hear of it: the peer still
    lists step 2, whose data is gone; restore skips it and loads step 1."""
    keepers = start_keepers(["p0", "p1"], replicas=1)
    try:
        opts = {"keepers": spec(keepers), "host": "p0", "token": TOKEN}
        mem_url = f"keeper://job/{tmp_path.name}"
        mk = lambda: bytecp.CheckpointManager(  # noqa: E731
            str(tmp_path / "run"), every_n_steps=10**6, memory_url=mem_url, memory_every_n_steps=1,
            memory_storage_options=opts, memory_keep_last=3)
        m, opt = model_and_opt()
        mgr = mk()
        mgr.maybe_save(1, {"model": m, "optim": opt})
        saved = copy.deepcopy((m, opt))  # the state step 1 holds, taken from the training objects
        step(m, opt)
        mgr.maybe_save(2, {"model": m, "optim": opt})
        keepers[0]._evict(f"{mem_url[len('keeper://'):]}/step-2")  # here only: p1 keeps its metadata.json
        assert [c.step for c in list_checkpoints(mem_url, storage_options=opts)] == [1, 2]
        m2, opt2 = model_and_opt(seed=1)
        mgr2 = mk()
        assert mgr2.restore({"model": m2, "optim": opt2}) == 1 and mgr2.restored_from == "memory"
        assert [u for u, _ in mgr2.skipped] == [mem_url + "/step-2"]
        bitwise(*saved, m2, opt2)
    finally:
        for k in keepers:
            k.close()
