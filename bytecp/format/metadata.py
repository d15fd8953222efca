"""The on-storage format (docs/FORMAT.md is the normative spec): data files
``data/<save_id>/<rank>-<n>.bin`` (raw little-endian bytes, 4 KiB aligned),
the index ``index/<save_id>/...``, and ``metadata.json``, written last
(the commit point).

Files of one save carry its ``save_id``, so a save onto an existing
checkpoint (``overwrite=True``) never touches the files the committed
``metadata.json`` references; they are deleted only after the new commit.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from bytecp.data.positions import check_data
from bytecp.errors import CorruptCheckpointError, FormatVersionError
from bytecp.format import limits
from bytecp.format.index_schema import CHUNK_FIELDS, INDEX_FILE_NAME, IndexDirectory
from bytecp.format.json_head import HEADER_BYTES, check_header, decode_members, leading_members
from bytecp.format.member_text import EncodedMembers, dumps_object
from bytecp.format.members import MEMBER_DECODERS, Parsed
from bytecp.format.parts_schema import DIRECTORY_NAME, PartsDirectory
from bytecp.format.rank_records import RankRecords
from bytecp.format.tensor_table import TensorTable, table_json
from bytecp.tree.bulk import gc_paused
from bytecp.tree.skeleton import Node

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "METADATA_FILE",
    "ALIGNMENT",
    "INDEX_SCHEMA",
    "ChunkRecord",
    "chunk_record",
    "ObjectRecord",
    "Metadata",
    "new_save_id",
    "names_bytecp",
    "read_metadata",
    "is_bytecp_metadata",
    "data_file",
    "index_file",
    "report_file",
    "chunks_to_table",
    "table_to_chunks",
    "write_index",
    "column_values",
    "IndexDirectory",
    "PartsDirectory",
    "check_version",
    "check_references",
    "check_data_file",
    "own_files",
    "files_in",
]

FORMAT_NAME = "bytecp"
FORMAT_VERSION = 5
METADATA_FILE = "metadata.json"
ALIGNMENT = 4096

INDEX_SCHEMA = pa.schema(
    [("fqn", pa.string()), ("dtype", pa.string()), ("global_shape", pa.list_(pa.int64())), *CHUNK_FIELDS],
    metadata={b"bytecp.format_version": b"1"},
)


_SEGMENT = re.compile(r"[A-Za-z0-9._-]+")
#: a data file name :func:`check_path` accepts, as most are: ``data/<save_id>/<name>.bin``
_DATA_FILE = re.compile(r"data/(?!\.\.?/)[A-Za-z0-9._-]+/[A-Za-z0-9._-]*\.bin")


def check_path(path: str, kind: str, where: str, references: Mapping[str, str] | None = None) -> str:
    """A file name taken from a checkpoint: relative, below ``data/`` or
    ``index/``, with no ``..``/empty parts -- so a tampered checkpoint can
    never make a reader read, or an overwrite delete, anything outside it.
    With ``references`` (version 3), a data file may also be
    ``../<name>/data/<save_id>/<file>.bin``: a data file of the sibling
    checkpoint ``<name>`` of the same run, which ``references`` must list."""
    parts = path.split("/") if isinstance(path, str) else []
    if references is not None and kind == "data" and len(parts) == 5 and parts[0] == "..":
        if parts[1] in references and _SEGMENT.fullmatch(parts[1]) and parts[1] not in (".", ".."):
            check_path("/".join(parts[2:]), kind, where)
            return path
        raise CorruptCheckpointError(
            f"{where}: refusing data file {path!r}: a referenced file must lie in a checkpoint of the same run "
            "that metadata.json lists under 'references' (see FORMAT.md, references)"
        )
    if not (
        len(parts) == 3
        and parts[0] == kind
        and all(_SEGMENT.fullmatch(p) and p not in (".", "..") for p in parts)
        and (parts[2].endswith(".bin") if kind == "data" else parts[2].endswith(".parquet")
                 or parts[2] in (INDEX_FILE_NAME, DIRECTORY_NAME))
    ):
        raise CorruptCheckpointError(
            f"{where}: refusing file name {path!r}: checkpoint files must be {kind}/<save_id>/<name> "
            "relative to the checkpoint (see FORMAT.md, security)"
        )
    return path


def read_metadata(storage: Any, path: str = METADATA_FILE) -> bytes:
    """The bytes of the ``metadata.json`` at ``path`` of ``storage`` (a
    :class:`~bytecp.storage_api.Storage`), refused before anything is read
    when it is larger than a reader reads (:func:`bytecp.format.limits.check_metadata_size`).
    Every reader that parses a checkpoint's ``metadata.json`` reads it
    through here, but a save's reads of its own commit
    (:mod:`bytecp.saving.commit`, once the header names the save;
    :mod:`bytecp.saving.outcome`), which its coordinator warned about
    when it was larger."""
    n = storage.size(path)
    folder = path.rpartition("/")[0]
    limits.check_metadata_size(n, f"{storage.url}/{folder}" if folder else storage.url)
    return storage.read_bytes(path, 0, n)


def is_bytecp_metadata(storage: Any, path: str = METADATA_FILE) -> bool:
    """:func:`names_bytecp` of the ``metadata.json`` at ``path`` of ``storage``;
    of one larger than a reader reads, only its first bytes are read: bytecp's
    unless they name another format (listed as unreadable, it fails its load
    with the size error). Asked by the catalog and the run-folder scan."""
    n = storage.size(path)
    if n <= limits.max_metadata_bytes():
        return names_bytecp(storage.read_bytes(path, 0, n))
    head = leading_members(storage.read_bytes(path, 0, HEADER_BYTES).decode(errors="replace"), ("format",))
    return head is None or head.get("format", FORMAT_NAME) == FORMAT_NAME


def names_bytecp(data: bytes) -> bool:
    """Whether a ``metadata.json``'s bytes are bytecp's (or too damaged to
    tell: :meth:`Metadata.from_bytes` then says why), not another format's
    (Megatron's torch_dist folders hold a ``metadata.json`` too). Asked by
    ``open_checkpoint`` (try the sources?), the catalog and the run-folder
    scan of :mod:`bytecp.interop.runs`."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return True
    return not isinstance(doc, dict) or doc.get("format") == FORMAT_NAME


def new_save_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + uuid.uuid4().hex[:8]


def data_file(save_id: str, rank: int, n: int) -> str:
    return f"data/{save_id}/{rank}-{n}.bin"


def index_file(save_id: str, rank: int | None = None) -> str:
    """Version 1: rank ``rank``'s index; version 2 (``rank=None``): the one index file."""
    return f"index/{save_id}/{INDEX_FILE_NAME if rank is None else f'{rank}.parquet'}"


def report_file(rank: int) -> str:
    return f"reports/{rank}.json"


@dataclasses.dataclass(frozen=True)
class ChunkRecord:
    """One box of one tensor, stored contiguously (row-major) in a data file."""

    fqn: str
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    file: str
    byte_offset: int
    nbytes: int
    crc32c: int
    #: version 5, chunks over one block: each block's crc32c, packed (:mod:`bytecp.format.checksum`)
    blocks: bytes = b""

    def in_file(self, file: str) -> ChunkRecord:
        """This row naming ``file`` instead: its fields copied as one dict
        (``dataclasses.replace`` costs 12x more, the frozen constructor 3x: an
        incremental save renames each row it wrote, tens of thousands on a
        MoE rank, on the save's background thread)."""
        row = object.__new__(ChunkRecord)
        fields = row.__dict__
        fields.update(self.__dict__)
        fields["file"] = file
        return row


def chunk_record(fqn: str, dtype: str, global_shape: tuple[int, ...], offsets: tuple[int, ...],
                 lengths: tuple[int, ...], file: str, byte_offset: int, nbytes: int, crc32c: int,
                 blocks: bytes = b"") -> ChunkRecord:
    """``ChunkRecord(...)`` of fields already of their types, a third of the
    frozen constructor's cost (one ``object.__setattr__`` per field): what an
    index reader calls per row it keeps (thousands per load on every rank)."""
    row = object.__new__(ChunkRecord)
    f = row.__dict__
    f["fqn"], f["dtype"], f["global_shape"], f["offsets"], f["lengths"] = fqn, dtype, global_shape, offsets, lengths
    f["file"], f["byte_offset"], f["nbytes"], f["crc32c"], f["blocks"] = file, byte_offset, nbytes, crc32c, blocks
    return row


@dataclasses.dataclass(frozen=True)
class ObjectRecord:
    """A non-tensor value: inline JSON, or a ``torch.save`` blob in a data file."""

    json: Any = None
    file: str | None = None
    byte_offset: int = 0
    nbytes: int = 0
    crc32c: int = 0
    pickle: bool = False  # True: the blob needs full unpickling (allow_pickle=True)

    @property
    def is_blob(self) -> bool:
        return self.file is not None

    def to_json(self) -> dict[str, Any]:
        if not self.is_blob:
            return {"json": self.json}
        return {
            "file": self.file,
            "byte_offset": self.byte_offset,
            "nbytes": self.nbytes,
            "crc32c": self.crc32c,
            "pickle": self.pickle,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ObjectRecord:
        if "json" in d:
            return cls(json=d["json"])
        return cls(
            file=str(d["file"]),
            byte_offset=int(d["byte_offset"]),
            nbytes=int(d["nbytes"]),
            crc32c=int(d["crc32c"]),
            pickle=bool(d.get("pickle", False)),
        )


@dataclasses.dataclass
class Metadata:
    """Contents of ``metadata.json``: everything but the chunk index."""

    save_id: str
    world_size: int
    framework: str
    parallelism: dict[str, Any]
    skeleton: Node
    #: fqn -> {"dtype", "shape"[, "band_dim"]}; read from version 4: a TensorTable (the same mapping, as columns)
    tensors: Mapping[str, dict[str, Any]]
    objects: dict[str, ObjectRecord]
    #: fqn -> saved rank -> record (read: a RankRecords, decoded on demand after a broadcast)
    per_rank: Mapping[str, Mapping[int, ObjectRecord]]
    index_files: list[str]  # version 1: one index file per rank (version 2: empty)
    data_files: dict[str, int]  # path -> size in bytes
    step: int | None = None
    user_metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    created: float = dataclasses.field(default_factory=time.time)
    bytecp_version: str = ""
    format_version: int = FORMAT_VERSION
    #: tensors that shared storage in the saved state (tied embeddings, shared
    #: layers): alias FQN -> the FQN in ``tensors`` whose data it shares; the
    #: alias is stored once, under its canonical name
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)
    #: version 2 and 3: the one index file's segments; version 4: the parts
    #: and the directory's pages (None: a version-1 checkpoint)
    index: IndexDirectory | PartsDirectory | None = None
    #: version 3: checkpoints of the same run whose data files this one's
    #: rows name (``../<name>/data/...``): name -> the save id committed there
    references: dict[str, str] = dataclasses.field(default_factory=dict)
    #: data loaders' positions (fqn of a per-rank value -> every rank's position merged: FORMAT.md §6.8)
    data: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    #: (the coordinator's commit) the JSON text of ``skeleton`` and ``tensors``, kept between saves
    encoded: EncodedMembers | None = dataclasses.field(default=None, compare=False, repr=False)

    def to_bytes(self) -> bytes:
        # the members' text the commit kept (bytecp.format.member_text), else encoded here
        text = self.encoded.of(self.skeleton, self.tensors) if self.encoded and self.format_version >= 4 else {}
        d = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "bytecp_version": self.bytecp_version,
            "save_id": self.save_id,
            "created": self.created,
            "world_size": self.world_size,
            "framework": self.framework,
            "parallelism": self.parallelism,
            "step": self.step,
            "user_metadata": self.user_metadata,
        }
        if self.format_version >= 4:  # among the header members, always (§6.2 "Header")
            d["references"] = self.references
        d |= {
            "index_files": self.index_files,
            "data_files": self.data_files,
            "tensors": None if text else table_json(self.tensors) if self.format_version >= 4 else self.tensors,
            "objects": {k: v.to_json() for k, v in self.objects.items()},
            "per_rank": {
                k: {str(r): rec.to_json() for r, rec in v.items()} for k, v in self.per_rank.items()
            },
            "skeleton": None if text else self.skeleton.to_json(),
        }
        if self.aliases:
            d["aliases"] = self.aliases
        if self.data:
            d["data"] = self.data
        if self.index is not None:
            d["index"] = self.index.to_json()
        if self.references and self.format_version < 4:
            d["references"] = self.references
        return dumps_object(d, text)

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Metadata:
        with gc_paused():  # a million small objects for a state of 200,000 tensors (bytecp.tree.bulk)
            return cls._from_bytes(data, where)

    @classmethod
    def _from_bytes(cls, data: bytes, where: str) -> Metadata:
        d = decode_members(data, MEMBER_DECODERS)  # (the large members made one by one: bytecp.format.members)
        if d is None:
            try:
                d = json.loads(data)
            except (ValueError, RecursionError) as e:  # RecursionError: absurdly deep nesting
                raise CorruptCheckpointError(f"{where}: metadata.json is not valid JSON ({str(e)[:200]})") from e
        if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
            raise CorruptCheckpointError(f"{where}: metadata.json is not a bytecp checkpoint")
        version = check_version(d.get("format_version"), where)
        if d.get("step") is not None and type(d["step"]) is not int:
            raise CorruptCheckpointError(f"{where}: metadata.json's step {d['step']!r:.40} is not an integer")
        if version >= 4:
            check_header(d, data, where)

        def member(key: str, make: Callable[[Any], Any]) -> Any:
            value = d[key]
            return value.value if isinstance(value, Parsed) else make(value)

        try:
            tensors = member("tensors", lambda t: TensorTable.from_json(t, where) if version >= 4 and "names" in t
                             else dict(t))
            shared = tensors.shared if isinstance(tensors, TensorTable) else None
            return cls(
                save_id=str(d["save_id"]),
                world_size=int(d["world_size"]),
                framework=str(d["framework"]),
                parallelism=dict(d.get("parallelism") or {}),
                skeleton=member("skeleton", lambda s: Node.from_json(s, f"{where}/metadata.json", shared)),
                tensors=tensors,
                objects={k: ObjectRecord.from_json(v) for k, v in d["objects"].items()},
                per_rank={  # compact across the load's broadcast (bytecp.format.rank_records)
                    k: _rank_records({int(r): ObjectRecord.from_json(rec) for r, rec in v.items()})
                    for k, v in d.get("per_rank", {}).items()
                },
                index_files=[str(f) for f in d["index_files"]],
                data_files=member("data_files", lambda f: {str(k): int(v) for k, v in f.items()}),
                step=d.get("step"),
                user_metadata=dict(d.get("user_metadata") or {}),
                created=float(d.get("created", 0.0)),
                bytecp_version=str(d.get("bytecp_version", "")),
                format_version=version,
                aliases={str(k): str(v) for k, v in (d.get("aliases") or {}).items()},
                index=(member("index", lambda x: PartsDirectory.from_json(x, where)) if version >= 4
                       else IndexDirectory.from_json(d["index"], where) if version >= 2 else None),
                references=check_references(d.get("references"), where) if version >= 3 else {},
                data=check_data(d.get("data"), where, int(d["world_size"])),
            ).validate(where)
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            raise CorruptCheckpointError(f"{where}: metadata.json is malformed ({e!r:.300})") from e

    def validate(self, where: str) -> Metadata:
        """Every file name the metadata holds is safe (see :func:`check_path`),
        and every size and shape is within the hostile-input budget
        (:func:`bytecp.format.limits.check_structure`)."""
        limits.check_structure(self, where)
        for f in self.index_files:
            check_path(f, "index", where)
        if self.index is not None:
            check_path(self.index.file, "index", where)
            if isinstance(self.index, PartsDirectory) and (self.index.block_bytes is None) != (self.format_version < 5):
                raise CorruptCheckpointError(f"{where}: metadata.json's index {'lacks' if self.format_version >= 5 else 'has'}"
                                             f" block_bytes, which format version {self.format_version} "
                                             f"{'requires' if self.format_version >= 5 else 'does not know'}")
            if self.index_files:
                raise CorruptCheckpointError(f"{where}: metadata.json lists version-1 index files beside the index")
        refs = self.references if self.format_version >= 3 else None
        for f in self.data_files:  # one per rank
            check_data_file(f, where, refs)
        for rec in [*self.objects.values(), *(r for v in self.per_rank.values() for r in v.values())]:
            if rec.file is not None:
                check_path(rec.file, "data", where)
        for alias, canonical in self.aliases.items():
            if alias in self.tensors or canonical not in self.tensors:
                raise CorruptCheckpointError(
                    f"{where}: metadata.json aliases tensor {alias!r} to {canonical!r}; an alias must name "
                    "a tensor stored under another name, and no stored tensor"
                )
        tensors, aliases = self.tensors, self.aliases
        tables: dict[str, Any] = {"obj": self.objects, "rank": self.per_rank}
        for leaf in self.skeleton.leaves():
            name = leaf.name
            if leaf.kind == "tensor" and (name in tensors or name in aliases):
                continue
            if name not in tables.get(leaf.kind, ()):
                raise CorruptCheckpointError(
                    f"{where}: skeleton names {leaf.kind} {leaf.name!r}, which metadata.json lacks"
                )
        return self

    def referenced_files(self) -> set[str]:
        """This checkpoint's own files that it needs (never another checkpoint's)."""
        extra = set() if self.index is None else set(self.index.files) if isinstance(self.index, PartsDirectory) \
            else {self.index.file}
        return set(self.index_files) | set(self.own_data_files) | extra

    @property
    def own_data_files(self) -> dict[str, int]:
        """The data files stored in this checkpoint (path -> size), without those it references."""
        return own_files(self.data_files)

    def files_of(self, name: str) -> dict[str, int]:
        """The data files of the referenced checkpoint ``name`` this one reads,
        as paths relative to ``name`` (path -> size)."""
        return files_in(self.data_files, name)


