"""Which checkpoint a Lightning run resumes: the one resume decision
(:mod:`bytecp.tools.resume`) behind ``latest_checkpoint(dirpath)`` and
``trainer.fit(ckpt_path="last")``.

- :func:`latest_checkpoint` (user code, every rank, before ``trainer.fit``):
  the newest checkpoint of the folder that may load (bytecp's committed ones
  and, newer than them, those of other formats: Lightning's own
  ModelParallelStrategy folders from before the move), None when there is
  nothing to resume, :class:`~bytecp.errors.ResumeDecisionError` when the
  folder holds a newer step folder no format reads (or a storage error:
  never read as "nothing").
- :class:`BytecpModelCheckpoint`: a ``ModelCheckpoint`` whose ``last``
  (``ckpt_path="last"``) is that same checkpoint, not the newest
  ``last*.ckpt`` file by modification time (Lightning's, which starts
  afresh when a run saved no ``last.ckpt``).

Both remember the older candidates of the checkpoint they hand out
(:data:`HANDED`): the strategy's load (:meth:`BytecpStrategyMixin.load_checkpoint`,
every rank) falls back past one whose own files are bad, as
``CheckpointManager.restore`` does (:func:`bytecp.tools.resume.first_that_loads`),
with a warning naming it. A path the user names explicitly never falls back.
"""

from __future__ import annotations

import threading
from typing import Any

from bytecp.adapters.lightning.compat import ModelCheckpoint

from bytecp.catalog import CheckpointInfo
from bytecp.tools.resume import decide

__all__ = ["HANDED", "latest_checkpoint", "fallbacks_of", "BytecpModelCheckpoint"]

#: checkpoint URL handed out as a run's newest -> the older candidates to fall back to
HANDED: dict[str, tuple[CheckpointInfo, ...]] = {}
_lock = threading.Lock()


def latest_checkpoint(dirpath: str, *, storage_options: dict[str, Any] | None = None) -> str | None:
    """The newest committed checkpoint below ``dirpath`` that may load (by the
    saved ``global_step``), or None when there is nothing to resume: for
    ``trainer.fit(ckpt_path=...)``. A save that was interrupted (no
    ``metadata.json``) is never returned. Checkpoints Lightning's own
    ModelParallelStrategy wrote there before the job moved onto bytecp
    count too (:mod:`bytecp.interop.runs`): the newest wins. A folder whose
    newest checkpoint cannot be told raises
    :class:`~bytecp.errors.ResumeDecisionError`; a storage error is raised."""
    found = decide(str(dirpath), storage_options).candidates()
    if not found:
        return None
    with _lock:
        HANDED[found[0].url.rstrip("/")] = tuple(found[1:])
    return found[0].url


def fallbacks_of(url: str) -> tuple[CheckpointInfo, ...]:
    """The older candidates to try when ``url`` (handed out by this module) does not load."""
    with _lock:
        return HANDED.get(url.rstrip("/"), ())


class BytecpModelCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose ``ckpt_path="last"`` is the run's newest
    checkpoint that may load (:func:`latest_checkpoint` of its ``dirpath``);
    ``storage_options`` for an object-store ``dirpath``. Everything else is
    Lightning's ``ModelCheckpoint``."""

    def __init__(self, *args: Any, storage_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.storage_options = dict(storage_options or {})

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        """(Lightning's ``ckpt_path="last"``, every rank) The resume decision's newest."""
        dirpath = self.dirpath if self.dirpath is not None else self._ModelCheckpoint__resolve_ckpt_dir(trainer)
        url = latest_checkpoint(str(dirpath), storage_options=self.storage_options)
        return {url} if url is not None else set()
