"""The public entry points: ``save``, ``async_save``, ``load``, ``load_state_dict``.

Called by training code on every rank (``save``/``async_save``/``load``) or
by one process with no ``torch.distributed`` (``load_state_dict``). Each call
validates its arguments into a :class:`~bytecp.options.SaveOptions` /
:class:`~bytecp.options.LoadOptions` (where every keyword argument is
documented), opens the storage, and runs a
:class:`~bytecp.saving.pipeline.SavePipeline` in the order of a schedule of
:mod:`bytecp.saving.schedule` (a save's phases on the caller's thread, or an
async order: eager, lazy or under a memory budget), or a
:class:`~bytecp.loading.pipeline.LoadPipeline`; nothing else happens here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from bytecp import __version__
from bytecp.dist import DistContext
from bytecp.errors import ConfigError
from bytecp.format import metadata as fmt
from bytecp.loading.pipeline import LoadPipeline, LoadResult
from bytecp.options import DEFAULT_LOAD_TIMEOUT_S, DEFAULT_SAVE_TIMEOUT_S, LoadOptions, SaveOptions
from bytecp.recorder import Recorder, Trace, resolve_monitor
from bytecp.saving import schedule
from bytecp.saving.handles import SaveHandle, checkpoint_group, pending_save, wait_for_pending_save
from bytecp.saving.pipeline import SavePipeline
from bytecp.saving.staging import ArenaStager, Stager, ViewStager
from bytecp.storage_api import Storage, open_storage

__all__ = ["save", "async_save", "load", "load_state_dict", "LoadResult"]


def _check_state(state: Any) -> dict[str, Any]:
    if not isinstance(state, dict):
        raise ConfigError(
            f"state must be a dict such as {{'model': model, 'optimizer': optim}}, got {type(state).__name__}"
        )
    return state


def _storage(url: str | Storage, opts: SaveOptions | LoadOptions) -> Storage:
    return url if isinstance(url, Storage) else open_storage(url, **opts.storage_options)


def _trace(operation: str, storage: Storage, ctx: DistContext, opts: SaveOptions | LoadOptions,
           wall0: float, step: int | None = None) -> Trace:
    rec = resolve_monitor(opts.monitor)
    return Trace(operation, storage.url, rank=ctx.rank, world_size=ctx.world_size, step=step,
                 extra_recorders=[rec] if rec is not None else [], started=wall0)


def save(
    url: str | Storage,
    state: dict[str, Any],
    *,
    framework: str | None = None,
    step: int | None = None,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
    allow_pickle: bool = False,
    io_threads: int = 4,
    process_group: Any = None,
    coordinator_rank: int = 0,
    storage_options: dict[str, Any] | None = None,
    monitor: str | Recorder | None = None,
    verify_replicas: bool | None = None,
    base: str | None = None,
    save_timeout_s: float | None = DEFAULT_SAVE_TIMEOUT_S,
    serving_dtype: Any = None,
    serving_prefixes: Sequence[str] | None = None,
    serving_whole: bool = False,
    overwrite_readers: Sequence[str] = (),
) -> fmt.Metadata:
    """Save ``state`` to ``url``; every rank of the job calls it.

    ``state`` maps names to modules, optimizers, ``Stateful`` objects,
    tensors and plain values; the framework (DDP, FSDP1, FSDP2, plain) is
    detected from the objects. The keyword arguments are described on
    :class:`~bytecp.options.SaveOptions`. Returns the committed metadata
    (on ranks other than the coordinator, for a state of 20,000 tensors and
    data files or more, its skeleton, tensors, files and index are read
    from ``metadata.json`` when first asked for: :mod:`bytecp.saving.outcome`).
    Raises :class:`~bytecp.errors.CheckpointExistsError` if a committed
    checkpoint is at ``url`` and ``overwrite`` is false. With ``base`` (an
    earlier checkpoint of the same run that this process saved), boxes
    unchanged since then are referenced, not written again. With
    ``serving_dtype`` (``torch.bfloat16``), serving deltas are written beside
    the data: what changed in that dtype since this process's previous save
    of the run (see :class:`~bytecp.options.SaveOptions`).
    """
    return _save(url, state, SaveOptions(
        framework=framework, step=step, metadata=metadata or {}, overwrite=overwrite,
        allow_pickle=allow_pickle, io_threads=io_threads, process_group=process_group,
        coordinator_rank=coordinator_rank, storage_options=storage_options or {}, monitor=monitor,
        verify_replicas=verify_replicas, base=base, save_timeout_s=save_timeout_s, serving_dtype=serving_dtype,
        serving_prefixes=None if serving_prefixes is None else _names(serving_prefixes), serving_whole=serving_whole,
        overwrite_readers=tuple(overwrite_readers),
    ))


def _wait_for_previous(trace_later: list[tuple[float, float]]) -> None:
    """(every rank, first thing of a save) Wait for the save in flight to end
    (its error is raised later, by the describe phase); the wait, if there
    was one, goes in ``trace_later`` as (wall-clock start, seconds) for the
    trace's ``wait_previous`` span."""
    if pending_save() is None:
        return
    start, t0 = time.time(), time.perf_counter()
    wait_for_pending_save()
    trace_later.append((start, time.perf_counter() - t0))


