"""bytecp's own adapters run the adapter contract (``bytecp.adapters.testing``)
that third-party adapters run: plain in this process, DDP and FSDP2 on the
shared 2-rank gloo pool."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from bytecp.adapters import testing
from bytecp.adapters.plain import PlainAdapter
from bytecp.adapters.testing import (
    AdapterCase,
    AdapterContract,
    AdapterFixtures,
    ReplicaHintTests,
    RoundTripTests,
)

from bytecp import adapter_api
from bytecp.tree.state import ReplicaSet, TensorLeaf

pytestmark = pytest.mark.timeout(300)


class PlainFixtures(AdapterFixtures):
    @pytest.fixture
    def case(self) -> AdapterCase:
        return AdapterCase(framework="plain", build="tests.dist.adapter_cases:plain_state")


class TestPlainAdapter(PlainFixtures, AdapterContract):
    pass


class TwoRanks(AdapterFixtures):
    @pytest.fixture
    def run_on_ranks(self, pools: Any) -> Callable[..., list[Any]]:
        return lambda fn, *args: pools(2).run(fn, *args)


class TestDDPAdapter(TwoRanks, AdapterContract):
    @pytest.fixture
    def case(self) -> AdapterCase:
        return AdapterCase(framework="ddp", build="tests.dist.adapter_cases:ddp_state")


class TestFSDP2Adapter(TwoRanks, AdapterContract):
    @pytest.fixture
    def case(self) -> AdapterCase:
        return AdapterCase(framework="fsdp2", build="tests.dist.adapter_cases:fsdp2_state")


@pytest.mark.slow
class TestHSDPAdapter(AdapterFixtures, RoundTripTests, ReplicaHintTests):
    """FSDP2 on a 2 x 2 (replicate, shard) mesh: hints name replica pairs."""

    @pytest.fixture
    def case(self) -> AdapterCase:
        return AdapterCase(framework="fsdp2", build="tests.dist.adapter_cases:hsdp_state")

    @pytest.fixture
    def run_on_ranks(self, pools: Any) -> Callable[..., list[Any]]:
        return lambda fn, *args: pools(4).run(fn, *args)


# ------------------------------------------------ the contract catches bugs
class ForgetfulAdapter(PlainAdapter):
    """Loads into copies of the module's tensors: the module keeps its values."""

    name = "forgetful"

    def module_targets(self, call: Any, module: Any) -> Any:
        target, fin = super().module_targets(call, module)
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in target.items()}, fin


class OverclaimingAdapter(PlainAdapter):
    """Names a replica that does not exist (rank 1 in a world of one)."""

    name = "overclaiming"

    def tensor_leaf(self, t: torch.Tensor) -> Any:
        return TensorLeaf.full(t, ReplicaSet.of((0, 1)))


@pytest.fixture
def broken_adapters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapter_api, "_ADAPTERS", dict(adapter_api._ADAPTERS))
    monkeypatch.setattr(adapter_api, "_ORDER", list(adapter_api._ORDER))
    adapter_api.register_adapter("forgetful", ForgetfulAdapter, before=None)
    adapter_api.register_adapter("overclaiming", OverclaimingAdapter, before=None)


def test_contract_catches_a_load_that_misses_the_live_tensors(broken_adapters: None, tmp_path: Path) -> None:
    case = AdapterCase(framework="forgetful", build="tests.dist.adapter_cases:plain_state")
    problems = testing.check_round_trip(case, str(tmp_path / "c"))
    assert any("tensor model.l1.weight differs" in p for p in problems), problems


def test_contract_catches_wrong_replica_hints(broken_adapters: None) -> None:
    case = AdapterCase(framework="overclaiming", build="tests.dist.adapter_cases:plain_state")
    problems = testing.check_replica_hints(case)
    assert any("names rank 1 a replica" in p for p in problems), problems
    box = ((0,), (4,), "d")
    # a box held by two ranks that each claim it alone; boxes with a gap; no hint
    every = [{"t": ((8,), (0,), (box,))}, {"t": ((8,), (1,), (box,))}]
    assert any("held by ranks [0, 1]" in p for p in testing._hint_problems(every, True))
    assert any("do not tile" in p for p in testing._hint_problems(every, True))
    assert any("no replica hint" in p for p in testing._hint_problems([{"t": ((4,), None, (box,))}], True))
    assert not testing._hint_problems([{"t": ((4,), None, (box,))}], False)
