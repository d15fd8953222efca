"""``bytecp demo`` / ``make demo``: a training job's whole life, on this machine.

- :mod:`bytecp.demo.model`: the model and data, plain torch;
- :mod:`bytecp.demo.train`: the training job (one process per rank; runs
  under ``torchrun`` too): FSDP2 or DDP, lazy asynchronous checkpoints
  through :class:`~bytecp.CheckpointManager`, resume from the latest
  committed one;
- :mod:`bytecp.demo.launch`: starts a job's processes, kills one on cue,
  cleans up the survivors;
- :mod:`bytecp.demo.evaluate`: the evaluation job (plain torch and
  ``safetensors``, no bytecp, no torch.distributed);
- :mod:`bytecp.demo.story`: :func:`run_demo`, the stages in order, told in
  words, with a JSON summary of what happened.

Importing this package imports none of them (the evaluation job stays free
of bytecp's training code).
"""

from __future__ import annotations

__all__ = ["run_demo"]


def run_demo(out: str) -> int:
    """Run every stage of the demo under ``out`` (wiped first); 0 when the story held."""
    from bytecp.demo.story import run_demo as run

    return run(out)
