"""bytecp: checkpointing for large distributed PyTorch training.

Save from any parallelism (DDP, FSDP1, FSDP2, Megatron-Core), load into any
other or into one process; storage is any fsspec URL. See README.md and
docs/ for the guide and docs/FORMAT.md for the on-storage format.
"""

from .api import LoadResult, __version__, load, load_state_dict, save
from .async_save import SaveHandle, async_save, wait_for_pending_save
from .errors import (
    BytecpError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    FormatVersionError,
    IncompleteCheckpointError,
    PickleNotAllowedError,
    StateMismatchError,
    StorageError,
)
from .extras import PerRankState, RNGState

__all__ = [
    "save",
    "async_save",
    "SaveHandle",
    "wait_for_pending_save",
    "load",
    "load_state_dict",
    "LoadResult",
    "RNGState",
    "PerRankState",
    "BytecpError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "ConfigError",
    "CorruptCheckpointError",
    "DistributedCheckpointError",
    "FormatVersionError",
    "IncompleteCheckpointError",
    "PickleNotAllowedError",
    "StateMismatchError",
    "StorageError",
    "__version__",
]
