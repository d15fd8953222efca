"""The checkpoints of other formats in a run folder: what a job that moves
onto bytecp mid-run resumes from.

A run folder written by another checkpointer holds one sub-folder per
checkpoint, named by its step: ``step-N`` (torchtitan's DCP backend),
``global_stepN`` (DeepSpeed), ``iter_NNNNNNN`` (Megatron-LM and NeMo),
``checkpoint-N`` (the Hugging Face Trainer), ``epoch=E-step=N.ckpt`` or
``step=N.ckpt`` (Lightning's sharded strategies). :func:`foreign_checkpoints` finds those a
source of :data:`bytecp.interop.SOURCES` reads, and the step folders none
of them can read (a silent fresh start would lose the run's work: callers
raise, naming them).

Who calls it: :meth:`bytecp.manager.CheckpointManager.restore` (every rank,
beside the run's bytecp checkpoints: the newest of either wins), and
torchtitan's and Lightning's resume paths through the manager's helpers.
Reads names and a few small files only (each source's ``detect``).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

from bytecp import interop
from bytecp.catalog import CheckpointInfo
from bytecp.errors import CheckpointNotFoundError
from bytecp.format import metadata as fmt
from bytecp.storage_api import Storage, open_storage

__all__ = ["ForeignCheckpoint", "STEP_FOLDER", "step_of", "is_bytecp_folder", "foreign_checkpoints", "with_foreign"]

log = logging.getLogger("bytecp")

#: a checkpoint folder's name -> its step (the one group)
STEP_FOLDER = re.compile(
    r"(?:step[-_=]|global_step|iter_|checkpoint-|epoch=\d+-step=)(\d+)(?:\.ckpt)?")


@dataclasses.dataclass(frozen=True)
class ForeignCheckpoint:
    """A checkpoint of another format below a run folder."""

    name: str
    url: str
    step: int
    format: str  # a name of bytecp.interop.SOURCES


def step_of(name: str) -> int | None:
    """The step a checkpoint folder's name says, or None when it names none."""
    m = STEP_FOLDER.fullmatch(name)
    return int(m.group(1)) if m else None


def is_bytecp_folder(sub: Storage) -> bool:
    """A bytecp checkpoint, a retired base or an interrupted bytecp save:
    the catalog's and the garbage collector's, not a foreign source."""
    from bytecp.format.references import BASE_FILE
    from bytecp.saving.leases import saves_at

    if sub.exists(BASE_FILE):
        return True
    if sub.exists(fmt.METADATA_FILE):  # Megatron's torch_dist folders have a metadata.json too
        return fmt.names_bytecp(sub.read_bytes(fmt.METADATA_FILE))
    return bool(saves_at(sub))


def foreign_checkpoints(run_url: str, *, storage_options: dict[str, Any] | None = None,
                        after_step: int = -1) -> tuple[list[ForeignCheckpoint], list[str]]:
    """(checkpoints of other formats below ``run_url``, oldest step first;
    URLs of step folders holding files no source reads), among the folders
    whose step is above ``after_step`` (a run's newest bytecp checkpoint: a
    run that has moved onto bytecp reads no other folder). A missing run
    folder has neither."""
    root = open_storage(run_url, **(storage_options or {}))
    found: list[ForeignCheckpoint] = []
    unreadable: list[str] = []
    try:
        names = root.list_children("")
    except FileNotFoundError:
        return [], []
    for name in names:
        step = step_of(name)
        if step is None or step <= after_step:
            continue
        sub = root.child(name)
        url = f"{run_url.rstrip('/')}/{name}"
        try:
            if is_bytecp_folder(sub):
                continue
            source = interop.find_source(sub)
        except FileNotFoundError:
            continue  # a file named like a folder, or removed meanwhile
        if source is not None:
            found.append(ForeignCheckpoint(name, url, step, source))
        elif _has_files(sub):
            unreadable.append(url)
    found.sort(key=lambda c: c.step)
    return found, sorted(unreadable)


def _has_files(sub: Storage) -> bool:
    try:
        return bool(sub.list_children(""))
    except (FileNotFoundError, NotADirectoryError):
        return False


def with_foreign(run_url: str, options: dict[str, Any], found: list[CheckpointInfo]) -> list[CheckpointInfo]:
    """(every rank of ``CheckpointManager.restore`` and torchtitan's resume)
    ``found`` (the run's bytecp checkpoints) and, newer than all of them,
    the checkpoints of other formats in the run folder (a job that moved
    onto bytecp mid-run: :mod:`bytecp.interop.runs`), oldest first. Step
    folders no format reads, newer than everything that loads, are an
    error naming them: resuming from older work, or from nothing, would
    silently lose the run's progress."""
    newest = max((c.step for c in found if c.step is not None), default=-1)
    foreign, unreadable = foreign_checkpoints(run_url, storage_options=options, after_step=newest)
    if foreign:
        log.info("bytecp: %s holds %d checkpoint(s) of other formats newer than its bytecp ones (newest: %s, %s)",
                 run_url, len(foreign), foreign[-1].url, foreign[-1].format)
    loadable = max([newest, *(c.step for c in foreign)])
    lost = [u for u in unreadable if (_step_of_url(u) or 0) > loadable]
    if lost:
        raise CheckpointNotFoundError(
            f"{run_url} holds step folders no format bytecp reads ({', '.join(lost[:3])}"
            f"{', ...' if len(lost) > 3 else ''}), newer than any checkpoint that loads; resuming would lose "
            "their steps: load them with the tool that wrote them, or move them out of the run folder")
    return [*found, *(CheckpointInfo(c.name, c.url, c.step, "") for c in foreign)]


def _step_of_url(url: str) -> int | None:
    return step_of(url.rstrip("/").rsplit("/", 1)[-1])

