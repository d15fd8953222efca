"""Executes plans: stage and write a rank's boxes, commit, and read them back.

Called by :mod:`bytecp.api` on every rank, with the storage, the flattened
state and a :class:`~bytecp.dist.DistContext`:

save: ``local plan -> (coordinator) global plan -> stage -> write data files
(writer threads, crc32c on the fly) -> write this rank's index -> (coordinator)
commit metadata.json -> (coordinator) delete what an overwrite replaced``.
Any failure on any rank reaches every rank; the coordinator then removes the
failed save's files, so nothing but the earlier checkpoint remains.

load: ``(coordinator) read metadata + index, broadcast -> match keys ->
plan ranged reads -> read in parallel straight into the targets``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import logging
import math
import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import crc32c as _crc32c
import torch

from . import diagnose, limits
from . import format as fmt
from .dist import DistContext
from .dtypes import byte_view, dtype_from_name, dtype_name, host_memoryview, itemsize
from .errors import (
    CheckpointExistsError,
    ConfigError,
    CorruptCheckpointError,
    PickleNotAllowedError,
    StateMismatchError,
    StorageError,
)
from .planner import (
    DEFAULT_SPLIT_BYTES,
    LocalSavePlan,
    ReadRequest,
    WriteItem,
    find_overlap,
    plan_fingerprint,
    plan_load,
    plan_save,
    plan_shared_reads,
)
from .recorder import Trace
from .regions import Region, row_major_strides
from .state import (
    FlatTree,
    TensorLeaf,
    build_from_skeleton,
    is_json_leaf,
    iter_skeleton,
    merge_skeletons,
    skeleton_digest,
)
from .storage_api import Storage

__all__ = [
    "SaveOptions",
    "LoadOptions",
    "LoadResult",
    "save_flat",
    "load_flat",
    "read_checkpoint",
    "read_metadata",
    "read_chunks",
]

log = logging.getLogger(__name__)
T = TypeVar("T")
_ZEROS = bytes(fmt.ALIGNMENT)


def crc32c(data: Any, value: int = 0) -> int:
    return int(_crc32c.crc32c(data, value))


def _fault(phase: str, rank: int) -> None:
    """Test hook: ``BYTECP_FAULT_DELAY=phase:rank:seconds`` sleeps in that phase,
    ``BYTECP_FAULT_ERROR=phase:rank`` raises there, ``BYTECP_FAULT_EXIT=phase:rank``
    ends the process there (a rank dying mid-save)."""
    spec = os.environ.get("BYTECP_FAULT_EXIT")
    if spec:
        for item in spec.split(","):
            p, r = item.split(":")
            if p == phase and int(r) == rank:
                os._exit(17)
    spec = os.environ.get("BYTECP_FAULT_DELAY")
    if spec:
        for item in spec.split(","):
            p, r, s = item.split(":")
            if p == phase and int(r) == rank:
                time.sleep(float(s))
    spec = os.environ.get("BYTECP_FAULT_ERROR")
    if spec:
        for item in spec.split(","):
            p, r = item.split(":")
            if p == phase and int(r) == rank:
                raise RuntimeError(f"injected failure in phase {phase!r} on rank {rank}")


@dataclasses.dataclass(kw_only=True)
class SaveOptions:
    """How a save runs (engine-level settings; the API fills them in)."""

    #: replace a committed checkpoint at the same URL
    overwrite: bool = False
    #: store values that need full pickling (loading them needs allow_pickle too)
    allow_pickle: bool = False
    #: writer threads (and data files) per rank
    io_threads: int = 4
    #: replicated boxes at least this large are split across their replicas
    split_bytes: int = DEFAULT_SPLIT_BYTES
    #: write per-rank monitoring reports beside the checkpoint
    write_reports: bool = True

    def __post_init__(self) -> None:
        if self.io_threads < 1:
            raise ConfigError(f"io_threads must be >= 1, got {self.io_threads}")
        if self.split_bytes < 1:
            raise ConfigError(f"split_bytes must be >= 1, got {self.split_bytes}")


@dataclasses.dataclass(kw_only=True)
class LoadOptions:
    """How a load runs."""

    #: missing or unexpected keys are an error (else reported in the result)
    strict: bool = True
    #: check each chunk's crc32c when it is read whole
    verify: bool = True
    #: allow unpickling blobs saved with allow_pickle=True (runs code from the checkpoint)
    allow_pickle: bool = False
    #: reader threads per rank
    io_threads: int = 8
    #: boxes every rank needs (replicated targets: DDP, plain tensors) are read
    #: once, in pieces spread over the ranks, and exchanged over the process
    #: group; None: on for remote storage (object stores, HDFS), off for local
    zero_redundancy: bool | None = None

    def __post_init__(self) -> None:
        if self.io_threads < 1:
            raise ConfigError(f"io_threads must be >= 1, got {self.io_threads}")


@dataclasses.dataclass
class LoadResult:
    """What a load found: keys the target wanted but the checkpoint lacks, and
    keys the checkpoint has that the target did not ask for."""

    missing_keys: list[str]
    unexpected_keys: list[str]
    metadata: fmt.Metadata
    values: dict[str, Any]  # slot fqn -> rebuilt value


# ----------------------------------------------------------------- plan cache
class PlanCache:
    """Global save plans by the fingerprints of every rank's local plan.

    A later save whose local plans are unchanged exchanges only fingerprints.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._plans: dict[tuple[Any, str], tuple[tuple[str, ...], list[WriteItem]]] = {}

    def get(self, key: Any, fp: str) -> tuple[tuple[str, ...], list[WriteItem]] | None:
        with self._lock:
            return self._plans.get((key, fp))

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()

    def put(self, key: Any, fp: str, all_fps: tuple[str, ...], mine: list[WriteItem]) -> None:
        with self._lock:
            self._plans[(key, fp)] = (all_fps, mine)
            if len(self._plans) > 64:
                self._plans.pop(next(iter(self._plans)))


