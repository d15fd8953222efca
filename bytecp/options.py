"""How a save or a load runs: the keyword arguments of the public functions.

``bytecp.save``/``async_save``/``load``/``load_state_dict`` build one of
these once from their keyword arguments (so every argument is validated and
documented here, in one place) and hand it to the pipelines; nothing below
the API takes loose keyword arguments.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from bytecp.errors import ConfigError
from bytecp.plan.planner import DEFAULT_SPLIT_BYTES

__all__ = ["SaveOptions", "LoadOptions", "DEFAULT_SAVE_TIMEOUT_S", "DEFAULT_LOAD_TIMEOUT_S"]


def _positive(name: str, value: int | None) -> None:
    if value is not None and (type(value) is not int or value < 1):
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Common:
    #: framework adapter by name (``"fsdp2"``, ``"ddp"``, ``"plain"``, ...);
    #: None detects it from the objects in ``state``
    framework: str | None = None
    #: process group of the ranks taking part (None: the default group)
    process_group: Any = None
    #: group rank that plans, reads the metadata and commits
    coordinator_rank: int = 0
    #: backend options (``endpoint_url=``, credentials, ``direct=``, ...)
    storage_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: where reports go: a collector address (``host:port``), a Recorder, or
    #: None for the ``BYTECP_MONITOR`` environment variable (unset: nowhere)
    monitor: Any = None
    #: unpickle blobs saved as arbitrary pickles (on save: allow storing them);
    #: runs code from the checkpoint, so only for checkpoints you trust
    allow_pickle: bool = False

    def __post_init__(self) -> None:
        if type(self.coordinator_rank) is not int or self.coordinator_rank < 0:
            raise ConfigError(f"coordinator_rank must be a rank (int >= 0), got {self.coordinator_rank!r}")
        if not isinstance(self.storage_options, dict):
            raise ConfigError(f"storage_options must be a dict, got {type(self.storage_options).__name__}")


#: a save's deadline unless ``save_timeout_s`` says otherwise: 30 minutes, as
#: torch.distributed's default process-group timeout
DEFAULT_SAVE_TIMEOUT_S = 1800.0

#: a load's deadline unless ``load_timeout_s`` says otherwise: 30 minutes, the
#: same as the process group's default timeout that bounded loads before
DEFAULT_LOAD_TIMEOUT_S = 1800.0


def _check_timeout(name: str, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0):
        raise ConfigError(f"{name} must be a number of seconds > 0 or None, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SaveOptions(_Common):
    """Keyword arguments of ``bytecp.save`` and ``bytecp.async_save``."""

    #: the training step, recorded in the metadata (and used by retention)
    step: int | None = None
    #: JSON-able user metadata stored in ``metadata.json`` (no NaN/inf)
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: an earlier committed checkpoint of the same run (a sibling URL) whose
    #: data files this save may reference instead of writing boxes again:
    #: those unchanged since this process saved that checkpoint (format
    #: version 3; see the guide's "Incremental checkpoints")
    base: str | None = None
    #: replace a committed checkpoint at the same URL (the old one stays
    #: loadable until the new one commits); without it a save to a URL that
    #: holds a committed checkpoint raises CheckpointExistsError
    overwrite: bool = False
    #: (CheckpointManager) checkpoints of the run that its restore skipped (they
    #: do not load): with ``overwrite``, their references to the checkpoint
    #: replaced do not keep it from being replaced
    overwrite_readers: tuple[str, ...] = ()
    #: writer threads (and data files) per rank
    io_threads: int = 4
    #: replicated boxes at least this large are split across their replicas
    split_bytes: int = DEFAULT_SPLIT_BYTES
    #: write per-rank monitoring reports beside the checkpoint
    write_reports: bool = True
    #: async only: return at once; each optimizer in the state blocks in a
    #: pre-step hook until this rank's data is staged
    lazy: bool = False
    #: async only: bound on the staging memory; larger states are staged and
    #: written in batches (the call returns once the last batch is staged)
    memory_budget_bytes: int | None = None
    #: async only: threads that copy into the staging memory; None: as many as
    #: torch's intra-op threads (at most 8) for an eager save, whose caller
    #: waits for the copy, and 1 for a lazy save, whose copy runs beside
    #: forward/backward
    staging_threads: int | None = None
    #: async only: how many steps below the caller's scheduling priority
    #: (Unix nice value) the save's background thread and the threads it
    #: starts run, so they take the cores only when training leaves them
    #: idle; 0 keeps the caller's priority
    background_nice: int = 0
    #: compare the checksums of replicated boxes across ranks and refuse to
    #: commit when replicas differ (costs a crc32c pass over every box a rank
    #: holds); None: on when the environment variable BYTECP_VERIFY_REPLICAS=1
    verify_replicas: bool | None = None
    #: seconds the whole save may take on every rank (async: from the call to
    #: the commit); past it the save fails on every rank, naming the rank(s)
    #: that did not reach the step the others waited in, and never commits
    #: (the coordinator refuses to write metadata.json late); None: no deadline
    #: (the process group's own timeout bounds each step)
    save_timeout_s: float | None = DEFAULT_SAVE_TIMEOUT_S
    #: write serving deltas in this dtype (``torch.bfloat16``, ``"bf16"``): per
    #: floating box, the elements whose value in this dtype changed since the
    #: previous checkpoint of the run, for followers holding the model in it
    #: (``bytecp.follow(..., dtype=)``; FORMAT.md §13); None: none
    serving_dtype: Any = None
    #: the dotted names whose tensors get serving deltas (``("model",)``); None:
    #: the state's modules, or when it has none every entry but its optimizers
    serving_prefixes: tuple[str, ...] | None = None
    #: also write the serving copy of every box whole (CheckpointManager: every
    #: ``full_every``-th save and at milestones); boxes without a base always are
    serving_whole: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive("io_threads", self.io_threads)
        if self.serving_dtype is not None:
            from bytecp.format.serving_wire import serving_dtype_name

            object.__setattr__(self, "serving_dtype", serving_dtype_name(self.serving_dtype))
        if self.serving_prefixes is not None:
            prefixes = (self.serving_prefixes,) if isinstance(self.serving_prefixes, str) else self.serving_prefixes
            if not all(isinstance(x, str) and x and not x.startswith(".") and not x.endswith(".") for x in prefixes):
                raise ConfigError(f"serving_prefixes must be dotted names such as ['model'], got "
                                  f"{self.serving_prefixes!r}")
            object.__setattr__(self, "serving_prefixes", tuple(prefixes))
        _positive("split_bytes", self.split_bytes)
        _check_timeout("save_timeout_s", self.save_timeout_s)
        _positive("memory_budget_bytes", self.memory_budget_bytes)
        _positive("staging_threads", self.staging_threads)
        if type(self.background_nice) is not int or not 0 <= self.background_nice <= 19:
            raise ConfigError(f"background_nice must be an int from 0 to 19, got {self.background_nice!r}")
        if self.base is not None and (not isinstance(self.base, str) or not self.base):
            raise ConfigError(f"base must be the URL of an earlier checkpoint of the run, got {self.base!r}")
        if self.step is not None and type(self.step) is not int:
            raise ConfigError(f"step must be an int or None, got {self.step!r}")
        if self.verify_replicas is None:
            object.__setattr__(self, "verify_replicas", os.environ.get("BYTECP_VERIFY_REPLICAS") == "1")
        if self.lazy and self.memory_budget_bytes is not None:
            raise ConfigError("lazy=True stages in the background and takes no memory_budget_bytes")
        try:
            json.dumps(self.metadata, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"metadata must be JSON-serializable without NaN/inf: {e}") from None
        if not isinstance(self.metadata, dict):
            raise ConfigError(f"metadata must be a dict, got {type(self.metadata).__name__}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadOptions(_Common):
    """Keyword arguments of ``bytecp.load`` and ``bytecp.load_state_dict``."""

    #: missing or unexpected keys are an error (else reported in the result)
    strict: bool = True
    #: check the crc32c of every chunk that is read whole
    verify: bool = True
    #: reader threads per rank
    io_threads: int = 8
    #: boxes every rank needs (replicated targets: DDP, plain tensors) are
    #: read once, in pieces spread over the ranks, and exchanged over the
    #: process group; None: on for remote storage, off for local disk
    zero_redundancy: bool | None = None
    #: names left out of the load (dotted FQNs: ``"optimizer"``,
    #: ``"engine.lr_scheduler"``): what the state holds under them keeps its
    #: value, what the checkpoint holds under them is neither read nor
    #: reported unexpected (torchtitan's ``exclude_from_loading``)
    exclude: tuple[str, ...] = ()
    #: seconds the whole load may take on every rank; past it each collective
    #: gives up and the load fails on every rank, naming the rank(s) that did
    #: not reach the step the others waited in (one process: checked between
    #: phases); None: no deadline (the process group's own timeout bounds each step)
    load_timeout_s: float | None = DEFAULT_LOAD_TIMEOUT_S
    #: what the URL holds: None detects it (``metadata.json``, else each source
    #: of :data:`bytecp.interop.SOURCES` in turn: a Hugging Face or DCP
    #: directory); ``"bytecp"`` reads ``metadata.json`` only; a source's name
    #: (``"dcp"``, ``"huggingface"``) reads the URL as that source
    format: str | None = None
    #: a data loader's position when the data-parallel layout changed
    #: (another world size): ``"exact"`` continues it exactly (every global
    #: step after the resume holds the uninterrupted run's samples when the
    #: global batch is unchanged; every sample of the epoch once otherwise)
    #: and refuses, before anything is loaded, what cannot continue exactly,
    #: naming the samples that would repeat or be skipped;
    #: ``"approximate"`` proceeds with the nearest position (or, for a loader
    #: of no known kind, the state saved by rank ``r % saved_world_size``)
    #: and a warning naming that count
    data_reshard: str = "exact"

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive("io_threads", self.io_threads)
        _check_timeout("load_timeout_s", self.load_timeout_s)
        if self.data_reshard not in ("exact", "approximate"):
            raise ConfigError(f"data_reshard must be 'exact' or 'approximate', got {self.data_reshard!r}")
        if self.format not in (None, "bytecp"):
            from bytecp.interop import SOURCES

            if self.format not in SOURCES:
                raise ConfigError(f"format={self.format!r} is not a format bytecp reads; use one of "
                                  f"{', '.join(['bytecp', *SOURCES])}")
        if isinstance(self.exclude, str) or not all(isinstance(x, str) and x and not x.startswith(".")
                                                    and not x.endswith(".") for x in self.exclude):
            raise ConfigError(f"exclude must be a list of dotted names such as ['optimizer', 'engine.lr_scheduler'], "
                              f"got {self.exclude!r}")
