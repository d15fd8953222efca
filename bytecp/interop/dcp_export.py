"""``bytecp export CK OUT --format dcp``: a torch.distributed.checkpoint (DCP)
directory that ``dcp.load`` (and torchtitan's DCP checkpointer) loads into
any layout at any world size.

Called by the CLI and by user code, in one process with no
``torch.distributed``:

1. :func:`plan_dcp` turns the checkpoint's skeleton into the state dict a
   DCP user would have saved -- tensors as placeholders, non-tensor values
   read (JSON, or ``torch.save`` blobs loaded with ``weights_only=True``) --
   and flattens it with DCP's own ``flatten_state_dict``, so every key and
   its ``planner_data`` path are those ``dcp.save`` gives the same state:
   ``model.<fqn>``, ``optim.state.<param fqn>.exp_avg``,
   ``optim.param_groups.0.lr`` (bytecp names optimizer state by parameter
   FQN as ``get_optimizer_state_dict`` does, :mod:`bytecp.adapters._optim`);
2. :func:`export_dcp` writes the data files (``__<i>_0.distcp``, cut at
   ``max_file_size`` so the ranks of a load read several files at once):
   every tensor read whole by :class:`~bytecp.interop.export.TensorReader`
   and ``torch.save``-d into the file stream (one whole-tensor chunk each:
   DCP reshards on load), every non-tensor value as ``torch.save`` bytes
   (:class:`~torch.distributed.checkpoint.metadata.BytesStorageMetadata`);
3. then ``.metadata``: a pickle of DCP's ``Metadata`` built from torch's own
   classes (``version``, ``storage_meta``, ``planner_data`` as
   ``FileSystemWriter`` writes them).

Memory: about one tensor (torch.save hands its bytes to the storage stream
without a copy, :class:`_SaveStream`) plus the storage's write buffer.

Names: by default everything, under its bytecp name (``prefix=""``), so
``dcp.load({"model": model.state_dict(), "optim": get_optimizer_state_dict(...)})``
loads a ``bytecp.save({"model": model, "optim": opt})``; ``prefix="model."``
with ``strip_prefix`` writes only the model's tensors at the top
(``dcp.load(model.state_dict(), ...)``, or torchtitan's model-only load).
A tied alias is written under both names, one copy of its bytes. A value
saved per rank (``PerRank``) is written as rank 0's, as ``dcp.save`` keeps
the coordinator's copy of a non-tensor value.

Commit: on filesystems the directory is written as a hidden sibling and
renamed into place (with ``overwrite``, exchanged with the old one); on
object stores ``.metadata`` is written last (an ``overwrite`` first deletes
the old one, so an interrupted export never looks loadable).
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import queue
import threading
import uuid
from collections.abc import Generator, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from bytecp.errors import CheckpointExistsError, ConfigError
from bytecp.format import metadata as fmt
from bytecp.format.objects import read_object
from bytecp.interop.export import (
    CAST_DTYPES,
    CASTABLE,
    ExportResult,
    ExportTensor,
    TensorReader,
    open_export,
    publish_renamed,
    refuse_nested,
    split_url,
)
from bytecp.interop.hf_export import plan_shards
from bytecp.loading.opened import OpenedCheckpoint
from bytecp.storage_api import Storage, open_storage
from bytecp.tools.progress import NO_PROGRESS, Progress
from bytecp.tree.dtypes import SUPPORTED_DTYPES, dtype_from_name
from bytecp.tree.skeleton import Node

__all__ = ["METADATA_NAME", "DEFAULT_FILE_BYTES", "DcpPlan", "plan_dcp", "dcp_metadata", "export_dcp"]

#: DCP's commit file
METADATA_NAME = ".metadata"
#: a data file is cut once it holds this many tensor bytes (a larger tensor gets a file of its own)
DEFAULT_FILE_BYTES = 1 << 30


@dataclasses.dataclass
class DcpPlan:
    """What :func:`plan_dcp` decided: the flattened DCP keys of every entry."""

    #: (DCP key, the stored tensor it is read from), in the state's order
    tensors: list[tuple[str, ExportTensor]]
    #: DCP key -> a non-tensor value (torch.save bytes); may hold placeholders of stored tensors
    objects: dict[str, Any]
    #: DCP key -> a tensor found inside a stored object (written from memory)
    loose: dict[str, torch.Tensor]
    #: DCP key -> its path in the state dict (``Metadata.planner_data``)
    mappings: dict[str, Any]
    #: placeholder id -> the stored tensor it stands for
    placeholders: dict[int, ExportTensor]
    #: names of values saved per rank, written as rank 0's
    per_rank: list[str]
    #: the placeholders themselves, alive while their ids key ``placeholders``
    holders: list[torch.Tensor] = dataclasses.field(default_factory=list, repr=False)

    def unique_tensors(self) -> list[ExportTensor]:
        """Each stored tensor once (aliases share its bytes), in order."""
        return list({it.fqn: it for _, it in self.tensors}.values())


def _find(md: fmt.Metadata, prefix: str, where: str) -> tuple[tuple[Any, ...], Node]:
    want = prefix.rstrip(".")
    if not want:
        return (), md.skeleton

    def walk(node: Node, path: tuple[Any, ...], fqn: str) -> Iterator[tuple[tuple[Any, ...], str, Node]]:
        yield path, fqn, node
        if not node.is_leaf and (not fqn or want.startswith(fqn + ".")):
            for key, child in node.items:
                yield from walk(child, (*path, key), f"{fqn}.{key}" if fqn else str(key))

    for path, fqn, node in walk(md.skeleton, (), ""):
        if fqn == want:
            return path, node
    keys = ", ".join(repr(str(k)) for k, _ in md.skeleton.items) or "none"
    raise ConfigError(f"{where}: the checkpoint holds nothing named {want!r}; its top-level keys are {keys}. "
                      "Pass --prefix KEY for the values saved under KEY, or --prefix '' for everything")


def plan_dcp(
    opened: OpenedCheckpoint, *, prefix: str = "", strip_prefix: bool = True, dtype: str | None = None,
    allow_pickle: bool = False,
) -> DcpPlan:
    """(one process) The DCP entries of the checkpoint ``opened``: the values
    under ``prefix`` (all by default), the prefix kept in their names unless
    ``strip_prefix``; ``dtype`` casts floating tensors (see
    :data:`~bytecp.interop.export.CAST_DTYPES`). Reads the non-tensor values
    (small); a pickle blob only with ``allow_pickle``."""
    storage, md = opened.storage, opened.metadata
    where = storage.url
    out_dtype = None
    if dtype is not None:
        out_dtype = CAST_DTYPES.get(dtype)
        if out_dtype is None:
            raise ConfigError(f"dtype {dtype!r} is not one of {', '.join(CAST_DTYPES)}")
    path, node = _find(md, prefix, where)
    placeholders: dict[int, ExportTensor] = {}
    keep: list[torch.Tensor] = []  # placeholders stay alive while their ids are keys
    per_rank: list[str] = []

    def leaf(kind: str, name: str) -> Any:
        if kind == "tensor":
            stored = md.aliases.get(name, name)
            info = md.tensors[stored]
            if info["dtype"] not in SUPPORTED_DTYPES:
                raise ConfigError(f"{where}: tensor {name!r} is {info['dtype']}, a dtype this torch cannot "
                                  "save for DCP; export it with --format safetensors, or leave it out with --prefix")
            cast = out_dtype if out_dtype and info["dtype"] in CASTABLE else info["dtype"]
            shape = tuple(info["shape"])
            ph = torch.empty(shape, dtype=dtype_from_name(cast), device="meta")
            keep.append(ph)
            placeholders[id(ph)] = ExportTensor(name, stored, info["dtype"], cast, shape)
            return ph
        if kind == "rank":
            records = md.per_rank[name]
            per_rank.append(name)
            return read_object(storage, name, records[min(records)], verify=True, allow_pickle=allow_pickle)
        return read_object(storage, name, md.objects[name], verify=True, allow_pickle=allow_pickle)

    value = node.build(leaf)
    if strip_prefix and path:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: {prefix.rstrip('.')!r} is a single value, not a dict of values; "
                              "pass --keep-prefix to export it under its name")
        state = value
    else:
        for key in reversed(path):
            value = {key: value}
        state = value
    flat, mappings = flatten_state_dict(state)
    plan = DcpPlan([], {}, {}, dict(mappings), placeholders, per_rank, keep)
    for key, v in flat.items():
        if isinstance(v, torch.Tensor) and id(v) in placeholders:
            plan.tensors.append((key, dataclasses.replace(placeholders[id(v)], name=key)))
        elif isinstance(v, torch.Tensor):
            plan.loose[key] = v
        else:
            plan.objects[key] = v
    if not plan.tensors and not plan.objects and not plan.loose:
        raise ConfigError(f"{where}: nothing to export under {prefix!r}")
    return plan


def _substitute(value: Any, real: dict[int, torch.Tensor]) -> Any:
    """``value`` with every placeholder replaced by its tensor (for a tuple of tensors, which DCP stores as bytes)."""
    if isinstance(value, torch.Tensor):
        return real.get(id(value), value)
    if isinstance(value, dict):
        return type(value)((k, _substitute(v, real)) for k, v in value.items())
    if isinstance(value, list | tuple):
        return type(value)(_substitute(v, real) for v in value)
    return value


def _holds_placeholder(value: Any, placeholders: dict[int, ExportTensor]) -> list[int]:
    if isinstance(value, torch.Tensor):
        return [id(value)] if id(value) in placeholders else []
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else ()
    return [i for v in items for i in _holds_placeholder(v, placeholders)]


_DONE = object()


class _SaveStream:
    """``torch.save`` calls run on a producer thread; each piece of bytes they
    write is handed to ``Storage.write_stream`` without a copy, and the
    producer waits until the backend asks for the next one (the piece may
    be a view of the tensor torch is saving). Writes under :data:`SMALL`
    bytes (a torch.save archive's headers: dozens a tensor) are copied into
    one buffer handed over with the next large piece, so a tensor costs
    a few hand-offs. ``spans`` records each job's ``(offset, length)`` in the file."""

    SMALL = 64 << 10

    def __init__(self, jobs: Iterator[tuple[Any, Any]]) -> None:
        self.jobs, self.pos = jobs, 0
        self.spans: dict[Any, tuple[int, int]] = {}
        self._q: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._ack = threading.Semaphore(0)
        self._stop = threading.Event()
        self._small = bytearray()

    def _put(self, item: Any) -> bool:
        """Queue ``item`` for the consumer; False once it stopped (nothing queued)."""
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def _hand(self, mv: memoryview) -> None:
        """Give ``mv`` to the consumer and wait until it is done with it (or gone)."""
        if self._put(mv):
            while not self._ack.acquire(timeout=0.5) and not self._stop.is_set():
                pass

    def _drain(self) -> None:
        if self._small:
            self._hand(memoryview(self._small))
            self._small = bytearray()

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        n = mv.nbytes
        if self._stop.is_set():
            # the consumer is gone (the output failed): torch.save finishes its archive into nothing.
            # Raising here instead leaves torch's C++ archive writer unfinished, and collecting it
            # later aborts the process ("terminate called without an active exception")
            self.pos += n
            return n
        if n < self.SMALL:
            self._small += mv
        else:
            self._drain()
            self._hand(mv)
        self.pos += n
        return n

    def flush(self) -> None:
        pass

    def _run(self) -> None:
        end: Any = _DONE
        try:
            for key, obj in self.jobs:
                if self._stop.is_set():
                    break
                start = self.pos
                torch.save(obj, self)  # type: ignore[arg-type]  # write() and flush() are all it uses
                self.spans[key] = (start, self.pos - start)
            self._drain()
        except BaseException as e:  # handed to the consumer, raised there
            end = e
        self._put(end)

    def pieces(self) -> Generator[memoryview, None, None]:
        th = threading.Thread(target=self._run, name="bytecp-export-dcp", daemon=True)
        th.start()
        try:
            while (item := self._q.get()) is not _DONE:
                if isinstance(item, BaseException):
                    raise item
                yield item
                self._ack.release()
        finally:
            self._stop.set()
            self._ack.release()
            th.join()


def dcp_metadata(plan: DcpPlan, where: dict[tuple[str, str], tuple[str, int, int]], checkpoint_id: str) -> Metadata:
    """DCP's ``Metadata`` for ``plan``; ``where``: ``("t", stored tensor FQN)`` or
    ``("k", DCP key)`` -> (file, offset, length)."""
    sd_md: dict[str, Any] = {}
    storage_data: dict[MetadataIndex, Any] = {}
    for key, it in plan.tensors:
        file, off, n = where["t", it.fqn]
        size = torch.Size(it.shape)
        zero = torch.Size([0] * len(it.shape))
        sd_md[key] = TensorStorageMetadata(TensorProperties(dtype=dtype_from_name(it.out_dtype)), size,
                                           [ChunkStorageMetadata(zero, size)])
        storage_data[MetadataIndex(key, zero)] = dcp_fs._StorageInfo(file, off, n)
    for key, t in plan.loose.items():
        file, off, n = where["k", key]
        zero = torch.Size([0] * t.dim())
        sd_md[key] = TensorStorageMetadata(TensorProperties(dtype=t.dtype), t.size(), [ChunkStorageMetadata(zero, t.size())])
        storage_data[MetadataIndex(key, zero)] = dcp_fs._StorageInfo(file, off, n)
    for key in plan.objects:
        file, off, n = where["k", key]
        sd_md[key] = BytesStorageMetadata()
        storage_data[MetadataIndex(key)] = dcp_fs._StorageInfo(file, off, n)
    return Metadata(state_dict_metadata=sd_md, planner_data=plan.mappings, storage_data=storage_data,
                    storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id=uuid.uuid4().hex),
                    version=dcp_fs.CURRENT_DCP_VERSION)