PLAN_CACHE = PlanCache()


def _digest(fps: tuple[str, ...]) -> str:
    import hashlib

    return hashlib.blake2b("|".join(fps).encode(), digest_size=16).hexdigest()


def _local_plan(flat: FlatTree, rank: int) -> LocalSavePlan:
    items = []
    for fqn, leaf in flat.tensors.items():
        name = dtype_name(leaf.dtype)
        size = itemsize(leaf.dtype)
        for sh in leaf.shards:
            items.append(WriteItem(fqn, sh.region, name, size, tuple(leaf.global_shape)))
    return LocalSavePlan(rank, tuple(items))


def _global_plan(flat: FlatTree, ctx: DistContext, opts: SaveOptions, trace: Trace) -> list[WriteItem]:
    """This rank's share of the global plan, exchanging only fingerprints when cached."""
    with trace.span("plan"):
        _fault("plan", ctx.rank)
        local = _local_plan(flat, ctx.rank)
        fp = plan_fingerprint(local)
        cache_key = (ctx.world_size, ctx.rank, opts.split_bytes, id(ctx.group))
        cached = PLAN_CACHE.get(cache_key, fp)
        if ctx.enabled:
            # every rank sends its fingerprint and the digest of the fingerprints
            # its cached plan was made for; the plan is reused only if every rank
            # holds one made for exactly this set (decided alike on all ranks)
            have = _digest(cached[0]) if cached is not None else None
            gathered = ctx.all_gather("save plan", lambda: (fp, have))
            fps = tuple(g[0] for g in gathered)
            if cached is not None and all(g[1] == _digest(fps) for g in gathered):
                return cached[1]
            mine = ctx.reduce_scatter(
                "save plan",
                lambda: local,
                lambda plans: plan_save(plans, split_bytes=opts.split_bytes),
            )
        else:
            fps = (fp,)
            if cached is not None:
                return cached[1]
            mine = plan_save([local], split_bytes=opts.split_bytes)[0]
        PLAN_CACHE.put(cache_key, fp, fps, mine)
        return mine


# ----------------------------------------------------------------- staging
def _source_view(leaf: TensorLeaf, region: Region, fqn: str) -> torch.Tensor:
    for sh in leaf.shards:
        if sh.region.contains(region):
            return sh.tensor[region.relative_to(sh.region).slices()]
    raise ConfigError(f"tensor {fqn!r}: this rank holds no shard containing {region}")


def _as_host_bytes(t: torch.Tensor) -> memoryview:
    """The logical bytes of a tensor view, without copying when it is a
    contiguous CPU tensor (never the whole underlying storage)."""
    if t.device.type != "cpu":
        t = t.to("cpu")
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return host_memoryview(t)


@dataclasses.dataclass
class _Staged:
    item: WriteItem
    data: memoryview


def stage_items(flat: FlatTree, items: Sequence[WriteItem]) -> list[_Staged]:
    """Views of the bytes to write (synchronous save: no copies when contiguous)."""
    return [_Staged(it, _as_host_bytes(_source_view(flat.tensors[it.fqn], it.region, it.fqn))) for it in items]


# ----------------------------------------------------------------- objects
def _serialize_object(fqn: str, value: Any, allow_pickle: bool) -> tuple[Any, bytes | None, bool]:
    """-> (json value or None, blob or None, needs_pickle)."""
    if is_json_leaf(value):
        return value, None, False
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
    except Exception as e:
        raise ConfigError(f"cannot serialize {fqn!r} ({type(value).__name__}): {e}") from e
    blob = buf.getvalue()
    try:
        torch.load(io.BytesIO(blob), weights_only=True)
        return None, blob, False
    except Exception as e:
        if not allow_pickle:
            raise ConfigError(
                f"{fqn!r} is a {type(value).__name__}, which can only be stored as an arbitrary "
                f"pickle ({e.__class__.__name__}); convert it to tensors/JSON-able values, or pass "
                "allow_pickle=True to save (and to load)"
            ) from None
        return None, blob, True


# ----------------------------------------------------------------- writing
@dataclasses.dataclass
class _RankOutput:
    chunks: list[fmt.ChunkRecord]
    data_files: dict[str, int]
    index_file: str | None
    objects: dict[str, fmt.ObjectRecord]
    per_rank: dict[str, fmt.ObjectRecord]
    #: this rank's skeleton and tensor specs, sent only when its skeleton
    #: differs from the coordinator's
    skeleton: Any = None
    tensors: dict[str, dict[str, Any]] | None = None


def _tensor_specs(flat: FlatTree) -> dict[str, dict[str, Any]]:
    return {
        fqn: {"dtype": dtype_name(leaf.dtype), "shape": list(leaf.global_shape)}
        for fqn, leaf in flat.tensors.items()
    }


