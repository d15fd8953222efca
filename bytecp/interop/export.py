"""``bytecp export``: a checkpoint's tensors for evaluation and serving jobs,
in one safetensors file or a torch state dict; the Hugging Face layout
(sharded safetensors, index, config) is :mod:`bytecp.interop.hf_export`, built on
the pieces here.

Called by the CLI (``bytecp export``) and by user code, in one process with
no ``torch.distributed``:

1. :func:`open_export` opens the checkpoint
   (:func:`bytecp.loading.opened.open_checkpoint`): its metadata and every
   index row, sizes checked against the real files before anything is
   allocated;
2. :func:`select_tensors` decides which tensors, under which names and in
   which dtype (``prefix``, tied aliases, ``dtype`` casts);
3. :class:`TensorReader` reads them a group at a time (memory: one group of
   small tensors up to :data:`GROUP_BYTES`, or one larger tensor);
4. :func:`safetensors_pieces` turns them into a safetensors file as a stream
   of pieces that ``Storage.write_stream`` publishes atomically, casting in
   blocks of :data:`CAST_ELEMENTS` elements.

So a safetensors export holds about one tensor plus the storage's write
buffer in memory, whatever the checkpoint's size. ``--format torch`` cannot:
``torch.save`` needs every tensor at once, so it holds the whole exported
state in memory (said in its docstring and the CLI's help).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import queue
import struct
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from bytecp.errors import BytecpError, CheckpointExistsError, ConfigError, StorageError
from bytecp.format import metadata as fmt
from bytecp.interop.source_select import default_selection, masters_of
from bytecp.loading.opened import OpenedCheckpoint, open_checkpoint
from bytecp.loading.reader import Target, execute_reads
from bytecp.plan.load_plan import plan_load
from bytecp.recorder import Trace
from bytecp.storage_api import Storage, open_storage, split_protocol
from bytecp.tools.progress import NO_PROGRESS, Progress
from bytecp.tree.bulk import gc_paused
from bytecp.tree.dtypes import dtype_from_name, host_memoryview, itemsize
from bytecp.tree.regions import full_region

__all__ = [
    "SAFETENSORS_DTYPES", "CAST_DTYPES", "CASTABLE", "GROUP_BYTES", "CAST_ELEMENTS", "ExportTensor", "ExportResult",
    "open_export", "select_tensors", "TensorReader", "safetensors_header", "safetensors_metadata",
    "safetensors_pieces", "split_url", "refuse_nested", "export_safetensors", "export_torch", "publish_renamed",
    "staging_name", "staged_failure",
]  # fmt: skip

SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}  # fmt: skip

#: ``dtype=`` values: the dtype floating tensors are cast to
CAST_DTYPES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
    "fp32": "float32", "float32": "float32",
}  # fmt: skip
#: the dtypes a cast applies to (float8 and integer tensors are written as stored)
#: stored dtypes a ``dtype=`` cast applies to (others are written as stored)
CASTABLE = ("float64", "float32", "float16", "bfloat16")
#: small tensors are read together, up to this many bytes per group
GROUP_BYTES = 64 << 20
#: a cast converts this many elements at a time
CAST_ELEMENTS = 4 << 20


@dataclasses.dataclass(frozen=True)
class ExportTensor:
    """One exported tensor: its output ``name``, the stored tensor ``fqn`` it is read from."""

    name: str
    fqn: str
    dtype: str  # as stored
    out_dtype: str  # as written
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes written."""
        return self.numel * itemsize(dtype_from_name(self.out_dtype))

    @property
    def stored_nbytes(self) -> int:
        return self.numel * itemsize(dtype_from_name(self.dtype))


@dataclasses.dataclass
class ExportResult:
    """What an export wrote (``bytecp export --json`` prints :meth:`to_json`)."""

    out: str
    format: str  # "hf", "safetensors" or "torch"
    files: dict[str, int]  # file -> bytes, relative to ``out`` for the Hugging Face layout
    tensors: int
    tensor_bytes: int
    omitted_aliases: list[str] = dataclasses.field(default_factory=list)
    config: str | None = None  # where config.json came from

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def open_export(src: str | Storage) -> OpenedCheckpoint:
    """The checkpoint at ``src`` (a storage, or a URL opened with no options)
    opened for an export: every index row read and checked, then every
    declared size against the real files. A foreign source (DCP, torch_dist,
    DeepSpeed, Hugging Face: :data:`bytecp.interop.SOURCES`) opens as a load opens it."""
    opened = open_checkpoint(src, foreign=True)
    opened.all_rows()
    opened.check_sizes()
    return opened


