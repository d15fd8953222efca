"""bytecp: checkpointing for large distributed PyTorch training.

Save from any parallelism (DDP, FSDP1, FSDP2, ...), load into any other or into
one process; storage is any fsspec URL. See README.md and docs/ for the guide
and docs/FORMAT.md for the on-storage format.

The API is imported on first use, so tools that need no torch (the
monitoring collector, ``bytecp monitor``) start without importing it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from bytecp.errors import (
    BytecpError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CommittedWithErrorsWarning,
    ConfigError,
    CorruptCheckpointError,
    DataReshardError,
    DistributedCheckpointError,
    FormatVersionError,
    IncompleteCheckpointError,
    PickleNotAllowedError,
    ResumeDecisionError,
    StateMismatchError,
    StorageError,
)

try:
    from importlib.metadata import version as _pkg_version

    __version__ = _pkg_version("bytecp")
except Exception:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

if TYPE_CHECKING:
    from bytecp.api import LoadResult, async_save, load, load_state_dict, save
    from bytecp.extras import PerRankState, RNGState, trainable
    from bytecp.manager import CheckpointManager
    from bytecp.saving.handles import SaveHandle, wait_for_pending_save
    from bytecp.saving.prewarm import prewarm
    from bytecp.serving.follow import FollowUpdate, follow
    from bytecp.serving.weights import iter_weights

_LAZY = {
    "save": ".api",
    "load": ".api",
    "load_state_dict": ".api",
    "LoadResult": ".api",
    "async_save": ".api",
    "SaveHandle": ".saving.handles",
    "wait_for_pending_save": ".saving.handles",
    "RNGState": ".extras",
    "PerRankState": ".extras",
    "trainable": ".extras",
    "CheckpointManager": ".manager",
    "prewarm": ".saving.prewarm",
    "follow": ".serving.follow",
    "FollowUpdate": ".serving.follow",
    "iter_weights": ".serving.weights",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'bytecp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "save",
    "async_save",
    "prewarm",
    "follow",
    "FollowUpdate",
    "iter_weights",
    "SaveHandle",
    "wait_for_pending_save",
    "load",
    "load_state_dict",
    "LoadResult",
    "CheckpointManager",
    "RNGState",
    "PerRankState",
    "trainable",
    "BytecpError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CommittedWithErrorsWarning",
    "ConfigError",
    "CorruptCheckpointError",
    "DataReshardError",
    "DistributedCheckpointError",
    "FormatVersionError",
    "IncompleteCheckpointError",
    "PickleNotAllowedError",
    "ResumeDecisionError",
    "StateMismatchError",
    "StorageError",
    "__version__",
]