def own_files(data_files: Mapping[str, int]) -> dict[str, int]:
    """Of a checkpoint's ``data_files``, those it stores itself (not ``../<name>/...``)."""
    return {p: n for p, n in data_files.items() if not p.startswith("../")}


def files_in(data_files: Mapping[str, int], name: str) -> dict[str, int]:
    """Of a checkpoint's ``data_files``, those of the referenced checkpoint ``name``, relative to it."""
    head = f"../{name}/"
    return {p[len(head):]: n for p, n in data_files.items() if p.startswith(head)}


def check_version(version: Any, where: str) -> int:
    """``format_version`` of a ``metadata.json``: one this bytecp reads, else :class:`FormatVersionError`."""
    if type(version) is not int or version > FORMAT_VERSION or version < 1:
        raise FormatVersionError(
            f"{where}: checkpoint format version {version!r} is not supported by this bytecp, "
            f"which reads versions 1..{FORMAT_VERSION}; upgrade bytecp to load it"
        )
    return version


def check_data_file(path: str, where: str, references: Mapping[str, str] | None) -> None:
    """A ``data_files`` name is safe (:func:`check_path`; the common ``data/<save_id>/<name>.bin``
    in one regular expression)."""
    if not _DATA_FILE.fullmatch(path):
        check_path(path, "data", where, references)


