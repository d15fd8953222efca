"""A worker process of the save-race test: an independent one-process job
that saves its own tiny state to the URL it is handed, at a barrier."""

from __future__ import annotations

import os
from typing import Any


def state_of(worker: int, rep: int) -> dict[str, Any]:
    """The state worker ``worker`` saves in repetition ``rep`` (rebuilt by the test to compare)."""
    import torch

    g = torch.Generator().manual_seed(1000 * rep + worker)
    return {
        "model": {"w": torch.randn(16, 8, generator=g), "b": torch.full((8,), float(worker))},
        "extra": {"worker": worker, "rep": rep},
    }


def run(worker: int, jobs: Any, results: Any, barrier: Any, env: dict[str, str]) -> None:
    """(worker process, forked from the fork server) With the test's
    environment ``env``, for each ``(url, storage_options, rep)`` from
    ``jobs``: wait at ``barrier``, save, report ``(rep, worker, outcome, message)``."""
    os.environ.clear()
    os.environ.update(env)
    # every job waits a little between writing and committing, so they all
    # pass the up-front "is a checkpoint there?" check and race at the commit
    os.environ["BYTECP_FAULT_DELAY"] = "commit:0:0.15"
    import bytecp
    from bytecp.errors import CheckpointExistsError

    while True:
        job = jobs.get()
        if job is None:
            return
        url, options, rep = job
        state = state_of(worker, rep)
        barrier.wait(timeout=60)
        try:
            bytecp.save(url, state, storage_options=options)
            results.put((rep, worker, "won", ""))
        except CheckpointExistsError as e:
            results.put((rep, worker, "lost", str(e)))
        except BaseException as e:  # noqa: BLE001 - reported to the test, which fails on it
            results.put((rep, worker, "error", f"{type(e).__name__}: {e}"))
