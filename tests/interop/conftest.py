"""The spawned gloo pools of tests/dist, shared with the DCP source tests."""

from __future__ import annotations

from tests.dist.conftest import pools

__all__ = ["pools"]