def check_references(d: Any, where: str) -> dict[str, str]:
    if d is None:
        return {}
    if not isinstance(d, dict) or any(
        not isinstance(k, str) or not _SEGMENT.fullmatch(k) or k in (".", "..") or not isinstance(v, str)
        or not _SEGMENT.fullmatch(v) for k, v in d.items()
    ):
        raise CorruptCheckpointError(
            f"{where}: metadata.json's references must map checkpoint names of the same run to save ids"
        )
    return dict(d)


def chunks_to_table(chunks: Sequence[ChunkRecord]) -> pa.Table:
    rows = [(c.fqn, c.dtype, list(c.global_shape), list(c.offsets), list(c.lengths), c.file, c.byte_offset,
             c.nbytes, c.crc32c) for c in chunks]  # INDEX_SCHEMA's order
    return pa.table({f.name: [r[i] for r in rows] for i, f in enumerate(INDEX_SCHEMA)}, schema=INDEX_SCHEMA)


def column_values(table: pa.Table, name: str) -> list[Any]:
    """A column as Python values; dictionary-encoded strings stay shared
    (one ``str`` per distinct value, not one per row)."""
    col = table.column(name).combine_chunks()
    if pa.types.is_dictionary(col.type):
        values = col.dictionary.to_pylist()
        return [None if i is None else values[i] for i in col.indices.to_pylist()]
    return col.to_pylist()


def table_to_chunks(table: pa.Table) -> list[ChunkRecord]:
    cols = [column_values(table, f.name) for f in INDEX_SCHEMA]
    return [chunk_record(fqn, dt, tuple(gs), tuple(of), tuple(ln), f, int(bo), int(nb), int(crc))
            for fqn, dt, gs, of, ln, f, bo, nb, crc in zip(*cols, strict=True)]


def write_index(chunks: Sequence[ChunkRecord]) -> bytes:
    sink = io.BytesIO()
    pq.write_table(chunks_to_table(chunks), sink, compression="zstd")
    return sink.getvalue()


def _rank_records(records: dict[int, ObjectRecord]) -> Mapping[int, ObjectRecord]:
    return RankRecords(records, ObjectRecord.from_json)
