"""Shared test settings: hypothesis profile and small helpers."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", max_examples=200, deadline=None)
settings.register_profile("dev", max_examples=60, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# every save in the tests compares replicated boxes across ranks (off by
# default for users: it costs a checksum pass); spawned ranks inherit it
os.environ.setdefault("BYTECP_VERIFY_REPLICAS", "1")
