"""Every dtype, shape and view round-trips bitwise through save/load (one process)."""

from __future__ import annotations

import math
import uuid

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import bytecp
from bytecp.format.metadata import ALIGNMENT
from bytecp.tree.dtypes import SUPPORTED_DTYPES

from .helpers import random_tensor, same_bits
from .index_tools import index_rows

DTYPES = list(SUPPORTED_DTYPES.values())


def mem_url() -> str:
    return f"memory://bytecp-tests/{uuid.uuid4().hex}"


@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple),
    seed=st.integers(0, 2**16),
    view=st.sampled_from(["plain", "transpose", "step", "narrow"]),
)
def test_every_dtype_shape_and_view_roundtrips(dtype: torch.dtype, shape: tuple, seed: int, view: str) -> None:
    base = random_tensor(shape, dtype, seed)
    t = base
    if view == "transpose" and base.dim() >= 2:
        t = base.transpose(0, 1)
    elif view == "step" and base.dim() >= 1:
        t = base[::2]
    elif view == "narrow" and base.dim() >= 1 and base.shape[0] > 1:
        t = base[1:]
    url = mem_url()
    bytecp.save(url, {"t": t, "twice": [t, {"x": t}]})
    sd = bytecp.load_state_dict(url)
    assert same_bits(sd["t"], t)
    assert same_bits(sd["twice"][0], t) and same_bits(sd["twice"][1]["x"], t)
    # in-place load into a fresh tensor of the same shape
    dest = torch.zeros_like(t.contiguous()) if dtype != SUPPORTED_DTYPES.get("float4_e2m1fn_x2") else torch.empty_like(t.contiguous())
    bytecp.load(url, {"t": dest, "twice": [None, {"x": None}]}, strict=False)
    assert same_bits(dest, t)


def test_views_store_logical_contents_only(tmp_path) -> None:
    big = torch.arange(1000, dtype=torch.float64)
    view = big[10:20]
    bytecp.save(str(tmp_path / "ck"), {"v": view})
    table = index_rows(tmp_path / "ck")
    assert table.column("nbytes").to_pylist() == [80]
    data_bytes = sum(p.stat().st_size for p in (tmp_path / "ck" / "data").rglob("*.bin"))
    assert data_bytes == ALIGNMENT  # one 80-byte chunk, padded to the alignment
    assert torch.equal(bytecp.load_state_dict(str(tmp_path / "ck"))["v"], view)


def test_chunks_are_aligned(tmp_path) -> None:
    state = {f"t{i}": torch.randn(1000 + i) for i in range(7)}
    bytecp.save(str(tmp_path / "ck"), state)
    offsets = index_rows(tmp_path / "ck").column("byte_offset").to_pylist()
    assert len(offsets) == 7 and all(off % ALIGNMENT == 0 for off in offsets)


def test_module_optimizer_and_values_roundtrip_in_place(tmp_path) -> None:
    torch.manual_seed(0)

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        m = nn.Sequential(nn.Embedding(11, 5), nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 1))
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

    m, opt = make()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        loss = m(torch.randint(0, 11, (4, 3))).pow(2).mean()
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    extra = {"step": 2, "tokens": 1.5e9, "tags": ["a", "b"], "nested": {"pair": (1, "x")}, "none": None}
    state = {"model": m, "optimizer": opt, "sched": sched, "extra": extra}
    url = str(tmp_path / "ck")
    bytecp.save(url, state, step=2)

    m2, opt2 = make()
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    extra2: dict = {"step": 0, "tokens": 0.0, "tags": [], "nested": {"pair": None}, "none": 1}
    res = bytecp.load(url, {"model": m2, "optimizer": opt2, "sched": sched2, "extra": extra2})
    assert res.missing_keys == [] and res.unexpected_keys == []
    for (k, a), b in zip(m.state_dict().items(), m2.state_dict().values(), strict=True):
        assert same_bits(a, b), k
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for i in s1["state"]:
        for k in s1["state"][i]:
            assert same_bits(s1["state"][i][k], s2["state"][i][k]), (i, k)
    assert sched2.state_dict() == sched.state_dict()
    assert extra2 == extra
    # training continues identically
    x = torch.randint(0, 11, (4, 3))
    for mm, oo in ((m, opt), (m2, opt2)):
        mm(x).pow(2).mean().backward()
        oo.step()
    for a, b in zip(m.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_load_state_dict_gives_plain_tensors(tmp_path) -> None:
    m = nn.Linear(3, 2)
    bytecp.save(str(tmp_path / "ck"), {"model": m, "extra": {"epoch": 4}})
    sd = bytecp.load_state_dict(str(tmp_path / "ck"))
    fresh = nn.Linear(3, 2)
    fresh.load_state_dict(sd["model"])
    assert torch.equal(fresh.weight, m.weight) and sd["extra"] == {"epoch": 4}


def test_rng_state_restores_streams(tmp_path) -> None:
    import random

    import numpy as np

    rng = bytecp.RNGState()
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    bytecp.save(str(tmp_path / "ck"), {"rng": rng})
    want = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    bytecp.load(str(tmp_path / "ck"), {"rng": rng})
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(want[0], got[0]) and (want[1] == got[1]).all() and want[2] == got[2]


@pytest.mark.parametrize("n", [0, 1, 4097])
def test_empty_scalar_and_odd_sizes(tmp_path, n: int) -> None:
    t = torch.arange(n, dtype=torch.int16)
    s = torch.tensor(3.5, dtype=torch.bfloat16)
    url = str(tmp_path / f"ck{n}")
    bytecp.save(url, {"t": t, "s": s, "e": torch.empty(0, 3)})
    sd = bytecp.load_state_dict(url)
    assert same_bits(sd["t"], t) and same_bits(sd["s"], s) and sd["e"].shape == (0, 3)
    assert math.prod(sd["e"].shape) == 0
