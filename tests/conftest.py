"""Shared test settings: hypothesis profile, the ``spawn`` marker's guard
(tests/spawning.py: ``make check`` runs the tests that start no process), warm
interpreters (tests/warm.py). docs/contributing.md says how to write a fast test.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from typing import Any

import pytest
import spawning
import torch
from hypothesis import settings

settings.register_profile("ci", max_examples=200, deadline=None)
settings.register_profile("dev", max_examples=60, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# every save in the tests compares replicated boxes across ranks (off by
# default for users: it costs a checksum pass); spawned ranks inherit it
os.environ.setdefault("BYTECP_VERIFY_REPLICAS", "1")

# one OpenMP thread for every process the tests start, ranks and servers included (they
# inherit it): three workers and their ranks share two cores, where every process's team
# spun beside the others' (the suite took 740-760 s with teams, 660 s without). The test
# processes themselves keep torch's count for this machine, so that async saves copy on
# as many threads as a user's (``min(8, torch.get_num_threads())``).
_THREADS = torch.get_num_threads()  # (torch imported above, before the variable is set)
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(_THREADS)


def pytest_configure(config: pytest.Config) -> None:
    spawning.install()
    # a plugin, not this conftest's hooks: a conftest's pytest_fixture_setup
    # is not called for session-scoped fixtures (their node is the session,
    # above this folder)
    config.pluginmanager.register(spawning, "bytecp-spawning")


# ---------------------------------------------------------------------- longest files first
#: the test files that take longest (make test's --durations, summed per file), in that
#: order. make test runs on three workers, each taking the next whole file as it finishes
#: one (``--dist loadfile``): started first, the long files end together instead of one
#: of them running alone at the end. A file that grows long belongs here. (Reordered
#: strictly by a three-worker run's durations, a fresh clone took 553 s; with this order
#: 515 s and 534 s from fresh clones, 516 s in a working checkout: within the spread of
#: runs here, and this order has more runs behind it.)
LONGEST_FIRST = (
    "tests/bench/test_bench_smoke.py",  # make bench-check's longest
    "tests/core/test_exit.py",
    "tests/megatron/test_megatron_moe.py",
    "tests/storage/test_resume_matrix.py",
    "tests/integrations/test_torchtitan.py",
    "tests/zero/test_deepspeed_adapter.py",
    "tests/interop/test_torch_dist_source.py",
    "tests/reliability/test_crash.py",
    "tests/megatron/test_megatron_adapter.py",
    "tests/export/test_dcp_export.py",
    "tests/demo/test_demo.py",
    "tests/dist/test_deadline.py",
    "tests/dist/test_layouts.py",
    "tests/reliability/test_chaos.py",
    "tests/integrations/test_lightning.py",
    "tests/storage/test_save_race.py",
    "tests/storage/test_storage_s3.py",
    "tests/data/test_hf_datasets_reshard.py",
    "tests/export/test_export_memory.py",
    "tests/integrations/test_lightning_data.py",
    "tests/core/test_scale_sim.py",
    "tests/serving/test_follow.py",
    "tests/dist/test_reshard.py",
    "tests/core/test_scale_retention.py",
    "tests/storage/test_storage_faults.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the files of :data:`LONGEST_FIRST` first, in its order; the others keep theirs."""
    first = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.partition("::")[0], len(first)))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what the imports and the collection made (a million objects with
    transformers, DeepSpeed and Megatron-Core imported) out of the collector's
    sight: every full collection the tests cause would walk it again. Thawed
    at the session's end (:func:`pytest_unconfigure`)."""
    gc.freeze()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Thaw what :func:`pytest_collection_finish` froze: objects still frozen when
    the interpreter ends are never freed, and triton's bindings print a leak
    report for theirs."""
    gc.unfreeze()


# ---------------------------------------------------------------------- warm interpreters
_warm: dict[tuple[str, ...], Any] = {}


@pytest.fixture(scope="session")
def warm() -> Iterator[Any]:
    """``warm(*preload)``: a warm interpreter (tests/warm.py) that imported
    torch, bytecp and ``preload``, one per set of modules for the session;
    ``.popen``/``.run`` as subprocess's, at a fork's cost."""
    from warm import DEFAULT_PRELOAD, Warm

    def get(*preload: str) -> Warm:
        key = tuple(dict.fromkeys((*DEFAULT_PRELOAD, *preload)))
        w = _warm.get(key)
        if w is None or not w.alive:
            w = _warm[key] = Warm(key)
        return w

    yield get
    for w in _warm.values():
        w.close()
    _warm.clear()
