"""A save of a state whose structure is unchanged reuses the last description
(bytecp.adapters._watch); every change between two saves is seen, and the
checkpoint holds exactly the state at the call, bitwise, under its names.

Each case saves, changes the state one way, saves again, steps and saves
once more, in each save order (``bytecp.save``, eager and lazy
``async_save``); every checkpoint is read back whole and compared with the
live state's own state dicts at the time of its save."""

from __future__ import annotations

import gc
import json
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from bytecp.adapters import _watch
from bytecp.adapters._watch import DESCRIBE_STATS
from torch import nn

import bytecp
from bytecp.saving.reuse import LAST_SAVES

from .helpers import same_bits

MODES = ("sync", "eager", "lazy")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin1 = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.lin2 = nn.Linear(6, 3)
        self.frozen = nn.Linear(3, 3)
        self.frozen.weight.requires_grad_(False)
        self.frozen.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.lin2(torch.relu(self.bn(self.lin1(x)))))


class Counting(torch.optim.Optimizer):
    """SGD with plain scalars in its state (a step count, a running float)."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                st["n"] = st.get("n", 0) + 1
                st["last"] = float(p.grad.abs().sum())
                st["buf"] = st.get("buf", torch.zeros_like(p))
                st["buf"].mul_(0.5).add_(p.grad)
                p.add_(st["buf"], alpha=-g["lr"])


def train(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(8, 4, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def save(mode: str, url: str, state: dict[str, Any]) -> None:
    if mode == "sync":
        bytecp.save(url, state)
    else:
        bytecp.async_save(url, state, lazy=mode == "lazy").wait()


def reference(state: dict[str, Any]) -> dict[str, Any]:
    """The live state as torch's own state dicts give it, named as bytecp names it."""
    out: dict[str, Any] = {}
    names: dict[int, str] = {}
    for k, v in state.items():
        if isinstance(v, nn.Module):
            out[k] = {n: t.clone() for n, t in v.state_dict().items()}
            names.update({id(p): n for n, p in v.named_parameters()})
    for k, v in state.items():
        if isinstance(v, torch.optim.Optimizer):
            index = {id(p): i for i, p in enumerate(p for g in v.param_groups for p in g["params"])}
            st = {}
            for p, entries in v.state.items():
                fqn = names.get(id(p), str(index[id(p)]))
                st[fqn] = {n: x.clone() if isinstance(x, torch.Tensor) else x for n, x in entries.items()}
            groups = [dict({n: x for n, x in g.items() if n != "params"},
                           params=[names.get(id(p), str(index[id(p)])) for p in g["params"]]) for g in v.param_groups]
            out[k] = {"state": st, "param_groups": groups}
        elif not isinstance(v, nn.Module):
            out[k] = v.clone() if isinstance(v, torch.Tensor) else v
    return out


