"""``bytecp demo`` / ``make demo``: the main job, end to end, on this machine.

1. one process (:mod:`bytecp.demo._single`): train a small GPT-like model
   with AdamW, checkpoint it, reload into a fresh model and optimizer, check
   every tensor bitwise, continue training identically, inspect and verify
   the checkpoint;
2. (``world_size`` > 0, :mod:`bytecp.demo.dist`) the distributed story: the
   same model under FSDP2 on ``world_size`` processes (gloo), saved,
   reloaded on ``world_size + 1`` processes, and loaded in one process with
   ``load_state_dict``.

The demo uses only bytecp's public API and tools, never the CLI module.
"""

from __future__ import annotations

import os
import shutil

from ._single import single_process
from .model import TinyGPT, say, train_steps

__all__ = ["TinyGPT", "run_demo", "train_steps"]


def run_demo(out: str, world_size: int = 2) -> int:
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    single_process(out)
    if world_size > 0:
        from .dist import run_distributed_demo

        run_distributed_demo(out, world_size)
    say(f"done; checkpoints are under {out}/ (try: bytecp inspect {out}/single/step-5)")
    return 0
