"""bytecp's own adapters run the adapter contract (``bytecp.adapters.testing``)
that third-party adapters run: plain in this process, DDP and FSDP2 on the
shared 2-rank gloo pool."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from bytecp.adapters.testing import AdapterCase, AdapterContract, AdapterFixtures

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
