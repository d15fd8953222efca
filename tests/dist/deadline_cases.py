"""Functions the deadline tests run on every rank of a spawned pool."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import bytecp


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    return {"model": model, "x": torch.arange(4096.0)}


def pid() -> int:
    return os.getpid()


def timed_save(url: str, timeout: float, delay: str | None = None, lazy: bool | None = None) -> tuple[str, float]:
    """One save with ``save_timeout_s=timeout`` (``delay``: ``phase:rank:seconds``
    held on that rank); -> (the error, or "committed", and its seconds)."""
    if delay:
        os.environ["BYTECP_FAULT_DELAY"] = delay
    t0 = time.monotonic()
    try:
        if lazy is None:
            bytecp.save(url, _state(), save_timeout_s=timeout)
        else:
            bytecp.async_save(url, _state(), lazy=lazy, save_timeout_s=timeout).wait(120)
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return f"{type(e).__name__}: {e}", time.monotonic() - t0
    finally:
        os.environ.pop("BYTECP_FAULT_DELAY", None)
    return "committed", time.monotonic() - t0


def leftovers(url: str) -> list[str]:
    """The files a save left at ``url`` (this rank's view)."""
    return sorted(str(p.relative_to(url)) for p in Path(url).rglob("*") if p.is_file()) if Path(url).exists() else []


def timed_load(url: str, timeout: float, delay: str | None = None) -> tuple[str, float]:
    """One load of ``url`` with ``load_timeout_s=timeout`` (``delay`` as for
    :func:`timed_save`); -> (the error, or "loaded" when the state equals the
    saved one bitwise, and its seconds)."""
    if delay:
        os.environ["BYTECP_FAULT_DELAY"] = delay
    state = _state()
    with torch.no_grad():
        for p in state["model"].parameters():
            p.zero_()
    state["x"] = torch.zeros(4096)
    t0 = time.monotonic()
    try:
        bytecp.load(url, state, load_timeout_s=timeout)
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return f"{type(e).__name__}: {e}", time.monotonic() - t0
    finally:
        os.environ.pop("BYTECP_FAULT_DELAY", None)
    want = _state()
    same = all(torch.equal(a, b) for a, b in zip(state["model"].state_dict().values(),
                                                 want["model"].state_dict().values(), strict=True))
    return ("loaded" if same and torch.equal(state["x"], want["x"]) else "loaded, but differs"), time.monotonic() - t0


def saves_apart(run_url: str, behind: int, timeout: float, async_save: bool) -> list[tuple[int, str]]:
    """A job a save apart, as a stall leaves one whose ranks run no collectives
    between saves: rank ``behind`` saves steps 1-4 with a manager, the others
    2-4 (their step 1 went elsewhere); -> (step, "committed" or the error) per save."""
    import torch.distributed as dist

    mgr = bytecp.CheckpointManager(run_url, keep_last=10, async_save=async_save, save_timeout_s=timeout)
    out: list[tuple[int, str]] = []
    for step in range(1 if dist.get_rank() == behind else 2, 5):
        try:
            handle = mgr.save(step, _state())
            if handle is not None:
                handle.wait(120)
            out.append((step, "committed"))
        except Exception as e:  # noqa: BLE001 - the test reads the message
            out.append((step, f"{type(e).__name__}: {e}"))
    mgr.wait()
    return out