def same(got: Any, want: Any, where: str = "") -> None:
    """Bitwise for tensors, exact for everything else, the same keys throughout."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and same_bits(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{where}: {sorted(got)} != {sorted(want)}"
        for k in want:
            same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            same(a, b, f"{where}.{i}")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def saved_and_checked(mode: str, url: str, state: dict[str, Any]) -> None:
    want = reference(state)
    save(mode, url, state)
    same(bytecp.load_state_dict(url), want, url)


def new_parameter(m: Net, o: Any) -> None:
    m.lin2.register_parameter("extra", nn.Parameter(torch.randn(3)))


def new_submodule(m: Net, o: Any) -> None:
    m.head = nn.Linear(3, 2)


def reshaped(m: Net, o: Any) -> None:
    m.lin1.weight.data = m.lin1.weight.data.reshape(3, 8)


def reshaped_same_pointer(m: Net, o: Any) -> None:
    m.lin2.weight.data = m.lin2.weight.data.view(-1)  # the same memory, another shape


def dtype_changed(m: Net, o: Any) -> None:
    m.lin2.double()


def dtype_reinterpreted(m: Net, o: Any) -> None:
    m.bn.running_mean.data = m.bn.running_mean.data.view(torch.int32)  # same storage, sizes, strides


def replaced_by_another_object(m: Net, o: Any) -> None:
    m.bn.running_var = torch.rand(6) + 1  # a new buffer object of the same shape
    p = m.lin1.weight
    o.state[p]["exp_avg"] = torch.randn_like(o.state[p]["exp_avg"])


def data_swapped(m: Net, o: Any) -> None:
    m.lin1.weight.data = torch.randn(6, 4)
    p = m.lin2.bias
    o.state[p]["exp_avg_sq"].data = torch.rand(3)


def parameter_unset(m: Net, o: Any) -> None:
    m.lin2.bias = None


def buffer_made_non_persistent(m: Net, o: Any) -> None:
    m.bn._non_persistent_buffers_set.add("num_batches_tracked")


def post_hook_added(m: Net, o: Any) -> None:
    def hook(module: nn.Module, sd: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        sd[prefix + "hooked"] = torch.full((2,), 7.0)

    m.lin2.register_state_dict_post_hook(hook)


def unfrozen(m: Net, o: Any) -> None:
    m.frozen.weight.requires_grad_(True)  # in the optimizer all along: its state appears at the next step


def param_group_added(m: Net, o: Any) -> None:
    extra = nn.Parameter(torch.randn(5))
    m.register_parameter("late", extra)
    o.add_param_group({"params": [extra], "lr": 0.5})
    extra.grad = torch.ones(5)


CHANGES: dict[str, Callable[[Net, Any], None]] = {f.__name__: f for f in (
    new_parameter, new_submodule, reshaped, reshaped_same_pointer, dtype_changed, dtype_reinterpreted,
    replaced_by_another_object, data_swapped, parameter_unset, buffer_made_non_persistent, post_hook_added,
    unfrozen, param_group_added,
)}


#: changes after which the model cannot train (another shape or dtype under a layer)
BREAK_TRAINING = {"reshaped", "reshaped_same_pointer", "dtype_changed", "dtype_reinterpreted"}


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("mode", MODES)
def test_every_change_is_seen(tmp_path: Path, mode: str, change: str) -> None:
    m = Net()
    o = torch.optim.Adam(m.parameters(), lr=1e-2)
    state = {"model": m, "optim": o, "extra": {"step": 1}}
    train(m, o, 0)
    saved_and_checked(mode, str(tmp_path / "a"), state)
    kept = DESCRIBE_STATS.kept
    train(m, o, 1)
    state["extra"]["step"] = 2
    saved_and_checked(mode, str(tmp_path / "b"), state)  # values moved in place: the description is kept
    assert DESCRIBE_STATS.kept == kept + 1
    CHANGES[change](m, o)
    described = DESCRIBE_STATS.described
    saved_and_checked(mode, str(tmp_path / "c"), state)
    # (unfreezing alone changes nothing a checkpoint holds: the optimizer's state appears at the next step)
    assert DESCRIBE_STATS.described == described + (change != "unfrozen"), "a stale description was used"
    for step in (2, 3):
        if change not in BREAK_TRAINING:
            train(m, o, step)  # (the first step after unfreezing or a new group adds their state)
        kept = DESCRIBE_STATS.kept
        saved_and_checked(mode, str(tmp_path / f"d{step}"), state)
    # the new description is kept in turn (a module with a state-dict hook never is)
    assert DESCRIBE_STATS.kept == kept + (change != "post_hook_added")


@pytest.mark.parametrize("mode", MODES)
def test_optimizer_state_that_appears_after_the_first_step(tmp_path: Path, mode: str) -> None:
    m = Net()
    o = torch.optim.Adam(m.parameters(), lr=1e-2)
    state = {"model": m, "optim": o}
    saved_and_checked(mode, str(tmp_path / "a"), state)  # no optimizer state yet
    saved_and_checked(mode, str(tmp_path / "b"), state)
    train(m, o, 0)
    described = DESCRIBE_STATS.described
    saved_and_checked(mode, str(tmp_path / "c"), state)
    assert DESCRIBE_STATS.described == described + 1


@pytest.mark.parametrize("mode", MODES)
def test_plain_values_are_read_at_every_save(tmp_path: Path, mode: str) -> None:
    """Hyperparameters, scalar optimizer state and values outside modules
    change between saves without a new description, and each checkpoint
    holds those of its own save."""
    m = Net()
    o = Counting(m.parameters())
    state = {"model": m, "optim": o, "epoch": 0, "rng": {"seed": 1}}
    train(m, o, 0)
    saved_and_checked(mode, str(tmp_path / "a"), state)
    for i in range(1, 4):
        kept = DESCRIBE_STATS.kept
        train(m, o, i)
        o.param_groups[0]["lr"] = 0.1 / (i + 1)
        state["epoch"] = i
        state["rng"] = {"seed": i, "more": [i, i + 1]}
        saved_and_checked(mode, str(tmp_path / f"s{i}"), state)
        assert DESCRIBE_STATS.kept == kept + 1
    assert bytecp.load_state_dict(str(tmp_path / "s3"))["optim"]["state"]["lin1.weight"]["n"] == 4


@pytest.mark.parametrize("order", ["model first", "tensor first"])
def test_a_tensor_shared_with_another_entry_is_stored_once(tmp_path: Path, order: str) -> None:
    """Aliases across the pieces and the rest of the state are found as a full
    walk finds them, at every save."""
    m = Net()
    o = torch.optim.Adam(m.parameters(), lr=1e-2)
    train(m, o, 0)
    entries = [("model", m), ("optim", o), ("tied", m.lin1.weight)]
    state = dict(entries if order == "model first" else entries[::-1])
    for i in range(3):
        url = str(tmp_path / str(i))
        bytecp.save(url, state)
        got = bytecp.load_state_dict(url)
        assert same_bits(got["tied"], m.lin1.weight.detach()) and same_bits(got["model"]["lin1.weight"], got["tied"])
        aliases = json.loads((tmp_path / str(i) / "metadata.json").read_text())["aliases"]
        assert aliases == ({"tied": "model.lin1.weight"} if order == "model first" else {"model.lin1.weight": "tied"})
        train(m, o, i + 1)


def test_tied_parameters_inside_a_module(tmp_path: Path) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(5, 4)
            self.head = nn.Linear(4, 5, bias=False)
            self.head.weight = self.emb.weight  # one Parameter under two names

    m = Tied()
    o = torch.optim.Adam(m.parameters(), lr=1e-2)
    state = {"model": m, "optim": o}
    kept = DESCRIBE_STATS.kept
    for i in range(3):
        m.head(m.emb(torch.tensor([[i, 4 - i]]))).sum().backward()
        o.step()
        url = tmp_path / str(i)
        saved_and_checked("sync", str(url), state)
        assert json.loads((url / "metadata.json").read_text())["aliases"] == {"model.head.weight": "model.emb.weight"}
    assert DESCRIBE_STATS.kept == kept + 2


def test_descriptions_go_with_the_model(tmp_path: Path) -> None:
    """No kept description holds a saved model or optimizer (or their tensors)
    once the job drops them (the incremental saves' record of the last save,
    which keeps that save's tensors until the next save, aside)."""
    m = Net()
    o = torch.optim.Adam(m.parameters(), lr=1e-2)
    train(m, o, 0)
    for i in range(2):
        bytecp.async_save(str(tmp_path / str(i)), {"model": m, "optim": o}, lazy=True).wait()
    refs = [weakref.ref(m), weakref.ref(o), weakref.ref(m.lin1.weight), weakref.ref(o.state[m.lin1.weight]["exp_avg"])]
    before = len(_watch._ENTRIES)
    del m, o
    LAST_SAVES.clear()
    gc.collect()
    assert [r() for r in refs] == [None] * 4
    assert len(_watch._ENTRIES) == before - 1


def test_a_module_whose_state_dict_is_its_own_is_described_at_every_save(tmp_path: Path) -> None:
    class Custom(Net):
        def get_extra_state(self) -> Any:
            return {"calls": self.calls}

        def set_extra_state(self, state: Any) -> None:
            self.calls = state["calls"]

    m = Custom()
    m.calls = 0
    o = torch.optim.Adam(m.parameters(), lr=1e-2)
    state = {"model": m, "optim": o}
    for i in range(3):
        m.calls = i
        described = DESCRIBE_STATS.described
        train(m, o, i)
        bytecp.save(str(tmp_path / str(i)), state)
        assert DESCRIBE_STATS.described == described + 1
        assert bytecp.load_state_dict(str(tmp_path / str(i)))["model"]["_extra_state"] == {"calls": i}


@pytest.mark.parametrize("mode", ["eager", "lazy"])  # (a blocking save hands numpy the live storage: not resizable)
def test_a_storage_reallocated_in_place_is_described_afresh(tmp_path: Path, mode: str) -> None:
    """A parameter whose storage is freed and reallocated in place (as FSDP2
    does with its unsharded parameters) is still ``is_set_to`` the view kept,
    but at another address: described afresh, saved and loaded bitwise."""
    m = Net()
    o = torch.optim.Adam(m.parameters(), lr=1e-2)
    state = {"model": m, "optim": o}
    train(m, o, 0)
    saved_and_checked(mode, str(tmp_path / "0"), state)
    w = m.lin1.weight
    values, storage = w.detach().clone(), w.untyped_storage()
    old = w.data_ptr()
    nbytes = storage.nbytes()
    storage.resize_(0)
    keep = [torch.empty(values.numel()) for _ in range(64)]  # the old block goes to someone else
    storage.resize_(nbytes)
    with torch.no_grad():
        w.copy_(values * 2)
    assert w.data_ptr() != old and len(keep) == 64
    described = DESCRIBE_STATS.described
    saved_and_checked(mode, str(tmp_path / "1"), state)
    assert DESCRIBE_STATS.described == described + 1
