"""``exclude=``: entries left out of a load keep their values, are neither
read nor reported, and a strict load that fails on whole entries says which
to exclude."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from bytecp.storage.local import LocalStorage
from torch import nn

import bytecp


def trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = nn.Linear(4, 3)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    return m, opt


@pytest.fixture
def ck(tmp_path: Path) -> str:
    m, opt = trained(0)
    url = str(tmp_path / "ck")
    bytecp.save(url, {"model": m, "optimizer": opt, "extra": {"step": 3, "note": "saved"}})
    return url


def test_a_strict_load_of_part_of_a_checkpoint_names_what_to_exclude(ck: str) -> None:
    with pytest.raises(bytecp.StateMismatchError, match=r"exclude=\['extra', 'optimizer'\]"):
        bytecp.load(ck, {"model": nn.Linear(4, 3)})
    # and the other way round: the state holds an entry the checkpoint has nothing of
    with pytest.raises(bytecp.StateMismatchError, match=r"exclude=\['engine', 'extra', 'optimizer'\]"):
        bytecp.load(ck, {"model": nn.Linear(4, 3), "engine": {"steps": 0}})


def test_excluded_entries_keep_their_values_and_are_not_read(ck: str, monkeypatch: pytest.MonkeyPatch) -> None:
    saved, _ = trained(0)
    m, opt = trained(5)
    before = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    extra = {"step": 0, "note": "mine"}
    data_bytes: list[int] = []
    real, real_summed = LocalStorage.read_ranges, LocalStorage.read_ranges_summed

    def spy(self: LocalStorage, path: str, ranges: list, **kw: Any) -> None:  # type: ignore[type-arg]
        if path.startswith("data/"):
            data_bytes.extend(len(out) for _, out in ranges)
        real(self, path, ranges, **kw)

    def spy_summed(self: LocalStorage, path: str, ranges: list, spans: Any) -> Any:  # type: ignore[type-arg]
        if path.startswith("data/"):
            data_bytes.extend(len(out) for _, out in ranges)
        return real_summed(self, path, ranges, spans)

    monkeypatch.setattr(LocalStorage, "read_ranges", spy)
    monkeypatch.setattr(LocalStorage, "read_ranges_summed", spy_summed)
    res = bytecp.load(ck, {"model": m, "optimizer": opt, "extra": extra}, exclude=["optimizer", "extra.note"])
    assert res.missing_keys == [] and res.unexpected_keys == []
    assert torch.equal(m.weight, saved.weight) and torch.equal(m.bias, saved.bias)
    for k, v in opt.state_dict()["state"][0].items():  # untouched
        assert torch.equal(v, before[k]), k
    assert extra == {"step": 3, "note": "mine"}
    assert sum(data_bytes) == (12 + 3) * 4  # the model's tensors alone were read
    sd = bytecp.load_state_dict(ck, exclude=["optimizer"])
    assert set(sd) == {"model", "extra"} and sd["extra"] == {"step": 3, "note": "saved"}


def test_plain_values_of_the_state_are_replaced_beside_an_excluded_entry(tmp_path: Path) -> None:
    m, opt = trained(0)
    bytecp.save(str(tmp_path / "ck"), {"model": m, "step": 7, "optimizer": opt})
    state = {"model": nn.Linear(4, 3), "step": 0, "optimizer": trained(1)[1]}
    bytecp.load(str(tmp_path / "ck"), state, exclude=["optimizer"])
    assert state["step"] == 7 and torch.equal(state["model"].weight, m.weight)  # type: ignore[union-attr]


def test_bad_exclude_values_are_refused(ck: str) -> None:
    for bad in ("optimizer", ["", "x"], [".optimizer"], ["optimizer."], [3]):
        with pytest.raises(bytecp.ConfigError, match="exclude must be a list of dotted names"):
            bytecp.load(ck, {"model": nn.Linear(4, 3)}, exclude=bad)  # type: ignore[arg-type]
