"""Evaluation and serving processes that follow a training run.

- :mod:`bytecp.serving.changes` -- which tensors of a newer checkpoint differ
  from one already held, from index rows alone (references, checksums);
- :mod:`bytecp.serving.follow` -- :func:`~bytecp.serving.follow.follow`, the
  generator that keeps a process's state at the run's newest checkpoint
  (staged reads, one swap, pins);
- :mod:`bytecp.serving.weights` -- :func:`~bytecp.serving.weights.iter_weights`,
  ``(name, tensor)`` pairs for inference engines' ``load_weights``;
- :mod:`bytecp.serving.cli` -- ``bytecp follow RUN --json``.

Called by user code (``bytecp.follow``, ``bytecp.iter_weights``) and the
CLI; imports the loading and interop stages, never the save path.
"""

from __future__ import annotations

__all__: list[str] = []
