"""The public entry points: ``save``, ``load``, ``load_state_dict``.

Called by training code on every rank (``save``/``load``) or by one process
with no ``torch.distributed`` (``load_state_dict``). Each call picks the
framework adapter, opens the storage by URL, creates a
:class:`~bytecp.dist.DistContext` and a :class:`~bytecp.recorder.Trace`, and
hands the flattened state to the engine.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from . import __version__, engine
from . import format as fmt
from .adapter_api import detect_adapter
from .dist import DistContext
from .errors import ConfigError
from .recorder import Recorder, Trace, resolve_monitor
from .state import Slot, flatten_tree
from .storage_api import Storage, open_storage

__all__ = ["save", "load", "load_state_dict", "LoadResult"]

log = logging.getLogger("bytecp")
LoadResult = engine.LoadResult


def _check_state(state: Any) -> dict[str, Any]:
    if not isinstance(state, dict):
        raise ConfigError(
            f"state must be a dict such as {{'model': model, 'optimizer': optim}}, got {type(state).__name__}"
        )
    return state


def _check_json(name: str, value: Any) -> dict[str, Any]:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{name} must be JSON-serializable without NaN/inf: {e}") from None
    return dict(value or {})


def _storage(url: str | Storage, storage_options: dict[str, Any] | None) -> Storage:
    if isinstance(url, Storage):
        return url
    return open_storage(url, **(storage_options or {}))


def _recorders(monitor: str | Recorder | None) -> list[Recorder]:
    rec = resolve_monitor(monitor)
    return [rec] if rec is not None else []


def _write_report(storage: Storage, report: Any) -> None:
    try:
        storage.write_file(fmt.report_file(report.rank), [json.dumps(report.to_json()).encode()])
    except Exception as e:  # informational only
        log.warning("bytecp: could not store the monitoring report at %s: %s", storage.url, e)


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
) -> fmt.Metadata:
    """Save ``state`` to ``url``; every rank of the job calls it.

    ``state`` maps names to modules, optimizers, ``Stateful`` objects,
    tensors and plain values. The framework (DDP, FSDP1, FSDP2, Megatron,
    plain) is detected from the objects unless ``framework=`` names it.
    Returns the committed metadata. Raises
    :class:`~bytecp.errors.CheckpointExistsError` if a committed checkpoint
    is at ``url`` and ``overwrite`` is false.
    """
    t0, wall0 = time.perf_counter(), time.time()
    _check_state(state)
    _check_json("metadata", metadata)
    opts = engine.SaveOptions(overwrite=overwrite, allow_pickle=allow_pickle, io_threads=io_threads)
    from ._async import _raise_previous
    ctx = DistContext(process_group, coordinator_rank)
    storage = _storage(url, storage_options)
    trace = Trace("save", storage.url, rank=ctx.rank, world_size=ctx.world_size, step=step,
                  extra_recorders=_recorders(monitor), started=wall0)
    try:
        def describe() -> tuple[Any, Any, dict[str, Any]]:
            _raise_previous(trace)  # one save in flight per process
            adapter = detect_adapter(state, framework)
            with trace.span("plan"):
                return adapter, flatten_tree(adapter.save_tree(state, ctx)), adapter.parallelism(state, ctx)

        # fail-together: an error on one rank (a bad state, an earlier async
        # failure only it saw) reaches every rank instead of leaving them waiting
        adapter, flat, parallelism = ctx.run("save", describe)
        md = engine.save_flat(
            storage, flat, ctx,
            framework=adapter.name, parallelism=parallelism, step=step,
            user_metadata=_check_json("metadata", metadata), opts=opts, trace=trace,
            bytecp_version=__version__,
        )
    except BaseException as e:
        trace.add_stall(time.perf_counter() - t0)
        trace.finish(ok=False, error=e)
        raise
    trace.add_stall(time.perf_counter() - t0)
    report = trace.finish(ok=True)
    if opts.write_reports:
        _write_report(storage, report)
    return md


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
) -> engine.LoadResult:
    """Load the checkpoint at ``url`` into ``state`` in place; every rank calls it.

    Tensors are filled where they live (any world size or parallelism: each
    rank reads only the byte ranges its shards need). Modules, optimizers and
    ``Stateful`` objects get their state through ``load_state_dict``; plain
    values in ``state``'s dicts are replaced. With ``strict=False`` missing
    and unexpected keys are reported in the result instead of raising.
    ``verify`` checks the crc32c of every chunk that is read whole (loads at
    the saving topology); a resharded load reads parts of chunks, which a
    chunk checksum cannot cover -- ``bytecp verify`` checks everything.
    ``zero_redundancy`` (default: on for remote storage) reads boxes that
    every rank needs once, spread over the ranks, and exchanges them over
    the process group.
    """
    t0, wall0 = time.perf_counter(), time.time()
    _check_state(state)
    opts = engine.LoadOptions(strict=strict, verify=verify, allow_pickle=allow_pickle,
                              io_threads=io_threads, zero_redundancy=zero_redundancy)
    ctx = DistContext(process_group, coordinator_rank)
    storage = _storage(url, storage_options)
    trace = Trace("load", storage.url, rank=ctx.rank, world_size=ctx.world_size,
                  extra_recorders=_recorders(monitor), started=wall0)
    try:
        adapter = ctx.run("load", lambda: detect_adapter(state, framework))
        md, chunks = engine.read_checkpoint(storage, ctx, trace)

        def describe() -> tuple[Any, Any]:
            target = adapter.load_tree(state, ctx, md)
            return target, flatten_tree(target.tree, target=True)

        with trace.span("plan"):
            target, flat = ctx.run("load", describe)
        result = engine.load_flat(storage, flat, ctx, md, chunks, opts, trace)
        with trace.span("apply"):
            ctx.run("load", lambda: target.finalize(result.values))
    except BaseException as e:
        trace.add_stall(time.perf_counter() - t0)
        trace.finish(ok=False, error=e)
        raise
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
) -> dict[str, Any]:
    """The whole checkpoint as plain full tensors and values, in one process.

    For evaluation jobs: no ``torch.distributed`` needed, whatever parallelism
    saved it. ``sd["model"]`` is a plain module state dict; optimizer state is
    keyed by parameter FQN.
    """
    opts = engine.LoadOptions(strict=True, verify=verify, allow_pickle=allow_pickle, io_threads=io_threads)
    storage = _storage(url, storage_options)
    ctx = DistContext.local()
    trace = Trace("load", storage.url)
    try:
        md, chunks = engine.read_checkpoint(storage, ctx, trace)
        flat = flatten_tree(Slot(), target=True)
        result = engine.load_flat(storage, flat, ctx, md, chunks, opts, trace)
    except BaseException as e:
        trace.finish(ok=False, error=e)
        raise
    trace.finish(ok=True)
    value = result.values[""]
    if not isinstance(value, dict):  # pragma: no cover - save always takes a dict
        raise ConfigError(f"{storage.url}: the checkpoint's root is not a dict")
    return value
