"""``bytecp demo`` / ``make demo``: the main job, end to end, on this machine.

1. one process: train a small GPT-like model with AdamW, checkpoint it,
   reload into a fresh model and optimizer, check every tensor bitwise,
   continue training identically, ``inspect`` and ``verify`` the checkpoint;
2. (``world_size`` > 0) the distributed story: the same model under FSDP2 on
   ``world_size`` processes (gloo), saved, reloaded on ``world_size + 1``
   processes, and exported to one process with ``load_state_dict``.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import torch
from torch import nn

__all__ = ["TinyGPT", "run_demo", "train_steps"]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 3 * dim + 1), nn.GELU(), nn.Linear(3 * dim + 1, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A small GPT-like model with shapes that do not divide evenly."""

    def __init__(self, vocab: int = 97, dim: int = 30, layers: int = 2, heads: int = 2, seq: int = 13) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(1, seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def batch(step: int, vocab: int = 97, seq: int = 13, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, vocab, (n, seq), generator=g)
    return x, (x * 3 + 1) % vocab  # a learnable map, so the loss visibly falls


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, start: int, n: int) -> list[float]:
    losses = []
    for step in range(start, start + n):
        x, y = batch(step)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def _single_process(out: str) -> str:
    from . import load, load_state_dict, save
    from .cli import main as cli

    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = train_steps(model, opt, 0, 5)
    _say(f"trained 5 steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    url = os.path.join(out, "single", "step-5")
    t0 = time.perf_counter()
    save(url, {"model": model, "optimizer": opt, "extra": {"step": 5}}, step=5)
    _say(f"saved {url} in {time.perf_counter() - t0:.3f} s")

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
    _say(f"reloaded bitwise, resumed at step {extra['step']}: losses {[round(v, 4) for v in more_b]} match")
    sd = load_state_dict(url)
    _say(f"load_state_dict: {len(sd['model'])} model tensors, optimizer state for {len(sd['optimizer']['state'])} params")
    if cli(["inspect", url]) != 0 or cli(["verify", url]) != 0:
        raise SystemExit("demo: inspect/verify failed")
    return url


def run_demo(out: str, world_size: int = 2) -> int:
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    _single_process(out)
    if world_size > 0:
        from .demo_dist import run_distributed_demo

        run_distributed_demo(out, world_size)
    _say(f"done; checkpoints are under {out}/ (try: bytecp inspect {out}/single/step-5)")
    return 0