#: below this many bytes per file, more files (and writer threads) do not pay
FILE_TARGET_BYTES = 32 << 20


def _split_files(staged: list[_Staged], blobs: list[tuple[str, bytes]], n: int) -> list[tuple[list[_Staged], list[tuple[str, bytes]]]]:
    total = sum(len(s.data) for s in staged)
    n = max(1, min(n, -(-total // FILE_TARGET_BYTES), len(staged)))
    bins: list[tuple[list[_Staged], list[tuple[str, bytes]]]] = [([], []) for _ in range(n)]
    loads = [0] * n
    for s in sorted(staged, key=lambda s: -len(s.data)):
        i = loads.index(min(loads))
        bins[i][0].append(s)
        loads[i] += len(s.data)
    i = loads.index(min(loads))
    bins[i][1].extend(blobs)
    for b in bins:
        b[0].sort(key=lambda s: (s.item.fqn, s.item.region))
    return [b for b in bins if b[0] or b[1]]


def _write_one_file(
    storage: Storage, path: str, staged: list[_Staged], blobs: list[tuple[str, bytes]]
) -> tuple[list[fmt.ChunkRecord], dict[str, tuple[int, int, int]], int]:
    buffers: list[Any] = []
    chunks: list[fmt.ChunkRecord] = []
    blob_pos: dict[str, tuple[int, int, int]] = {}
    pos = 0

    def append(data: Any) -> int:
        nonlocal pos
        start = pos
        if len(data):
            buffers.append(data)
        pos += len(data)
        pad = (-pos) % fmt.ALIGNMENT
        if pad:
            buffers.append(_ZEROS[:pad])
            pos += pad
        return start

    for s in staged:
        start = append(s.data)
        it = s.item
        chunks.append(
            fmt.ChunkRecord(
                it.fqn, it.dtype, it.global_shape, it.region.offsets, it.region.lengths,
                path, start, len(s.data), crc32c(s.data),
            )
        )
    for fqn, blob in blobs:
        start = append(blob)
        blob_pos[fqn] = (start, len(blob), crc32c(blob))
    storage.write_file(path, buffers)
    return chunks, blob_pos, pos


def write_rank(
    storage: Storage,
    save_id: str,
    rank: int,
    staged: list[_Staged],
    objects: dict[str, Any],
    per_rank: dict[str, Any],
    opts: SaveOptions,
    trace: Trace,
    first_file: int = 0,
) -> _RankOutput:
    """Write data files ``first_file``, ``first_file+1``... of this rank (one
    per writer thread); returns their chunks and object records."""
    obj_records: dict[str, fmt.ObjectRecord] = {}
    rank_records: dict[str, fmt.ObjectRecord] = {}
    blobs: list[tuple[str, bytes]] = []
    blob_kind: dict[str, tuple[str, bool]] = {}
    for kind, values in (("obj", objects), ("rank", per_rank)):
        for fqn, value in values.items():
            jv, blob, needs_pickle = _serialize_object(fqn, value, opts.allow_pickle)
            if blob is None:
                (obj_records if kind == "obj" else rank_records)[fqn] = fmt.ObjectRecord(json=jv)
            else:
                key = f"{kind}:{fqn}"
                blobs.append((key, blob))
                blob_kind[key] = (fqn, needs_pickle)

    groups = _split_files(staged, blobs, opts.io_threads)
    paths = [fmt.data_file(save_id, rank, first_file + i) for i in range(len(groups))]
    with trace.span("write") as sp:
        _fault("write", rank)
        jobs = list(zip(paths, groups, strict=True))
        if len(jobs) == 1:
            results = [_write_one_file(storage, jobs[0][0], *jobs[0][1])]
        else:
            with concurrent.futures.ThreadPoolExecutor(len(jobs), "bytecp-write") as ex:
                results = list(ex.map(lambda j: _write_one_file(storage, j[0], *j[1]), jobs))
        chunks: list[fmt.ChunkRecord] = []
        data_files: dict[str, int] = {}
        for path, (ch, bpos, size) in zip(paths, results, strict=True):
            chunks.extend(ch)
            data_files[path] = size
            for key, (off, n, crc) in bpos.items():
                fqn, needs_pickle = blob_kind[key]
                rec = fmt.ObjectRecord(file=path, byte_offset=off, nbytes=n, crc32c=crc, pickle=needs_pickle)
                (obj_records if key.startswith("obj:") else rank_records)[fqn] = rec
        sp.nbytes = sum(data_files.values())
        sp.files = len(data_files)
    return _RankOutput(chunks, data_files, None, obj_records, rank_records)


@dataclasses.dataclass
class PreparedSave:
    """A save after its target check and plan: what this rank must write."""

    save_id: str
    old: fmt.Metadata | None
    items: list[WriteItem]
    digest: str
    coordinator_digest: str
    #: commit only if nothing committed at the URL meanwhile (a save without overwrite)
    exclusive: bool = True


def prepare_save(
    storage: Storage,
    flat: FlatTree,
    ctx: DistContext,
    opts: SaveOptions,
    trace: Trace,
    save_id: str | None = None,
) -> PreparedSave:
    """(all ranks) Refuse to overwrite unless asked, pick the save id, plan."""
    digest = skeleton_digest(flat.skeleton)

    def check_target() -> tuple[str, fmt.Metadata | None, str]:
        old = None
        if storage.exists(fmt.METADATA_FILE):
            if not opts.overwrite:
                raise CheckpointExistsError(
                    f"{storage.url} already holds a committed checkpoint; pass overwrite=True "
                    "to replace it (the old one stays intact until the new one commits)"
                )
            try:
                old = fmt.Metadata.from_bytes(storage.read_bytes(fmt.METADATA_FILE), storage.url)
            except Exception:
                old = None  # an unreadable old checkpoint is simply replaced
        return save_id or fmt.new_save_id(), old, digest

    sid, old, coordinator_digest = ctx.broadcast("save", check_target)
    trace.checkpoint_id = sid
    items = _global_plan(flat, ctx, opts, trace)
    return PreparedSave(sid, old, items, digest, coordinator_digest, exclusive=not opts.overwrite)


def objects_to_write(flat: FlatTree, ctx: DistContext, prep: PreparedSave) -> dict[str, Any]:
    """Replicated objects are written by the coordinator; a rank whose state
    tree differs from the coordinator's writes its own too (the coordinator
    keeps its records and adds only the missing ones)."""
    if ctx.is_coordinator or prep.digest != prep.coordinator_digest:
        return flat.objects
    return {}


def merge_outputs(outputs: Sequence[_RankOutput]) -> _RankOutput:
    """One rank's outputs of several write batches as one."""
    out = _RankOutput([], {}, None, {}, {})
    for o in outputs:
        out.chunks += o.chunks
        out.data_files.update(o.data_files)
        out.objects.update(o.objects)
        out.per_rank.update(o.per_rank)
    return out


def write_batch(
    storage: Storage,
    prep: PreparedSave,
    ctx: DistContext,
    flat: FlatTree,
    staged: list[_Staged],
    opts: SaveOptions,
    trace: Trace,
    earlier: Sequence[_RankOutput] = (),
) -> _RankOutput:
    """Write one staged batch of this rank into the next data files; the
    objects go with the first batch."""
    return write_rank(
        storage, prep.save_id, ctx.rank, staged,
        objects_to_write(flat, ctx, prep) if not earlier else {},
        flat.per_rank if not earlier else {}, opts, trace,
        first_file=sum(len(o.data_files) for o in earlier),
    )


def write_last_batch(
    storage: Storage,
    prep: PreparedSave,
    ctx: DistContext,
    flat: FlatTree,
    staged: list[_Staged],
    opts: SaveOptions,
    trace: Trace,
    earlier: Sequence[_RankOutput] = (),
) -> _RankOutput:
    """Write this rank's last (or only) batch, then its index over every batch."""
    out = merge_outputs([*earlier, write_batch(storage, prep, ctx, flat, staged, opts, trace, earlier)])
    if out.chunks:
        out.index_file = fmt.index_file(prep.save_id, ctx.rank)
        storage.write_file(out.index_file, [fmt.write_index(out.chunks)])
    return out


def run_or_clean_up(storage: Storage, ctx: DistContext, prep: PreparedSave, fn: Callable[[], T]) -> T:
    """A fail-together step of a save; if any rank fails, the coordinator
    removes the save's files before the error propagates."""
    try:
        return ctx.run("save", fn)
    except BaseException:
        if ctx.is_coordinator:
            cleanup_save(storage, prep.save_id)
        raise


def commit_save(
    storage: Storage,
    flat: FlatTree,
    ctx: DistContext,
    prep: PreparedSave,
    write: Callable[[], _RankOutput],
    *,
    framework: str,
    parallelism: dict[str, Any],
    step: int | None,
    user_metadata: dict[str, Any],
    trace: Trace,
    bytecp_version: str = "",
) -> fmt.Metadata:
    """(all ranks) Run ``write`` (this rank's data files and index), then the
    coordinator commits ``metadata.json``; a failure anywhere fails every rank
    and removes the save's files."""
    sid = prep.save_id

    def write_step() -> _RankOutput:
        out = write()
        if prep.digest != prep.coordinator_digest:
            out.skeleton, out.tensors = flat.skeleton, _tensor_specs(flat)
        return out

    def commit(outputs: list[_RankOutput]) -> fmt.Metadata:
        with trace.span("commit") as sp:
            _fault("commit", ctx.rank)
            skel = flat.skeleton
            tensors = _tensor_specs(flat)
            for out in outputs:
                if out.skeleton is not None and out.tensors is not None:
                    skel = merge_skeletons(skel, out.skeleton)
                    for fqn, spec in out.tensors.items():
                        tensors.setdefault(fqn, spec)
            objects: dict[str, fmt.ObjectRecord] = {}
            per_rank: dict[str, dict[int, fmt.ObjectRecord]] = {}
            data_files: dict[str, int] = {}
            index_files: list[str] = []
            for r in [ctx.coordinator, *(r for r in range(len(outputs)) if r != ctx.coordinator)]:
                for fqn, rec in outputs[r].objects.items():
                    objects.setdefault(fqn, rec)
            for r, out in enumerate(outputs):
                for fqn, rec in out.per_rank.items():
                    per_rank.setdefault(fqn, {})[r] = rec
                data_files.update(out.data_files)
                if out.index_file:
                    index_files.append(out.index_file)
            md = fmt.Metadata(
                save_id=sid,
                world_size=ctx.world_size,
                framework=framework,
                parallelism=parallelism,
                skeleton=skel,
                tensors=tensors,
                objects=objects,
                per_rank=per_rank,
                index_files=index_files,
                data_files=data_files,
                step=step,
                user_metadata=user_metadata,
                bytecp_version=bytecp_version,
            )
            data = md.to_bytes()
            storage.commit(fmt.METADATA_FILE, data, exclusive=prep.exclusive)
            sp.nbytes = len(data)
            sp.files = 1
        return md

    committed = False

    def commit_once(outputs: list[_RankOutput]) -> fmt.Metadata:
        nonlocal committed
        md = commit(outputs)
        committed = True  # from here on the files belong to a checkpoint
        _fault("committed", ctx.rank)
        return md

    try:
        md = ctx.all_reduce("save", write_step, commit_once)
    except BaseException:
        if ctx.is_coordinator and not committed:
            cleanup_save(storage, sid)
        raise
    if ctx.is_coordinator and prep.old is not None:
        stale = prep.old.referenced_files() - md.referenced_files()
        stale |= {fmt.report_file(r) for r in range(ctx.world_size, prep.old.world_size)}
        try:
            storage.delete(sorted(stale))
        except Exception as e:  # the new checkpoint is committed; leftovers are only garbage
            log.warning("bytecp: could not delete files of the replaced checkpoint at %s: %s", storage.url, e)
    return md


def save_flat(
    storage: Storage,
    flat: FlatTree,
    ctx: DistContext,
    *,
    framework: str,
    parallelism: dict[str, Any],
    step: int | None,
    user_metadata: dict[str, Any],
    opts: SaveOptions,
    trace: Trace,
    save_id: str | None = None,
    bytecp_version: str = "",
) -> fmt.Metadata:
    """Synchronous save of a flattened state; every rank calls it. Contiguous
    tensors are written straight from their memory (no staging copy)."""
    prep = prepare_save(storage, flat, ctx, opts, trace, save_id)

    def write() -> _RankOutput:
        with trace.span("stage") as sp:
            staged = stage_items(flat, prep.items)
            sp.nbytes = sum(len(s.data) for s in staged)
        return write_last_batch(storage, prep, ctx, flat, staged, opts, trace)

    return commit_save(
        storage, flat, ctx, prep, write,
        framework=framework, parallelism=parallelism, step=step,
        user_metadata=user_metadata, trace=trace, bytecp_version=bytecp_version,
    )


def cleanup_save(storage: Storage, save_id: str) -> None:
    for prefix in (f"data/{save_id}/", f"index/{save_id}/"):
        try:
            storage.delete_prefix(prefix)
        except Exception as e:
            log.warning("bytecp: could not remove files of the failed save %s: %s", save_id, e)


# ----------------------------------------------------------------- reading
def read_metadata(storage: Storage) -> fmt.Metadata:
    """Read and validate ``metadata.json``; a typed error when there is none."""
    try:
        data = storage.read_bytes(fmt.METADATA_FILE)
    except (FileNotFoundError, StorageError) as e:
        # a file, a run directory, an interrupted save, nothing: say which
        diagnose.raise_not_a_checkpoint(storage, e)
    return fmt.Metadata.from_bytes(data, storage.url)


def check_chunks(storage: Storage, md: fmt.Metadata, chunks: list[fmt.ChunkRecord]) -> None:
    """Index rows must agree with metadata.json, and each tensor's chunks must
    tile it exactly (no gap, no overlap): a tampered or mixed-up index is
    corrupt, never trusted."""
    sizes: dict[str, int] = {}
    boxes: dict[str, list[Region]] = {}

    def bad(c: fmt.ChunkRecord, why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{storage.url}: index row of tensor {c.fqn!r} region {Region(c.offsets, c.lengths)}: {why}"
        )

    for c in chunks:
        info = md.tensors.get(c.fqn)
        if info is None:
            raise bad(c, "tensor not listed in metadata.json")
        shape = info["shape"]
        if c.dtype != info["dtype"] or list(c.global_shape) != shape:
            raise bad(c, f"says {c.dtype} {list(c.global_shape)}, metadata.json {info['dtype']} {shape}")
        if len(c.offsets) != len(shape) or len(c.lengths) != len(shape) or any(
            o < 0 or n < 0 or o + n > s for o, n, s in zip(c.offsets, c.lengths, shape, strict=True)
        ):
            raise bad(c, f"region outside the tensor's shape {shape}")
        size = sizes.get(c.dtype)
        if size is None:
            size = sizes[c.dtype] = itemsize(dtype_from_name(c.dtype))
        if c.nbytes != math.prod(c.lengths) * size:
            raise bad(c, f"{c.nbytes} bytes do not match the region's size")
        file_size = md.data_files.get(c.file)
        if file_size is None:
            fmt.check_path(c.file, "data", storage.url)
            raise bad(c, f"data file {c.file} is not listed in metadata.json")
        if c.byte_offset < 0 or c.byte_offset + c.nbytes > file_size:
            raise bad(c, f"bytes outside data file {c.file}")
        boxes.setdefault(c.fqn, []).append(Region(c.offsets, c.lengths))
    for fqn, bs in boxes.items():
        total = math.prod(md.tensors[fqn]["shape"])
        held = sum(b.numel for b in bs)
        pair = find_overlap(bs) if held >= total and len(bs) > 1 else None
        if held != total or pair is not None:
            what = f"chunks {pair[0]} and {pair[1]} overlap" if pair else f"chunks hold {held} of {total} elements"
            raise CorruptCheckpointError(f"{storage.url}: tensor {fqn!r}: {what}")


def read_chunks(storage: Storage, md: fmt.Metadata) -> list[fmt.ChunkRecord]:
    blobs = []
    for f in md.index_files:
        try:
            blobs.append((f, storage.read_bytes(f)))
        except FileNotFoundError as e:
            raise CorruptCheckpointError(
                f"{storage.url}: index file {f} named in metadata.json is missing ({e})"
            ) from e
    chunks = fmt.read_index(blobs, where=storage.url, row_budget=lambda: limits.max_index_rows(md, limits.real_data_sizes(storage, md)))
    check_chunks(storage, md, chunks)
    return chunks


@dataclasses.dataclass
class _Target:
    fqn: str
    box: Region
    view: torch.Tensor


def _read_object(storage: Storage, fqn: str, rec: fmt.ObjectRecord, opts: LoadOptions) -> Any:
    if not rec.is_blob:
        return rec.json
    assert rec.file is not None
    if rec.pickle and not opts.allow_pickle:
        raise PickleNotAllowedError(
            f"{storage.url}: {fqn!r} was saved as an arbitrary pickle (in {rec.file}); loading it "
            "could run code from the checkpoint. Pass allow_pickle=True only if you trust it"
        )
    try:
        blob = storage.read_bytes(rec.file, rec.byte_offset, rec.nbytes)
    except FileNotFoundError as e:
        raise CorruptCheckpointError(f"{storage.url}: data file {rec.file} holding {fqn!r} is missing") from e
    if opts.verify and crc32c(blob) != rec.crc32c:
        raise CorruptCheckpointError(
            f"{storage.url}/{rec.file}: checksum mismatch in object {fqn!r} "
            f"(bytes {rec.byte_offset}..{rec.byte_offset + rec.nbytes})"
        )
    return limits.load_blob(blob, f"{storage.url}: object {fqn!r} in {rec.file}", safe=not (rec.pickle and opts.allow_pickle))


#: reads smaller than this per file are not split across threads
READ_BATCH_MIN_BYTES = 8 << 20


def _execute_reads(
    storage: Storage,
    chunks: Sequence[fmt.ChunkRecord],
    targets: Sequence[_Target],
    reqs: Sequence[ReadRequest],
    opts: LoadOptions,
    trace: Trace,
) -> int:
    def prepare(req: ReadRequest) -> tuple[torch.Tensor, torch.Tensor, bool]:
        t = targets[req.target]
        dest = t.view[req.box.relative_to(t.box).slices()]
        direct = req.whole_chunk and dest.is_contiguous() and dest.device.type == "cpu"
        raw = byte_view(dest) if direct else torch.empty(req.nbytes, dtype=torch.uint8)
        return dest, raw, direct

    def finish(req: ReadRequest, dest: torch.Tensor, raw: torch.Tensor, direct: bool) -> None:
        c = chunks[req.chunk]
        if opts.verify and req.whole_chunk and crc32c(host_memoryview(raw)) != c.crc32c:
            raise CorruptCheckpointError(
                f"{storage.url}/{c.file}: checksum mismatch in tensor {c.fqn!r} region "
                f"{Region(c.offsets, c.lengths)} (bytes {c.byte_offset}..{c.byte_offset + c.nbytes})"
            )
        if not direct and req.box.numel:
            typed = raw.view(dest.dtype)
            src = torch.as_strided(typed, req.box.lengths, row_major_strides(c.lengths), 0)
            dest.copy_(src)

    def run(batch: list[ReadRequest]) -> int:
        """One ranged-read call per batch (all from one file): backends coalesce."""
        bufs = [prepare(r) for r in batch]
        file = chunks[batch[0].chunk].file
        try:
            storage.read_ranges(file, [(r.byte_offset, host_memoryview(raw)) for r, (_, raw, _) in zip(batch, bufs, strict=True)])
        except CorruptCheckpointError as e:
            names = sorted({chunks[r.chunk].fqn for r in batch})
            raise CorruptCheckpointError(f"{e} (reading tensor {names[0]!r} and {len(names) - 1} more from {file}; "
                                         f"first region {batch[0].box})" if len(names) > 1 else
                                         f"{e} (reading tensor {names[0]!r} region {batch[0].box})") from e
        except FileNotFoundError as e:
            c = chunks[batch[0].chunk]
            raise CorruptCheckpointError(
                f"{storage.url}: data file {c.file} holding tensor {c.fqn!r} region "
                f"{Region(c.offsets, c.lengths)} is missing"
            ) from e
        for r, (dest, raw, direct) in zip(batch, bufs, strict=True):
            finish(r, dest, raw, direct)
        return sum(r.nbytes for r in batch)

    # batches: the requests of one file in offset order, cut so that every
    # reader thread has work (about io_threads batches per file at least)
    by_file: dict[str, list[ReadRequest]] = {}
    for r in reqs:
        by_file.setdefault(chunks[r.chunk].file, []).append(r)
    batches: list[list[ReadRequest]] = []
    for file_reqs in by_file.values():
        file_reqs.sort(key=lambda r: r.byte_offset)
        total = sum(r.nbytes for r in file_reqs)
        cap = max(READ_BATCH_MIN_BYTES, -(-total // opts.io_threads))
        cur: list[ReadRequest] = []
        size = 0
        for r in file_reqs:
            if cur and size + r.nbytes > cap:
                batches.append(cur)
                cur, size = [], 0
            cur.append(r)
            size += r.nbytes
        if cur:
            batches.append(cur)

    with trace.span("read") as sp:
        if len(batches) <= 1 or opts.io_threads == 1:
            total = sum(run(b) for b in batches)
        else:
            with concurrent.futures.ThreadPoolExecutor(opts.io_threads, "bytecp-read") as ex:
                total = sum(ex.map(run, batches))
        sp.nbytes = total
        sp.files = len(by_file)
    return total


def read_checkpoint(
    storage: Storage, ctx: DistContext, trace: Trace
) -> tuple[fmt.Metadata, list[fmt.ChunkRecord]]:
    """(coordinator reads, every rank receives) the metadata and the chunk index."""

    def read_meta() -> tuple[fmt.Metadata, list[fmt.ChunkRecord]]:
        with trace.span("read_metadata") as sp:
            md = read_metadata(storage)
            chunks = read_chunks(storage, md)
            limits.check_sizes(storage, md, chunks)  # before any tensor is allocated
            sp.files = 1 + len(md.index_files)
        return md, chunks

    md, chunks = ctx.broadcast("load", read_meta)
    trace.checkpoint_id = md.save_id
    trace.step = md.step
    return md, chunks


def load_flat(
    storage: Storage,
    target: FlatTree,
    ctx: DistContext,
    md: fmt.Metadata,
    chunks: list[fmt.ChunkRecord],
    opts: LoadOptions,
    trace: Trace,
) -> LoadResult:
    """Fill ``target``'s tensors in place and rebuild its slots; every rank calls it."""
    missing, unexpected, values, targets = ctx.run(
        "load", lambda: _resolve_targets(storage, target, ctx, md, opts)
    )
    itemsizes = {fqn: itemsize(dtype_from_name(info["dtype"])) for fqn, info in md.tensors.items()}
    shared: list[list[tuple[str, Region, Region]]] = []
    zero = opts.zero_redundancy
    if zero is None:
        zero = storage.remote
    if zero and ctx.enabled and ctx.world_size > 1:
        # only whole tensors can be wanted by every rank (DDP, plain values):
        # sharded targets are never gathered
        def candidates() -> list[tuple[str, Region]]:
            return [(t.fqn, t.box) for t in targets
                    if t.box.lengths == tuple(md.tensors[t.fqn]["shape"]) and t.box.numel]

        specs = ctx.all_gather("load", candidates)
        with trace.span("plan"):
            shared = plan_shared_reads(specs, itemsizes)
    own, mine, views = _split_shared(targets, shared, ctx.rank)

    def read() -> None:
        with trace.span("plan"):
            reqs = plan_load([(t.fqn, t.box) for t in own], chunks, itemsizes=itemsizes)
        _execute_reads(storage, chunks, own, reqs, opts, trace)

    ctx.run("load", read)
    if shared:
        _exchange(ctx, shared, views, trace)
    return LoadResult(missing, unexpected, md, values)


def _split_shared(
    targets: list[_Target], shared: list[list[tuple[str, Region, Region]]], rank: int
) -> tuple[list[_Target], set[tuple[str, Region]], dict[tuple[str, Region], list[torch.Tensor]]]:
    """This rank's own reads: targets not shared, plus its pieces of shared boxes."""
    if not shared:
        return targets, set(), {}
    keys = {(fqn, box) for per in shared for fqn, box, _ in per}
    views: dict[tuple[str, Region], list[torch.Tensor]] = {}
    own: list[_Target] = []
    for t in targets:
        k = (t.fqn, t.box)
        if k in keys:
            views.setdefault(k, []).append(t.view)
        else:
            own.append(t)
    for fqn, box, piece in shared[rank]:
        own.append(_Target(fqn, piece, views[(fqn, box)][0][piece.relative_to(box).slices()]))
    return own, keys, views


def _exchange(
    ctx: DistContext,
    shared: list[list[tuple[str, Region, Region]]],
    views: dict[tuple[str, Region], list[torch.Tensor]],
    trace: Trace,
) -> None:
    """Every rank broadcasts the pieces it read (one packed buffer per rank)."""
    with trace.span("exchange") as sp:
        for src, pieces in enumerate(shared):
            parts = [views[(fqn, box)][0][piece.relative_to(box).slices()] for fqn, box, piece in pieces]
            sizes = [p.numel() * p.element_size() for p in parts]
            slots = [(n + 15) // 16 * 16 for n in sizes]  # every part 16-byte aligned
            total = sum(slots)
            if total == 0:
                continue
            buf = torch.empty(total, dtype=torch.uint8)
            pos = 0
            if ctx.rank == src:
                for part, n, slot in zip(parts, sizes, slots, strict=True):
                    buf[pos : pos + n].copy_(byte_view(part.contiguous()))
                    pos += slot
            ctx.broadcast_tensor("load", buf, src)
            sp.nbytes += total
            if ctx.rank != src:
                for part, n, slot in zip(parts, sizes, slots, strict=True):
                    if n:
                        part.copy_(buf[pos : pos + n].view(part.dtype).view(part.shape))
                    pos += slot
        # a rank that targets the same box twice gets the copies too
        for vs in views.values():
            for extra in vs[1:]:
                extra.copy_(vs[0])


def _resolve_targets(
    storage: Storage,
    target: FlatTree,
    ctx: DistContext,
    md: fmt.Metadata,
    opts: LoadOptions,
) -> tuple[list[str], list[str], dict[str, Any], list[_Target]]:
    """Match the target against the checkpoint (keys, shapes, dtypes), rebuild
    slots (their tensors become targets too) and list every box to fill."""
    _fault("read", ctx.rank)
    nodes = dict(iter_skeleton(md.skeleton))
    saved_leaves = set(md.tensors) | set(md.objects) | set(md.per_rank)

    missing: list[str] = []
    covered: set[str] = set()
    for fqn in target.tensors:
        if fqn in md.tensors:
            covered.add(fqn)
        else:
            missing.append(fqn)
    for fqn in target.slots:
        node = nodes.get(fqn)
        if node is None:
            missing.append(fqn)
            continue
        for _sub, n in iter_skeleton(node, fqn):
            for kind in ("tensor", "obj", "rank"):
                if kind in n:
                    covered.add(n[kind])
    unexpected = sorted(saved_leaves - covered)
    if opts.strict and (missing or unexpected):
        parts = [f"state does not match the checkpoint at {storage.url}:"]
        if missing:
            parts.append(f"  missing from the checkpoint ({len(missing)}): {_keys(missing)}")
        if unexpected:
            parts.append(f"  in the checkpoint but not in the state ({len(unexpected)}): {_keys(unexpected)}")
        parts.append("  pass strict=False to load the keys that match")
        raise StateMismatchError("\n".join(parts))

    targets: list[_Target] = []
    mismatches: list[str] = []
    for fqn, leaf in target.tensors.items():
        info = md.tensors.get(fqn)
        if info is None:
            continue
        shape, dt = tuple(info["shape"]), info["dtype"]
        if shape != tuple(leaf.global_shape) or dt != dtype_name(leaf.dtype):
            mismatches.append(
                f"{fqn}: checkpoint has {dt} {list(shape)}, target is "
                f"{dtype_name(leaf.dtype)} {list(leaf.global_shape)}"
            )
            continue
        for sh in leaf.shards:
            targets.append(_Target(fqn, sh.region, sh.tensor))
    if mismatches:
        raise StateMismatchError(
            f"tensor shape or dtype differs from the checkpoint at {storage.url}:\n  "
            + "\n  ".join(mismatches[:50])
            + ("\n  ..." if len(mismatches) > 50 else "")
        )

    # slots: rebuild from the skeleton; their tensors are allocated whole and read too
    same_world = md.world_size == ctx.world_size
    warned: list[str] = []
    values: dict[str, Any] = {}
    objects_cache: dict[str, Any] = {}

    def rebuild_leaf(kind: str, fqn: str) -> Any:
        if kind == "tensor":
            info = md.tensors[fqn]
            t = torch.empty(tuple(info["shape"]), dtype=dtype_from_name(info["dtype"]))
            targets.append(_Target(fqn, Region(tuple(0 for _ in t.shape), tuple(t.shape)), t))
            return t
        if kind == "obj":
            if fqn not in objects_cache:
                objects_cache[fqn] = _read_object(storage, fqn, md.objects[fqn], opts)
            return objects_cache[fqn]
        recs = md.per_rank[fqn]
        src = ctx.rank if same_world else ctx.rank % max(1, md.world_size)
        if not same_world:
            warned.append(fqn)
        if src not in recs:
            raise CorruptCheckpointError(f"{storage.url}: no per-rank value of {fqn!r} for rank {src}")
        return _read_object(storage, f"{fqn}[rank {src}]", recs[src], opts)

    for fqn, slot in target.slots.items():
        node = nodes.get(fqn)
        if node is None:
            values[fqn] = slot.default
            continue
        values[fqn] = build_from_skeleton(node, rebuild_leaf)
    if warned:
        warnings.warn(
            f"checkpoint {storage.url} was saved by {md.world_size} ranks and is loaded by "
            f"{ctx.world_size}: rank {ctx.rank} restores the per-rank state of saved rank "
            f"{ctx.rank % max(1, md.world_size)} for {', '.join(sorted(set(warned))[:5])}",
            stacklevel=_caller_stacklevel(),
        )

    return missing, unexpected, values, targets


def _caller_stacklevel() -> int:
    """The stacklevel that points a warning at the first frame outside bytecp."""
    import sys

    pkg = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(pkg)
    level, f = 1, sys._getframe(1)
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        if not (path.startswith(pkg + os.sep) or path.startswith(os.path.join(root, "adapters") + os.sep)):
            return level
        f, level = f.f_back, level + 1  # type: ignore[assignment]
    return level


def _keys(keys: Sequence[str], n: int = 20) -> str:
    shown = ", ".join(repr(k) for k in list(keys)[:n])
    return shown + (f", ... ({len(keys) - n} more)" if len(keys) > n else "")