def _deadline(opts: SaveOptions) -> float | None:
    """The monotonic time by which the save must have committed (``save_timeout_s`` from now)."""
    return None if opts.save_timeout_s is None else time.monotonic() + opts.save_timeout_s


def _load_deadline(opts: LoadOptions) -> float | None:
    """The monotonic time by which the load must have ended (``load_timeout_s`` from now)."""
    return None if opts.load_timeout_s is None else time.monotonic() + opts.load_timeout_s


def _names(exclude: Sequence[str]) -> tuple[str, ...]:
    """``exclude=`` as the options take it (a lone string is refused there, not split into letters)."""
    return exclude if isinstance(exclude, str) else tuple(exclude)  # type: ignore[return-value]


def _save(url: str | Storage, state: dict[str, Any], opts: SaveOptions) -> fmt.Metadata:
    t0, wall0 = time.perf_counter(), time.time()
    _check_state(state)
    waited: list[tuple[float, float]] = []
    _wait_for_previous(waited)  # (a save that failed may have retired the checkpoint group)
    # bytecp's own gloo group: a step abandoned at the deadline never leaves the job's group out of step
    ctx = DistContext(checkpoint_group(opts.process_group), opts.coordinator_rank)
    ctx.deadline = _deadline(opts)
    storage = _storage(url, opts)
    trace = _trace("save", storage, ctx, opts, wall0, opts.step)
    for start, seconds in waited:
        trace.add_span("wait_previous", start, seconds)
    # a storage lending arenas (keeper://) gets the one copy the save makes; others read the live tensors
    stager: Stager = (ArenaStager(threads=min(8, torch.get_num_threads()), shared=storage, files=opts.io_threads)
                      if storage.lends_arenas else ViewStager())
    pipeline = SavePipeline(storage, state, opts, ctx, trace, stager, version=__version__)
    return schedule.run_now(pipeline, blocked_since=t0)


def async_save(
    url: str | Storage,
    state: dict[str, Any],
    *,
    lazy: bool = False,
    memory_budget_bytes: int | None = None,
    **options: Any,
) -> SaveHandle:
    """Save ``state`` in the background; every rank calls it.

    Returns once this rank's boxes are copied into reused host memory (the
    plan, the write and the commit run on a background thread, on a process
    group of their own, so they never interleave with training's
    collectives), or at once with ``lazy=True``: then each optimizer in
    ``state`` waits in a pre-step hook until the copy is done, so no tensor
    changes under it. ``memory_budget_bytes`` bounds the staging memory:
    larger states are planned, staged and written in batches, and the call
    blocks until the last batch is staged. ``staging_threads`` sets the
    copy threads (see :class:`~bytecp.options.SaveOptions`). The other
    keyword arguments are those of :func:`save`.
    """
    t0, wall0 = time.perf_counter(), time.time()
    try:
        if "overwrite_readers" in options:
            options["overwrite_readers"] = tuple(options["overwrite_readers"])
        opts = SaveOptions(lazy=lazy, memory_budget_bytes=memory_budget_bytes, **options)
    except TypeError as e:
        raise ConfigError(f"async_save: {e}") from None
    _check_state(state)
    storage = _storage(url, opts)
    waited: list[tuple[float, float]] = []
    _wait_for_previous(waited)  # (a save that failed may have retired the checkpoint group)
    group = checkpoint_group(opts.process_group)
    ctx = DistContext(group, opts.coordinator_rank)  # no group: one process
    ctx.deadline = _deadline(opts)
    trace = _trace("save", storage, ctx, opts, wall0, opts.step)
    for start, seconds in waited:
        trace.add_span("wait_previous", start, seconds)
    pipeline = SavePipeline(storage, state, opts, ctx, trace, schedule.async_stager(opts, storage), version=__version__)
    return schedule.start_async(schedule.order_for(opts), pipeline, blocked_since=t0)