def _jobs(plan: DcpPlan, items: Sequence[ExportTensor], reader: TensorReader, first: bool,
          progress: Progress) -> Iterator[tuple[tuple[str, str], Any]]:
    """What one data file holds, in order: (the first file) the non-tensor
    values and tensors found in them, then its stored tensors."""
    if first:
        yield from ((("k", k), t) for k, t in plan.loose.items())
        for key, v in plan.objects.items():
            ids = _holds_placeholder(v, plan.placeholders)
            if ids:  # a tuple of tensors: DCP stores it as bytes
                wanted = list({plan.placeholders[i].fqn: plan.placeholders[i] for i in ids}.values())
                got = {it.fqn: t for it, t in reader.read(wanted)}
                v = _substitute(v, {i: got[plan.placeholders[i].fqn].to(dtype_from_name(plan.placeholders[i].out_dtype))
                                    for i in ids})
            yield ("k", key), v
    for it, t in reader.read(items):
        yield ("t", it.fqn), t.to(dtype_from_name(it.out_dtype))
        progress.advance(it.nbytes)


def _write(target: Storage, base: str, plan: DcpPlan, files: list[list[ExportTensor]], reader: TensorReader,
           checkpoint_id: str, progress: Progress) -> dict[str, int]:
    """Every data file below ``base``, then ``.metadata``; returns file -> bytes."""
    sizes: dict[str, int] = {}
    where: dict[tuple[str, str], tuple[str, int, int]] = {}
    for i, items in enumerate(files):
        name = f"__{i}_0.distcp"
        stream = _SaveStream(_jobs(plan, items, reader, i == 0, progress))
        pieces = stream.pieces()
        try:
            sizes[name] = target.write_stream(f"{base}/{name}" if base else name, pieces,
                                              size_hint=sum(it.nbytes for it in items))
        finally:  # a failed write leaves the generator suspended: stop its producer thread now, not at exit
            pieces.close()
        where.update({k: (name, off, n) for k, (off, n) in stream.spans.items()})
    buf = io.BytesIO()
    pickle.dump(dcp_metadata(plan, where, checkpoint_id), buf)
    target.commit(f"{base}/{METADATA_NAME}" if base else METADATA_NAME, buf.getvalue())
    sizes[METADATA_NAME] = buf.tell()
    return sizes


