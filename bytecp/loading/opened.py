"""A checkpoint opened for reading: the one way every reader reaches a
checkpoint's metadata, its index rows and its data files.

Who calls what, in which order:

1. :func:`open_checkpoint` -- the coordinator of a load (the load pipeline's
   metadata step), and the one process of ``export`` (:mod:`bytecp.interop.export`,
   :mod:`bytecp.interop.hf_export`), ``inspect``/``verify``
   (:mod:`bytecp.tools.inspect`) and ``gc`` (:mod:`bytecp.tools.gc`). It
   reads and validates ``metadata.json`` and nothing else, and decides here,
   once, how rows are found (:attr:`OpenedCheckpoint.index`: the version-1
   whole index or the version-2 segments, behind :class:`RowSource`).
2. :meth:`OpenedCheckpoint.check_sizes` -- the coordinator of a load,
   ``export``, ``inspect``: every size the checkpoint declares is real
   before anything is allocated from it (one listing of the data files,
   kept: :attr:`OpenedCheckpoint.data_sizes`), and the index is within the
   hostile-input budget (:attr:`OpenedCheckpoint.max_rows`).
3. Rows, each checked against the metadata
   (:mod:`bytecp.format.index_check`):

   - :meth:`OpenedCheckpoint.rows_for` -- every rank of a load, with the
     boxes it reads: the rows that may hold them (version 2: only the index
     segments they meet);
   - :meth:`OpenedCheckpoint.all_rows` -- the one-process tools: every row,
     and every tensor tiled exactly.

4. Bytes: a row names a file relative to :attr:`OpenedCheckpoint.storage`
   and a byte range in it; :func:`bytecp.loading.reader.execute_reads` reads
   exactly those ranges.

In a load only the coordinator opens the checkpoint; it broadcasts
:meth:`OpenedCheckpoint.share` (metadata, budget, a version-1 index's rows),
and every other rank rebuilds the object on its own storage with
:meth:`OpenedCheckpoint.received`: no other rank lists or re-reads anything.

Consumers see metadata (names, shapes, dtypes, the state tree), rows
(:class:`~bytecp.format.metadata.ChunkRecord`: a box of a tensor, a file, a
byte range) and the storage those files are read from -- never the index
version or its directory. A foreign source (a directory of safetensors
files) can so present itself through the same interface: its headers as
:class:`~bytecp.format.metadata.Metadata`, a :class:`RowSource` whose rows
name its own files and byte ranges, and every rank reads only its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from bytecp import interop
from bytecp.errors import CorruptCheckpointError, StorageError
from bytecp.format import index_read, limits, parts_read, references
from bytecp.format import metadata as fmt
from bytecp.format.index_check import check_index, check_rows
from bytecp.format.member_text import is_large
from bytecp.loading import diagnose
from bytecp.storage_api import Storage, open_storage
from bytecp.tree.bulk import gc_paused
from bytecp.tree.regions import Region
from bytecp.tree.skeleton import Node

__all__ = ["open_checkpoint", "read_metadata", "OpenedCheckpoint", "RowSource", "Rows", "Shared"]


class Rows(NamedTuple):
    """The rows a rank asked for; how many index files or segments were read
    for them (for the trace); whether they were checked against the metadata
    already (a version-1 index, checked whole when the coordinator read it; a
    version-4 one's, as their segments and pages were decoded)."""

    rows: list[fmt.ChunkRecord]
    files: int
    checked: bool = False


class RowSource(Protocol):
    """How an opened checkpoint's rows are found. A value without storage
    (it travels in a load's metadata broadcast); the opened checkpoint
    passes itself to each call. Rows come back decoded and well formed; the
    opened checkpoint checks them against the metadata."""

    def max_rows(self, md: fmt.Metadata, real: Mapping[str, int | None]) -> int:
        """The most rows the index may hold, given the data files' sizes."""
        ...

    def check_files(self, ck: OpenedCheckpoint) -> None:
        """(before sizes are checked) The index's own files exist with their declared sizes."""
        ...

    def check_budget(self, ck: OpenedCheckpoint) -> None:
        """(after sizes are checked) The index declares at most :meth:`max_rows` rows."""
        ...

    def read_all(self, ck: OpenedCheckpoint, budget: Callable[[], int]) -> Rows:
        """Every row; ``budget()`` gives :meth:`max_rows`, asked only when needed."""
        ...

    def read_for(self, ck: OpenedCheckpoint, wanted: Mapping[str, Sequence[Region]]) -> Rows:
        """The rows that may hold the boxes ``wanted`` (fqn -> boxes)."""
        ...

    def for_ranks(self, ck: OpenedCheckpoint) -> RowSource:
        """(coordinator) What every other rank needs to find its rows."""
        ...


@dataclasses.dataclass(frozen=True)
class _WholeIndex:
    """Version 1: one index file per saving rank, read whole by one process
    (the coordinator of a load reads it and hands every rank all of it)."""

    rows: tuple[fmt.ChunkRecord, ...] | None = None  # set once the coordinator read them

    def max_rows(self, md: fmt.Metadata, real: Mapping[str, int | None]) -> int:
        return limits.max_index_rows(md, real)

    def check_files(self, ck: OpenedCheckpoint) -> None:
        ck.all_rows()  # the files are read whole: a missing or damaged one is named now

    def check_budget(self, ck: OpenedCheckpoint) -> None:
        pass  # each file's rows were held to the budget as it was read

    def read_all(self, ck: OpenedCheckpoint, budget: Callable[[], int]) -> Rows:
        if self.rows is not None:
            return Rows(list(self.rows), 0)
        files = _index_files(ck.storage, ck.metadata)
        return Rows(index_read.read_index(files, where=ck.storage.url, row_budget=budget), len(files))

    def read_for(self, ck: OpenedCheckpoint, wanted: Mapping[str, Sequence[Region]]) -> Rows:
        if self.rows is not None:  # the coordinator's, checked when it read them
            return Rows(list(self.rows), 0, checked=True)
        return Rows(ck.all_rows(), 0, checked=True)

    def for_ranks(self, ck: OpenedCheckpoint) -> RowSource:
        return _WholeIndex(tuple(ck.all_rows()))


def _index_files(storage: Storage, md: fmt.Metadata) -> list[tuple[str, bytes]]:
    blobs = []
    for f in md.index_files:
        try:
            blobs.append((f, storage.read_bytes(f)))
        except FileNotFoundError as e:
            raise CorruptCheckpointError(
                f"{storage.url}: index file {f} named in metadata.json is missing ({e})"
            ) from e
    return blobs


@dataclasses.dataclass(frozen=True)
class _Segments:
    """Version 2: one index file of segments; a rank reads only those its boxes meet."""

    budget: int | None = None  # the coordinator's max_rows, for the other ranks

    def max_rows(self, md: fmt.Metadata, real: Mapping[str, int | None]) -> int:
        return index_read.max_rows(md, real)

    def check_files(self, ck: OpenedCheckpoint) -> None:
        limits.check_index_file(ck.storage, ck.metadata)  # before any buffer is sized from the directory

    def check_budget(self, ck: OpenedCheckpoint) -> None:
        index_read.check_budget(ck.storage, ck.metadata, ck.max_rows)

    def read_all(self, ck: OpenedCheckpoint, budget: Callable[[], int]) -> Rows:
        self.check_files(ck)
        md = ck.metadata
        return Rows(index_read.read_segments(ck.storage, md, index_read.all_segments(md), budget=budget()), 1)

    def read_for(self, ck: OpenedCheckpoint, wanted: Mapping[str, Sequence[Region]]) -> Rows:
        md = ck.metadata
        segments = index_read.wanted_segments(md, wanted)
        budget = self.budget if self.budget is not None else ck.max_rows
        return Rows(index_read.read_segments(ck.storage, md, segments, fqns=set(wanted), budget=budget), len(segments))

    def for_ranks(self, ck: OpenedCheckpoint) -> RowSource:
        return _Segments(ck.max_rows)


class _Parts(_Segments):
    """Version 4: one index part per saving rank and a directory of their
    segments; a rank reads the directory pages, then the segments, its boxes meet."""

    def max_rows(self, md: fmt.Metadata, real: Mapping[str, int | None]) -> int:
        return limits.max_index_rows(md, real)  # each chunk is listed once

    def check_budget(self, ck: OpenedCheckpoint) -> None:
        pass  # the rows are counted in the entries a rank reads (parts_read.read_parts)

    def read_all(self, ck: OpenedCheckpoint, budget: Callable[[], int]) -> Rows:
        self.check_files(ck)
        return Rows(*parts_read.read_parts(ck.storage, ck.metadata, None, budget=budget()), checked=True)

    def read_for(self, ck: OpenedCheckpoint, wanted: Mapping[str, Sequence[Region]]) -> Rows:
        budget = self.budget if self.budget is not None else ck.max_rows
        return Rows(*parts_read.read_parts(ck.storage, ck.metadata, wanted, budget=budget), checked=True)

    def for_ranks(self, ck: OpenedCheckpoint) -> RowSource:
        return _Parts(ck.max_rows)


@dataclasses.dataclass(frozen=True)
class _ForeignRows:
    """A foreign source (a Hugging Face directory, :mod:`bytecp.interop.safetensors_dir`):
    one whole-tensor row per tensor, from the headers the coordinator read
    and checked; they travel whole in the metadata broadcast (one row per
    tensor), so no other rank reads a header. ``exact``: the source's names
    are the state's (DCP, :func:`bytecp.interop.exact_names`), matched exactly
    and never cast; else they are matched as transformers matches them."""

    rows: tuple[fmt.ChunkRecord, ...]
    exact: bool = False
    #: the source's name in :data:`bytecp.interop.SOURCES` (what ``bytecp inspect`` and ``verify`` say it is)
    source: str = "huggingface"

    def max_rows(self, md: fmt.Metadata, real: Mapping[str, int | None]) -> int:
        return len(self.rows)

    def check_files(self, ck: OpenedCheckpoint) -> None:
        pass  # every file's size was read with its header

    def check_budget(self, ck: OpenedCheckpoint) -> None:
        pass

    def read_all(self, ck: OpenedCheckpoint, budget: Callable[[], int]) -> Rows:
        return Rows(list(self.rows), 0)

    def read_for(self, ck: OpenedCheckpoint, wanted: Mapping[str, Sequence[Region]]) -> Rows:
        return Rows([r for r in self.rows if r.fqn in wanted], 0)

    def for_ranks(self, ck: OpenedCheckpoint) -> RowSource:
        return self


@dataclasses.dataclass
class _Found:
    """What reading has established so far (filled lazily, at most once each)."""

    real: dict[str, int | None] | None = None
    listed: dict[str, int] | None = None
    max_rows: int | None = None
    rows: list[fmt.ChunkRecord] | None = None
    files: int = 1  # files read: metadata.json, then the whole index's files
    #: metadata.json as read (a large state's: sent in the load's broadcast, :class:`Shared`)
    raw: bytes | None = None


@dataclasses.dataclass(frozen=True)
class Shared:
    """(load: coordinator -> every rank, in the metadata broadcast) An opened checkpoint without its storage;
    a large state's metadata as the text it was read from (``raw``), parsed by each rank (a 131,072-rank
    MoE's pickled: 33 MB, 0.9 s and 167 MB to unpickle; its text: 29 MB, 0.6 s and 96 MB to parse)."""

    metadata: fmt.Metadata
    index: RowSource
    raw: bytes | None = None
    where: str = ""

    def __getstate__(self) -> dict[str, Any]:
        if self.raw is None:
            return dict(self.__dict__)
        return {"raw": self.raw, "where": self.where, "index": self.index}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "metadata" not in state:
            state = {**state, "metadata": fmt.Metadata.from_bytes(state["raw"], state["where"]), "raw": None}
        for k, v in state.items():
            object.__setattr__(self, k, v)


@dataclasses.dataclass(frozen=True)
class OpenedCheckpoint:
    """A checkpoint opened for reading (see the module's docstring for the call order)."""

    storage: Storage
    metadata: fmt.Metadata
    #: how rows are found: decided once, by :func:`open_checkpoint`
    index: RowSource
    _found: _Found = dataclasses.field(default_factory=_Found, repr=False, compare=False)

    @property
    def format_version(self) -> int:
        return self.metadata.format_version

    @property
    def foreign(self) -> bool:
        """Whether this is a foreign source (a Hugging Face directory): its
        names are matched as transformers matches them, its dtypes may be
        cast, its rows carry no checksums."""
        return isinstance(self.index, _ForeignRows)

    @property
    def source_format(self) -> str:
        """``"bytecp"``, or the name of the foreign source read (:data:`bytecp.interop.SOURCES`)."""
        return self.index.source if isinstance(self.index, _ForeignRows) else "bytecp"

    @property
    def transformers_names(self) -> bool:
        """Whether this is a foreign source whose names are matched as
        transformers matches them and whose dtypes may be cast (a Hugging Face
        directory; not a DCP checkpoint, whose names are the state's)."""
        return isinstance(self.index, _ForeignRows) and not self.index.exact

    def renamed(self, names: Mapping[str, str], aliases: Mapping[str, str]) -> OpenedCheckpoint:
        """(every rank of a foreign load, after matching names) The same
        source with tensors renamed (stored name -> the target's name) and
        target names reading a renamed tensor too (:mod:`bytecp.interop.hf_names`)."""
        md = self.metadata
        new = {names.get(k, k): v for k, v in md.tensors.items()}
        skeleton = Node.container("dict", [(k, Node.leaf("tensor", k)) for k in new])
        rows = tuple(dataclasses.replace(r, fqn=names.get(r.fqn, r.fqn)) for r in self.index.read_all(self, int).rows)
        return OpenedCheckpoint(self.storage, dataclasses.replace(md, tensors=new, skeleton=skeleton, aliases=dict(aliases)),
                                _ForeignRows(rows, source=self.source_format), _Found(real=dict(md.data_files)))

    @property
    def data_sizes(self) -> Mapping[str, int | None]:
        """The real size of every data file the metadata lists (None: missing),
        from one listing of ``data/`` made the first time it is asked for."""
        f = self._found
        if f.real is None:
            f.real = limits.real_data_sizes(self.storage, self.metadata, self._listing())
        return f.real

    def _listing(self) -> dict[str, int]:
        f = self._found
        if f.listed is None:
            f.listed = self.storage.file_sizes("data")
        return f.listed

    def stored_files(self) -> dict[str, int]:
        """(``gc``) Every file stored under ``data/`` and ``index/``, with its size."""
        return {**self._listing(), **self.storage.file_sizes("index")}

    @property
    def max_rows(self) -> int:
        """The hostile-input budget: the most index rows the real data files can hold."""
        f = self._found
        if f.max_rows is None:
            f.max_rows = self.index.max_rows(self.metadata, self.data_sizes)
        return f.max_rows

    def check_sizes(self) -> None:
        """(coordinator of a load; export; inspect) Every declared size is
        real, and the index within :attr:`max_rows`, before anything is
        allocated from them. The tensors a bad file holds are named from the
        rows (read already, else read only for the error)."""
        self.index.check_files(self)  # before the index names tensors in errors
        rows = self._found.rows
        limits.check_sizes(self.storage, self.metadata, rows if rows is not None else self._rows_by_declared_sizes,
                           self.data_sizes)
        self.index.check_budget(self)

    def _rows_by_declared_sizes(self) -> list[fmt.ChunkRecord]:
        """Every row, budgeted by the declared sizes (the real ones are what is wrong)."""
        got = self.index.read_all(self, lambda: self.index.max_rows(self.metadata, self.metadata.data_files))
        check_index(self.storage.url, self.metadata, got.rows, checked=got.checked)
        return got.rows

    def all_rows(self) -> list[fmt.ChunkRecord]:
        """(one-process tools; a version-1 load's coordinator) Every row,
        checked against the metadata, every tensor tiled exactly; read once."""
        f = self._found
        if f.rows is None:
            with gc_paused():  # (a row object or more per chunk: collections of the whole heap otherwise)
                got = self.index.read_all(self, lambda: self.max_rows)
                check_index(self.storage.url, self.metadata, got.rows, checked=got.checked)
            f.rows, f.files = got.rows, f.files + got.files
        return f.rows

    @property
    def files_read(self) -> int:
        """Files this object has read so far: ``metadata.json`` and the whole
        index, if it was read (:meth:`rows_for` reports its own)."""
        return self._found.files

    def rows_for(self, wanted: Mapping[str, Sequence[Region]]) -> Rows:
        """(every rank of a load) The rows that may hold the boxes ``wanted``
        (fqn -> boxes), each checked against the metadata."""
        got = self.index.read_for(self, wanted)
        if not got.checked:
            check_rows(self.storage.url, self.metadata, got.rows)
        return got

    def share(self) -> Shared:
        """(coordinator of a load) What the other ranks receive in the metadata broadcast."""
        return Shared(self.metadata, self.index.for_ranks(self), self._found.raw, self.storage.url)

    @classmethod
    def received(cls, storage: Storage, shared: Shared) -> OpenedCheckpoint:
        """(every rank of a load) The coordinator's opened checkpoint, on this rank's storage."""
        return cls(references.linked(storage, shared.metadata), shared.metadata, shared.index)


def read_metadata(storage: Storage) -> fmt.Metadata:
    """Read and validate ``metadata.json``; a typed error naming what the URL
    is instead when there is none (:mod:`bytecp.loading.diagnose`)."""
    got = _read_metadata(storage, foreign=False, source_format=None)
    assert isinstance(got, tuple)
    return got[0]


def _read_metadata(storage: Storage, *, foreign: bool, source_format: str | None,
                   ) -> tuple[fmt.Metadata, bytes] | OpenedCheckpoint:
    forced = interop.find_source(storage, source_format) if source_format is not None else None
    if forced is not None:  # format= names a source: read as that, whatever else is there
        return _foreign(storage, forced)
    try:
        data = fmt.read_metadata(storage)
    except (FileNotFoundError, StorageError) as e:
        detect = foreign and source_format is None and isinstance(e, FileNotFoundError)
        source = interop.find_source(storage) if detect else None
        if source is not None:
            return _foreign(storage, source)
        # a file, a run directory, an interrupted save, nothing: say which
        diagnose.raise_not_a_checkpoint(storage, e)
    if foreign and source_format is None and len(data) <= 1 << 16 and not fmt.names_bytecp(data):  # torch_dist's
        source = interop.find_source(storage)
        if source is not None:
            return _foreign(storage, source)
    return fmt.Metadata.from_bytes(data, storage.url), data


def _foreign(storage: Storage, source: str) -> OpenedCheckpoint:
    """The checkpoint of source format ``source`` at ``storage``, opened (:data:`bytecp.interop.SOURCES`)."""
    md, rows = interop.read_source(storage, source)
    return OpenedCheckpoint(storage, md, _ForeignRows(tuple(rows), interop.exact_names(source), source),
                            _Found(real=dict(md.data_files)))


def open_checkpoint(src: str | Storage, *, foreign: bool = False, format: str | None = None) -> OpenedCheckpoint:
    """Open ``src`` (a storage, or a URL opened with no options) for reading:
    its validated metadata, and how its rows are found (decided here, once).
    ``foreign`` (the load pipeline): a directory with no ``metadata.json`` but
    a checkpoint of another format :data:`bytecp.interop.SOURCES` reads (a
    transformers directory: :mod:`bytecp.interop.safetensors_dir`) opens as
    a foreign source: the load pipeline and the one-process tools over
    sources (export, inspect, verify) pass it; ``gc`` never does (a source's
    files are never bytecp's to remove). ``format`` (``LoadOptions.format``):
    ``"bytecp"`` reads ``metadata.json`` only, a source's name reads that source."""
    storage = src if isinstance(src, Storage) else open_storage(src)
    got = _read_metadata(storage, foreign=foreign, source_format=format)
    if isinstance(got, OpenedCheckpoint):
        return got
    md, raw = got
    if md.references:  # version 3: rows may name files of other checkpoints of the run
        references.check_references(storage, md)
        storage = references.linked(storage, md)
    index: RowSource = _WholeIndex() if md.index is None else \
        _Parts() if isinstance(md.index, fmt.PartsDirectory) else _Segments()
    return OpenedCheckpoint(storage, md, index, _Found(raw=raw if is_large(md) else None))