def load(
    url: str | Storage,
    state: dict[str, Any],
    *,
    framework: str | None = None,
    strict: bool = True,
    verify: bool = True,
    allow_pickle: bool = False,
    io_threads: int = 8,
    zero_redundancy: bool | None = None,
    process_group: Any = None,
    coordinator_rank: int = 0,
    storage_options: dict[str, Any] | None = None,
    monitor: str | Recorder | None = None,
    exclude: Sequence[str] = (),
    load_timeout_s: float | None = DEFAULT_LOAD_TIMEOUT_S,
    format: str | None = None,
    data_reshard: str = "exact",
) -> LoadResult:
    """Load the checkpoint at ``url`` into ``state`` in place; every rank calls it.

    Tensors are filled where they live (any world size or parallelism: each
    rank reads only the byte ranges its shards need). Modules, optimizers and
    ``Stateful`` objects get their state through ``load_state_dict``; plain
    values in ``state``'s dicts are replaced. The keyword arguments are
    described on :class:`~bytecp.options.LoadOptions`; with ``strict=False``
    missing and unexpected keys are reported in the result instead of raising;
    ``exclude=["optimizer", ...]`` leaves those entries out of the load;
    ``format="dcp"`` (or another source's name) reads another tool's checkpoint,
    which is detected anyway when the URL has no ``metadata.json``. Data
    loaders' positions reshard when the world size changed
    (``data_reshard="approximate"`` accepts a position that cannot continue exactly).
    """
    t0, wall0 = time.perf_counter(), time.time()
    opts = LoadOptions(
        framework=framework, strict=strict, verify=verify, allow_pickle=allow_pickle,
        io_threads=io_threads, zero_redundancy=zero_redundancy, process_group=process_group,
        coordinator_rank=coordinator_rank, storage_options=storage_options or {}, monitor=monitor,
        exclude=_names(exclude), load_timeout_s=load_timeout_s, format=format, data_reshard=data_reshard,
    )
    _check_state(state)
    from bytecp.saving.reuse import LAST_SAVES

    LAST_SAVES.clear()  # tensors filled in place (a DTensor's version unmoved): the next save writes them
    ctx = DistContext(opts.process_group, opts.coordinator_rank)
    ctx.deadline, ctx.deadline_option = _load_deadline(opts), "load_timeout_s"
    storage = _storage(url, opts)
    trace = _trace("load", storage, ctx, opts, wall0)
    with trace.failing(blocked_since=t0):
        result = LoadPipeline(storage, state, opts, ctx, trace).run()
    trace.add_stall(time.perf_counter() - t0)
    trace.finish(ok=True)
    return result


def load_state_dict(
    url: str | Storage,
    *,
    verify: bool = True,
    allow_pickle: bool = False,
    io_threads: int = 8,
    storage_options: dict[str, Any] | None = None,
    exclude: Sequence[str] = (),
    load_timeout_s: float | None = DEFAULT_LOAD_TIMEOUT_S,
    format: str | None = None,
) -> dict[str, Any]:
    """The whole checkpoint as plain full tensors and values, in one process.

    For evaluation jobs: no ``torch.distributed`` needed, whatever parallelism
    saved it. ``sd["model"]`` is a plain module state dict; optimizer state is
    keyed by parameter FQN. ``exclude=["optimizer"]`` reads none of what is under those names.
    """
    opts = LoadOptions(verify=verify, allow_pickle=allow_pickle, io_threads=io_threads,
                       storage_options=storage_options or {}, exclude=_names(exclude), load_timeout_s=load_timeout_s,
                       format=format)
    ctx = DistContext.local()
    ctx.deadline, ctx.deadline_option = _load_deadline(opts), "load_timeout_s"
    storage = _storage(url, opts)
    trace = Trace("load", storage.url)
    pipeline = LoadPipeline(storage, None, opts, ctx, trace)
    with trace.failing():
        pipeline.run()
    trace.finish(ok=True)
    return pipeline.whole()
