"""Typed errors raised by bytecp.

Every error names what is at fault (the checkpoint URL, file, tensor, region,
rank or setting) and what to do about it. Storage backends map their
service errors onto :class:`StorageError` subclasses; distributed failures on
any rank reach every rank as one :class:`DistributedCheckpointError`.
"""

from __future__ import annotations

__all__ = [
    "BytecpError",
    "CheckpointNotFoundError",
    "IncompleteCheckpointError",
    "CheckpointExistsError",
    "CorruptCheckpointError",
    "FormatVersionError",
    "StateMismatchError",
    "DataReshardError",
    "PickleNotAllowedError",
    "ResumeDecisionError",
    "StorageError",
    "StoragePermissionError",
    "StorageNotFoundError",
    "TransientStorageError",
    "DistributedCheckpointError",
    "CommittedWithErrorsWarning",
    "ConfigError",
    "one_line",
]


class BytecpError(Exception):
    """Base class of every error bytecp raises on purpose."""


class ConfigError(BytecpError, ValueError):
    """A setting or argument is invalid; the message names it."""


class CheckpointNotFoundError(BytecpError, FileNotFoundError):
    """Nothing that looks like a checkpoint exists at the URL."""


class IncompleteCheckpointError(CheckpointNotFoundError):
    """Data files exist but ``metadata.json`` does not: an interrupted save.

    Such a directory is not a checkpoint; ``latest`` and retention ignore it.
    """


class CheckpointExistsError(BytecpError, FileExistsError):
    """A committed checkpoint already exists where a save was asked to write."""


class CorruptCheckpointError(BytecpError):
    """Stored bytes do not match what the checkpoint's index promises."""


class FormatVersionError(BytecpError):
    """The checkpoint was written by a newer (or unknown) format version."""


class StateMismatchError(BytecpError, ValueError):
    """The target state does not fit the checkpoint (keys, shapes, dtypes)."""


class ResumeDecisionError(BytecpError):
    """A run folder holds content that leaves "which checkpoint to resume"
    undecided: a step folder no format reads (or one whose name says no
    step) beside or above the newest checkpoint that loads, a pointer file
    (DeepSpeed's ``latest``, Megatron-LM's ``latest_checkpointed_iteration.txt``)
    naming a checkpoint that is not there. The message names what and what to
    do. Never a :class:`FileNotFoundError`: no caller may read it as an empty
    run folder and start afresh (:mod:`bytecp.tools.resume`)."""


class DataReshardError(StateMismatchError):
    """A data loader's position cannot continue exactly under the loading
    job's world size (the consumed samples do not divide among the new
    ranks, a loader of no known kind, different kinds on different ranks).

    Raised by a load before it changes anything, naming the loader and how
    many samples would repeat (``repeat``) or be skipped (``skip``; None:
    unknown); ``load(..., data_reshard="approximate")`` proceeds instead,
    with a warning naming the count. A resharder (:mod:`bytecp.data`)
    raises it with ``approximate``: the state it would restore then (None:
    the state saved by rank ``r % saved_world_size``).
    """

    def __init__(self, message: str, *, repeat: int | None = None, skip: int | None = None,
                 approximate: object = None) -> None:
        super().__init__(message)
        self.repeat, self.skip, self.approximate = repeat, skip, approximate


class PickleNotAllowedError(BytecpError):
    """Loading would unpickle arbitrary objects; pass ``allow_pickle=True``."""


class StorageError(BytecpError, OSError):
    """A storage operation failed (after retries where they apply)."""


class StoragePermissionError(StorageError, PermissionError):
    """Credentials were refused; retrying will not help."""


class StorageNotFoundError(StorageError, FileNotFoundError):
    """A file, object or bucket does not exist."""


class TransientStorageError(StorageError):
    """Throttling, 5xx, reset connections, timeouts: worth a retry."""


class DistributedCheckpointError(BytecpError):
    """One or more ranks failed; raised on every rank.

    ``failures`` maps each failed rank to the text of its exception.
    """

    def __init__(self, operation: str, failures: dict[int, str]) -> None:
        self.operation = operation
        self.failures = dict(sorted(failures.items()))
        same: dict[str, list[int]] = {}  # message -> the ranks that failed with it
        for rank, msg in self.failures.items():
            same.setdefault(msg, []).append(rank)
        head = f"{operation} failed on rank(s) {rank_list(list(self.failures))}:"
        if len(self.failures) > 1 and len(same) == 1:  # every rank the same error (a refusal all decide): one line
            super().__init__(f"{head} {next(iter(same))}")
            return
        lines = [head] + [f"  rank {ranks[0]}: {msg}" if len(ranks) == 1 else f"  ranks {rank_list(ranks)}: {msg}"
                          for msg, ranks in same.items()]
        super().__init__("\n".join(lines))


def rank_list(ranks: list[int]) -> str:
    """Sorted ranks as text: ``0, 1, 5``, runs of more than 3 as ``8-1023``
    (one line for thousands of ranks)."""
    out: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out += [f"{ranks[i]}-{ranks[j]}"] if j - i >= 3 else [str(r) for r in ranks[i:j + 1]]
        i = j + 1
    return ", ".join(out)


class CommittedWithErrorsWarning(UserWarning):
    """A save committed, but a rank was lost (or a collective broke) after
    ``metadata.json`` was written. The checkpoint is complete and loads; the
    job itself has lost a rank."""


def one_line(error: BaseException, limit: int = 300) -> str:
    """An error as one short line: for warnings that name several errors, and for
    the messages that quote another library's error (pyarrow's end in a newline)."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