def _top_level_keys(md: fmt.Metadata) -> str:
    counts: dict[str, int] = {}
    for key, node in md.skeleton.items:
        counts[str(key)] = sum(1 for leaf in node.leaves() if leaf.kind == "tensor")  # (a leaf is its own)
    return ", ".join(f"{k!r} ({n} tensor{'s' if n != 1 else ''})" for k, n in counts.items()) or "none"


def select_tensors(
    md: fmt.Metadata, where: str, *, prefix: str | None = "model.", strip_prefix: bool = True,
    dtype: str | None = None, safetensors: bool = True, masters: bool = False,
) -> tuple[list[ExportTensor], list[str]]:
    """The tensors whose FQN starts with ``prefix`` (a trailing ``.`` is
    implied: ``model`` means ``model.``), in the saved order, and the aliases
    left out. A tied alias (``md.aliases``) is written once, under its stored
    name, as ``safetensors.torch.save_model`` and ``save_pretrained`` do; an
    alias whose stored tensor lies outside ``prefix`` is written under the
    alias's name. ``dtype`` casts floating tensors (see :data:`CAST_DTYPES`);
    ``safetensors``: refuse dtypes safetensors cannot hold (complex).
    ``prefix=None``: the checkpoint's default (:func:`bytecp.interop.source_select.default_selection`);
    ``masters``: each model tensor read from its fp32 master where one is
    saved apart (:func:`bytecp.interop.source_select.masters_of`)."""
    skip: tuple[str, ...] = ()
    if prefix is None:
        prefix, skip = default_selection(md)
    master = masters_of(md, where) if masters else {}
    if prefix and not prefix.endswith("."):
        prefix += "."
    out_dtype = None
    if dtype is not None:
        out_dtype = CAST_DTYPES.get(dtype)
        if out_dtype is None:
            raise ConfigError(f"dtype {dtype!r} is not one of {', '.join(CAST_DTYPES)}")

    def item(fqn: str, stored: str) -> ExportTensor:
        stored = master.get(stored, stored)
        info = md.tensors[stored]
        cast = out_dtype if out_dtype and info["dtype"] in CASTABLE else info["dtype"]
        name = fqn[len(prefix):] if strip_prefix else fqn
        return ExportTensor(name, stored, info["dtype"], cast, tuple(info["shape"]))

    items = [item(f, f) for f in md.tensors if f.startswith(prefix) and f.split(".", 1)[0] not in skip]
    omitted: list[str] = []
    for alias, stored in md.aliases.items():
        if alias.startswith(prefix):
            if stored.startswith(prefix):
                omitted.append(alias)
            else:
                items.append(item(alias, stored))
    if not items:
        raise ConfigError(
            f"{where}: no tensor of the checkpoint starts with {prefix!r}; its top-level keys are "
            f"{_top_level_keys(md)}. Pass prefix=KEY (--prefix KEY on the command line) for the tensors "
            "saved under KEY, or '' for every tensor"
        )
    bad = next((t for t in items if t.out_dtype not in SAFETENSORS_DTYPES), None)
    if safetensors and bad is not None:
        raise ConfigError(f"{where}: safetensors has no dtype for tensor {bad.fqn!r} ({bad.out_dtype}); "
                          "export it with --format torch")
    return items, omitted