def export_dcp(
    src: str | Storage, out: str, *, prefix: str = "", strip_prefix: bool = True, dtype: str | None = None,
    overwrite: bool = False, out_options: dict[str, Any] | None = None, progress: Progress = NO_PROGRESS,
    max_file_size: int = DEFAULT_FILE_BYTES, allow_pickle: bool = False,
) -> ExportResult:
    """Export the checkpoint at ``src`` as a DCP checkpoint directory at ``out``
    (any URL bytecp writes); see the module docstring for names and commit.

    ``prefix``/``strip_prefix``: the values exported and their names
    (default: everything, as saved); ``dtype``: cast floating tensors;
    ``max_file_size``: tensor bytes per data file; ``allow_pickle``: export
    values saved as arbitrary pickles (they are unpickled here)."""
    if max_file_size < 1:
        raise ConfigError(f"max_file_size must be at least 1 byte, got {max_file_size}")
    opened = open_export(src)
    storage = opened.storage
    plan = plan_dcp(opened, prefix=prefix, strip_prefix=strip_prefix, dtype=dtype, allow_pickle=allow_pickle)
    options = dict(out_options or {})
    target = open_storage(out, **options)
    refuse_nested(storage.url, target.url)
    existing = target.list_files("")
    if existing and not overwrite:
        raise CheckpointExistsError(f"{out} already exists and holds files; pass --overwrite "
                                    "(overwrite=True) to replace it, or choose another output")
    files = plan_shards(plan.unique_tensors(), max_file_size)
    reader = TensorReader(opened)
    total = sum(it.nbytes for it in plan.unique_tensors())
    progress.start(total)
    if target.atomic_rename:
        sizes = _publish_renamed(out, options, plan, files, reader, progress)
    else:
        sizes = _publish_in_place(target, existing, plan, files, reader, progress)
    return ExportResult(out, "dcp", sizes, len(plan.tensors) + len(plan.loose), total)


