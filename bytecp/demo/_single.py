"""The demo's first half: one process saves, reloads bitwise, resumes
identically, and checks the checkpoint with ``inspect`` and ``verify``."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from ..inspect import summarize, verify
from ..storage_api import open_storage
from .model import TinyGPT, say, train_steps

__all__ = ["single_process"]


def single_process(out: str) -> str:
    from .. import load, load_state_dict, save

    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = train_steps(model, opt, 0, 5)
    say(f"trained 5 steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    url = os.path.join(out, "single", "step-5")
    t0 = time.perf_counter()
    save(url, {"model": model, "optimizer": opt, "extra": {"step": 5}}, step=5)
    say(f"saved {url} in {time.perf_counter() - t0:.3f} s")

    torch.manual_seed(123)
    model2 = TinyGPT()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1.0)
    extra: dict[str, Any] = {"step": 0}
    load(url, {"model": model2, "optimizer": opt2, "extra": extra})
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values(), strict=True):
        if not torch.equal(a, b):
            raise SystemExit(f"demo: {k} differs after load")
    more_a = train_steps(model, opt, 5, 3)
    more_b = train_steps(model2, opt2, 5, 3)
    if more_a != more_b:
        raise SystemExit(f"demo: resumed losses differ: {more_a} vs {more_b}")
    say(f"reloaded bitwise, resumed at step {extra['step']}: losses {[round(v, 4) for v in more_b]} match")
    sd = load_state_dict(url)
    say(f"load_state_dict: {len(sd['model'])} model tensors, optimizer state for {len(sd['optimizer']['state'])} params")
    info = summarize(open_storage(url))
    nbytes, problems = verify(open_storage(url))
    if problems:
        raise SystemExit(f"demo: verify found {len(problems)} problem(s): {problems[:3]}")
    totals = info["totals"]
    say(f"inspect: {totals['tensors']} tensors in {totals['chunks']} chunks; verify: all {nbytes} bytes match their crc32c")
    return url