class TensorReader:
    """Reads exported tensors from a checkpoint, in order, a group at a time.

    Consecutive tensors are read together (one planned batch of ranged reads,
    coalesced per file) up to :data:`GROUP_BYTES`; a larger tensor is a group
    of its own. Every chunk's crc32c is checked (a foreign source has none). The generator drops each
    tensor once the consumer asks for the next.
    """

    def __init__(self, opened: OpenedCheckpoint, *, io_threads: int = 8, group_bytes: int = GROUP_BYTES) -> None:
        self.storage, self.io_threads, self.group_bytes = opened.storage, io_threads, group_bytes
        self.by_fqn: dict[str, list[fmt.ChunkRecord]] = {}
        for c in opened.all_rows():
            self.by_fqn.setdefault(c.fqn, []).append(c)
        self.trace = Trace("export", opened.storage.url)
        self.verify = not opened.foreign  # a source's rows carry no checksums

    def read(self, items: Iterable[ExportTensor]) -> Iterator[tuple[ExportTensor, torch.Tensor]]:
        group: list[ExportTensor] = []
        size = 0
        for it in items:
            if group and size + it.stored_nbytes > self.group_bytes:
                yield from self._group(group)
                group, size = [], 0
            group.append(it)
            size += it.stored_nbytes
        if group:
            yield from self._group(group)

    def _group(self, group: list[ExportTensor]) -> Iterator[tuple[ExportTensor, torch.Tensor]]:
        # planned and read with the cyclic collector paused (a group of thousands of small tensors
        # makes objects enough to start collections of the whole heap); never paused across a yield
        with gc_paused():
            full = [torch.empty(it.shape, dtype=dtype_from_name(it.dtype)) for it in group]
            targets = [Target(it.fqn, full_region(it.shape), t) for it, t in zip(group, full, strict=True)]
            tensors: list[torch.Tensor | None] = list(full)
            del full
            chunks: list[fmt.ChunkRecord] = []
            for fqn in dict.fromkeys(it.fqn for it in group):
                chunks.extend(self.by_fqn.get(fqn, []))
            sizes = {it.fqn: itemsize(dtype_from_name(it.dtype)) for it in group}
            reqs = plan_load([(t.fqn, t.box) for t in targets], chunks, itemsizes=sizes)
            execute_reads(self.storage, chunks, targets, reqs, io_threads=self.io_threads, verify=self.verify,
                          trace=self.trace)
            del targets
        for i, it in enumerate(group):
            t, tensors[i] = tensors[i], None
            assert t is not None
            yield it, t
            del t


def safetensors_header(items: Sequence[ExportTensor], metadata: dict[str, str]) -> bytes:
    """The 8-byte length and the JSON header (space-padded to 8 bytes, as safetensors does)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    pos = 0
    for it in items:
        header[it.name] = {"dtype": SAFETENSORS_DTYPES[it.out_dtype], "shape": list(it.shape),
                           "data_offsets": [pos, pos + it.nbytes]}
        pos += it.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _cast_pieces(t: torch.Tensor, out_dtype: str) -> Iterator[memoryview]:
    if t.numel() == 0:
        return
    want = dtype_from_name(out_dtype)
    if t.dtype == want:
        yield host_memoryview(t)
        return
    flat = t.reshape(-1)
    for lo in range(0, flat.numel(), CAST_ELEMENTS):
        yield host_memoryview(flat[lo : lo + CAST_ELEMENTS].to(want))


def safetensors_pieces(header: bytes, items: Sequence[ExportTensor], reader: TensorReader,
                       progress: Progress = NO_PROGRESS) -> Iterator[memoryview]:
    """A safetensors file as a stream of pieces, for ``Storage.write_stream``."""
    yield memoryview(header)
    for it, t in reader.read(items):
        yield from _cast_pieces(t, it.out_dtype)
        progress.advance(it.nbytes)


def split_url(url: str) -> tuple[str, str]:
    """``"s3://b/run/model.safetensors"`` -> ``("s3://b/run", "model.safetensors")``;
    a bare local name's parent is ``"."``."""
    u = url.rstrip("/")
    proto, rest = split_protocol(u)
    if "/" not in rest:
        if proto == "file" and "://" not in u and u not in ("", "."):
            return ".", u
        raise ConfigError(f"output {url!r} names no file or directory below a parent; add a name")
    parent, name = u.rsplit("/", 1)
    if name in (".", ".."):
        raise ConfigError(f"output {url!r} must end in a name, not {name!r}")
    return (parent or "/"), name