def _publish_renamed(out: str, options: dict[str, Any], plan: DcpPlan, files: list[list[ExportTensor]],
                     reader: TensorReader, progress: Progress) -> dict[str, int]:
    """(filesystems) Write a hidden sibling, then rename it to ``out`` (exchange with the old one)."""
    parent_url, name = split_url(out)
    parent = open_storage(parent_url, **options)
    occupied = name in parent.list_children("")
    return publish_renamed(parent, name, out, occupied,
                           lambda st: _write(parent, st, plan, files, reader, out, progress),
                           too_large="export with bytecp.interop.dcp_export.export_dcp(..., max_file_size=N) "
                                     "below that size, or raise the limit")


def _publish_in_place(target: Storage, existing: list[str], plan: DcpPlan, files: list[list[ExportTensor]],
                      reader: TensorReader, progress: Progress) -> dict[str, int]:
    """(object stores) The old ``.metadata`` withdrawn first, the data files,
    the new ``.metadata`` last; then the old export's other files removed."""
    if METADATA_NAME in existing:
        target.delete([METADATA_NAME])
    try:
        sizes = _write(target, "", plan, files, reader, target.url, progress)
    except BaseException:
        try:
            target.abort_incomplete_uploads()
        except Exception:  # noqa: BLE001 - best effort; the original error matters
            pass
        raise
    target.delete([f for f in existing if f not in sizes])
    return sizes