def safetensors_metadata(md: fmt.Metadata) -> dict[str, str]:
    """The header's ``__metadata__``: ``format: pt`` (what transformers writes) and the save's provenance."""
    return {"format": "pt", "bytecp_save_id": md.save_id, "step": str(md.step)}


def refuse_nested(src: str, out: str) -> None:
    """The output is neither the checkpoint nor inside it nor above it: an
    export (or its overwrite) must never touch a checkpoint's files."""
    def norm(u: str) -> str:
        proto, rest = split_protocol(u)
        local = proto in ("file", "local")
        return (os.path.realpath(os.path.expanduser(rest)) if local else u).rstrip("/") + "/"

    a, b = norm(src), norm(out)
    if a.startswith(b) or b.startswith(a):
        raise ConfigError(f"the export output {out} {'is' if a == b else 'contains or is inside'} the checkpoint "
                          f"{src}; choose an output outside it")


def _single_file_target(src: str, out: str, out_options: dict[str, Any] | None, overwrite: bool,
                        file_name: str) -> tuple[Storage, str, str]:
    """(parent storage, file name, output URL) of a one-file export: ``out``
    itself, or ``out/<file_name>`` when ``out`` is a directory (a model
    directory holding config and tokenizer files gets its weights beside them)."""
    parent_url, name = split_url(out)
    parent = open_storage(parent_url, **(out_options or {}))
    refuse_nested(src, parent.url.rstrip("/") + "/" + name)
    proto, rest = split_protocol(parent.url.rstrip("/") + "/" + name)
    is_dir = os.path.isdir(os.path.expanduser(rest)) if proto in ("file", "local") else bool(parent.list_files(name))
    if is_dir:
        parent, name, out = parent.child(name), file_name, out.rstrip("/") + "/" + file_name
    if not overwrite and parent.exists(name):
        raise CheckpointExistsError(f"{out} already exists; pass --overwrite (overwrite=True) to replace it")
    return parent, name, out


def export_safetensors(
    src: str | Storage, out: str, *, prefix: str | None = None, strip_prefix: bool = True, dtype: str | None = None,
    overwrite: bool = False, out_options: dict[str, Any] | None = None, progress: Progress = NO_PROGRESS,
    masters: bool = False,
) -> ExportResult:
    """Write the selected tensors to ONE safetensors file at ``out`` (any URL),
    streamed (about one tensor in memory) and published atomically.
    ``prefix``/``masters`` as :func:`select_tensors` (None: the checkpoint's default)."""
    opened = open_export(src)
    storage, md = opened.storage, opened.metadata
    items, omitted = select_tensors(md, storage.url, prefix=prefix, strip_prefix=strip_prefix, dtype=dtype,
                                    masters=masters)
    parent, name, out = _single_file_target(storage.url, out, out_options, overwrite, "model.safetensors")
    header = safetensors_header(items, safetensors_metadata(md))
    total = sum(it.nbytes for it in items)
    progress.start(total)
    n = parent.write_stream(name, safetensors_pieces(header, items, TensorReader(opened), progress),
                            size_hint=len(header) + total)
    return ExportResult(out, "safetensors", {name: n}, len(items), total, omitted)


class _QueueWriter:
    """A write-only file for ``torch.save`` whose bytes are consumed from another thread."""

    def __init__(self) -> None:
        self.q: queue.Queue[bytes | BaseException | None] = queue.Queue(maxsize=4)
        self.closed = threading.Event()  # the consumer stopped: the producer must too

    def write(self, b: Any) -> int:
        data = bytes(b)  # the view is only valid during the call
        while True:
            if self.closed.is_set():
                raise OSError("the export's output stopped accepting bytes")
            try:
                self.q.put(data, timeout=0.5)
                return len(data)
            except queue.Full:
                continue

    def flush(self) -> None:
        pass

    def pieces(self) -> Iterator[bytes]:
        while (item := self.q.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item


def export_torch(
    src: str | Storage, out: str, *, prefix: str | None = None, strip_prefix: bool = True, dtype: str | None = None,
    overwrite: bool = False, out_options: dict[str, Any] | None = None, progress: Progress = NO_PROGRESS,
    masters: bool = False,
) -> ExportResult:
    """``torch.save`` a flat ``{name: tensor}`` dict to ``out`` (loads with ``weights_only=True``).

    Memory: every exported tensor at once (``torch.save`` needs them
    together), plus a few pieces of the file while it is uploaded; use the
    safetensors formats for states larger than memory."""
    opened = open_export(src)
    storage, md = opened.storage, opened.metadata
    items, omitted = select_tensors(md, storage.url, prefix=prefix, strip_prefix=strip_prefix, dtype=dtype,
                                    safetensors=False, masters=masters)
    parent, name, out = _single_file_target(storage.url, out, out_options, overwrite, "pytorch_model.bin")
    total = sum(it.nbytes for it in items)
    progress.start(total)
    sd: dict[str, torch.Tensor] = {}
    for it, t in TensorReader(opened).read(items):
        sd[it.name] = t.to(dtype_from_name(it.out_dtype))
        progress.advance(it.nbytes)
    writer = _QueueWriter()

    def save() -> None:
        try:
            torch.save(sd, writer)  # type: ignore[arg-type]  # write() and flush() are all it uses
            end: BaseException | None = None
        except BaseException as e:  # handed to the consumer, raised there
            end = e
        while not writer.closed.is_set():
            try:
                writer.q.put(end, timeout=0.5)
                return
            except queue.Full:
                continue

    th = threading.Thread(target=save, name="bytecp-export-torch", daemon=True)
    th.start()
    try:
        n = parent.write_stream(name, writer.pieces())
    finally:
        writer.closed.set()
        th.join()
    return ExportResult(out, "torch", {name: n}, len(items), total, omitted)


def publish_renamed(parent: Storage, name: str, out: str, occupied: bool,
                    write: Callable[[str], dict[str, int]], *, too_large: str) -> dict[str, int]:
    """(the directory exporters, on a filesystem) ``write(stage)`` fills a
    hidden sibling of ``out`` below ``parent``, then one rename publishes it
    (exchanging it with the old ``out`` when ``occupied``); on any failure
    the sibling is removed and the old ``out`` is untouched, and the error
    names ``out`` (:func:`staged_failure`; ``too_large``: what to do when a
    file passed the largest file allowed)."""
    stage = staging_name(name)
    try:
        sizes = write(stage)
        try:
            parent.rename(stage, name, replace=occupied)
        except CheckpointExistsError:
            raise CheckpointExistsError(f"{out} was created by someone else while this export ran; "
                                        "pass --overwrite to replace it, or choose another output") from None
    except BaseException as e:
        parent.delete_prefix(stage)
        told = staged_failure(e, stage, name, out, too_large=too_large)
        if told is e:
            raise
        raise told from e
    return sizes


def staging_name(name: str) -> str:
    """The hidden sibling a directory export of ``name`` is written into before its rename."""
    return f".{name}.bytecp-export-{uuid.uuid4().hex[:8]}"


def staged_failure(err: BaseException, stage: str, name: str, out: str, *, too_large: str) -> BaseException:
    """(a directory export that failed; its staging folder already removed)
    The error as the user should read it: naming OUT, never the hidden
    staging folder, saying that nothing changed and what to do. A storage
    error keeps its class (so its exit code: 3); anything else is returned
    as it is. ``too_large``: the exporter's advice when a file passed the
    largest file allowed (EFBIG)."""
    if not isinstance(err, OSError) or isinstance(err, BytecpError) and not isinstance(err, StorageError):
        return err  # (an output created meanwhile says so itself)
    reason = str(err).replace(stage, name)
    cause = err.__cause__ if isinstance(err.__cause__, OSError) else err
    advice = ""
    if cause.errno == errno.EFBIG:
        advice = f"; {too_large}"
    elif cause.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM):
        advice = "; fix the cause and run the export again"
    msg = f"{out}: the export failed and changed nothing (its partial output was removed): {reason}{advice}"
    try:
        return type(err)(msg)
    except TypeError:  # an OSError subclass with another signature
        return OSError(cause.errno, msg)
