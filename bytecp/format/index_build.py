"""The coordinator builds the version-2 index at commit: every rank's chunk
records, checked and sorted into band and wide segments.

Called by the save pipeline's commit (coordinator only) with the
:class:`~bytecp.format.chunk_batch.ChunkBatch` of every rank. Everything is done on
NumPy columns, never one Python object per chunk: a million chunks are
checked and laid out in about a second. The checks are the ones a
checkpoint must pass before it may be committed:

- every chunk names a tensor of the state, with as many dimensions, inside
  its shape, with the bytes its box needs, inside a data file;
- the chunks of every tensor tile it exactly (their elements add up to the
  tensor's and no two overlap), so a load never finds a gap or two answers.

Then each tensor gets its band dimension (the one its chunks split most),
the index its number of bands, and the segments are encoded as Parquet (in
threads: pyarrow releases the GIL). docs/FORMAT.md section 5 is the spec.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bytecp.errors import ConfigError
from bytecp.format.checksum import crc32c
from bytecp.format.chunk_batch import ChunkBatch, fqn_hash
from bytecp.format.index_schema import (
    INDEX_SCHEMA_V2,
    MAX_BUCKETS,
    MAX_SPAN,
    ROWS_PER_BUCKET,
    WIDE_ROWS,
    IndexDirectory,
)
from bytecp.format.tensor_table import TensorTable
from bytecp.plan.planner import contiguous_boxes, find_overlap
from bytecp.tree.dtypes import SUPPORTED_DTYPES
from bytecp.tree.regions import Region

__all__ = ["BuiltIndex", "build_index", "check_chunks", "rows_table", "encode_segment"]


@dataclasses.dataclass
class BuiltIndex:
    """What the commit writes: the segments (in file order) and their directory."""

    blobs: list[bytes]
    directory: IndexDirectory
    #: fqn -> band dimension, for the banded tensors
    band_dims: dict[str, int]


@dataclasses.dataclass(frozen=True, eq=False)
class _Specs:
    """The tensors' names and shapes as the checks need them, in name order.

    Made per check from a plain mapping; for a
    :class:`~bytecp.format.tensor_table.TensorTable` once, in its memo (the
    tables of a state whose structure has not changed are shared between
    its saves: the union's at the coordinator, a kept description's on
    every rank), which saves a save of tens of thousands of tensors as many
    look-ups and name hashes on every check (:func:`specs_of`)."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    #: the names' hashes, sorted, and the order that sorts them
    sorted_h: np.ndarray
    order: np.ndarray
    #: ``D`` (most dimensions of any tensor, at least 1), the shapes padded with 1 to it, the dimensions
    D: int
    shape: np.ndarray
    ndim: np.ndarray
    itemsize: np.ndarray
    numel: np.ndarray
    #: each tensor's row-major strides, padded like ``shape``
    strides: np.ndarray

    @classmethod
    def make(cls, tensors: Mapping[str, Mapping[str, Any]]) -> _Specs:
        names = sorted(tensors)
        specs = [tensors[n] for n in names]
        shapes = [tuple(int(x) for x in sp["shape"]) for sp in specs]
        table = np.fromiter((fqn_hash(f) for f in names), np.uint64, len(names))
        order = np.argsort(table, kind="stable")
        sorted_h = table[order]
        if len(sorted_h) > 1 and bool((sorted_h[1:] == sorted_h[:-1]).any()):
            i = int(np.flatnonzero(sorted_h[1:] == sorted_h[:-1])[0])
            raise ConfigError(f"tensor names {names[order[i]]!r} and {names[order[i + 1]]!r} collide in the "
                              "commit's 64-bit name hash; rename one of them")
        D = max([1, *(len(s) for s in shapes)])
        shape = np.ones((len(names), D), np.int64)
        ndim = np.zeros(len(names), np.int64)
        for i, sh in enumerate(shapes):
            shape[i, : len(sh)] = sh
            ndim[i] = len(sh)
        itemsize = np.asarray([SUPPORTED_DTYPES[sp["dtype"]].itemsize for sp in specs] or [0], np.int64)
        numel = np.asarray([math.prod(sh) for sh in shapes] or [0], np.int64)
        strides = np.ones_like(shape)
        for d in range(D - 2, -1, -1):
            strides[:, d] = strides[:, d + 1] * shape[:, d + 1]
        return cls(names, shapes, sorted_h, order, D, shape, ndim, itemsize, numel, strides)


def specs_of(tensors: Mapping[str, Mapping[str, Any]]) -> _Specs:
    """(the commit's checks) ``tensors`` as :class:`_Specs`; a table's made once."""
    if not isinstance(tensors, TensorTable):
        return _Specs.make(tensors)
    got = tensors.memo.get("index_build")
    if got is None:
        got = tensors.memo["index_build"] = _Specs.make(tensors)
    return cast(_Specs, got)


class _Rows:
    """Every rank's chunks as padded columns (``D`` = most dimensions of any tensor)."""

    def __init__(self, batches: Sequence[ChunkBatch], specs: _Specs, ranks: Sequence[int] | None = None) -> None:
        counts = [len(b) for b in batches]
        n = sum(counts)
        who = np.arange(len(batches), dtype=np.int32) if ranks is None else np.asarray(ranks, np.int32)
        self.rank = np.repeat(who, counts)

        def cat(attr: str, dt: Any) -> np.ndarray:
            parts = [getattr(b, attr) for b in batches]
            return np.concatenate(parts).astype(dt, copy=False) if parts else np.zeros(0, dt)

        hashes = cat("fqn_hash", np.uint64)
        self.ndim = cat("ndim", np.int64)
        self.byte_offset = cat("byte_offset", np.int64)
        self.nbytes = cat("nbytes", np.int64)
        self.crc = cat("crc32c", np.uint32)
        self.src = np.arange(n, dtype=np.int64)  # each row's position in the batches (their block checksums)
        self.files: list[str] = []
        ids: dict[str, int] = {}
        per_rank = [np.asarray([ids.setdefault(f, len(ids)) for f in b.files] or [0], np.int32)[b.file] for b in batches]
        self.files = list(ids)
        self.file = np.concatenate(per_rank) if per_rank else np.zeros(0, np.int32)
        # tensor ids by hash
        sorted_h = specs.sorted_h
        pos = np.minimum(np.searchsorted(sorted_h, hashes), max(0, len(sorted_h) - 1))
        known = sorted_h[pos] == hashes if len(sorted_h) else np.zeros(n, bool)
        if not bool(known.all()):
            r = int(self.rank[np.flatnonzero(~known)[0]])
            raise ConfigError(f"rank {r} wrote chunks of a tensor missing from the state every rank described")
        self.fid = specs.order[pos].astype(np.int64)
        #: the tensors' names (``fid`` numbers them), ``D``, their padded shapes and strides (shared: never written)
        self.names = specs.names
        self.D = specs.D
        self.shape, self.strides = specs.shape, specs.strides
        wrong = self.ndim != specs.ndim[self.fid]
        if bool(wrong.any()):
            i = int(np.flatnonzero(wrong)[0])
            raise ConfigError(f"tensor {specs.names[self.fid[i]]!r}: rank {self.rank[i]} wrote a {self.ndim[i]}-d "
                              f"chunk of a tensor of shape {list(specs.shapes[self.fid[i]])}")
        mask = np.arange(self.D)[None, :] < self.ndim[:, None]
        self.O = np.zeros((n, self.D), np.int64)
        self.L = np.ones((n, self.D), np.int64)
        self.O[mask] = cat("offsets", np.int64)
        self.L[mask] = cat("lengths", np.int64)
        self.mask = mask
        # each chunk's first element, as a row-major index into its tensor
        self.lin = (self.O * self.strides[self.fid]).sum(axis=1)

    def take(self, keep: np.ndarray) -> None:
        for k in ("rank", "ndim", "byte_offset", "nbytes", "crc", "file", "fid", "O", "L", "mask", "lin", "src"):
            setattr(self, k, getattr(self, k)[keep])


def build_index(
    batches: Sequence[ChunkBatch],
    tensors: Mapping[str, Mapping[str, Any]],
    data_files: Mapping[str, int],
    save_id: str,
    *,
    threads: int = 4,
) -> BuiltIndex:
    """(coordinator, at commit) Check every rank's chunks and lay out the
    index. Raises :class:`ConfigError` naming the tensor, the rank and the
    region at fault when the ranks' chunks do not make up the tensors."""
    specs = specs_of(tensors)
    rows = _Rows(batches, specs)
    _check_boxes(rows, specs, data_files)
    rows.take(rows.L.prod(axis=1) > 0)  # empty chunks hold nothing anyone reads
    _check_tiling(rows, specs)
    band = _band_dims(rows, len(specs.names))
    return _layout(rows, specs.names, specs.shapes, band, save_id, threads)


def _check_boxes(rows: _Rows, specs: _Specs, data_files: Mapping[str, int]) -> None:
    names, shapes = specs.names, specs.shapes
    S = rows.shape[rows.fid]
    outside = ((rows.O < 0) | (rows.L < 0) | (rows.O + rows.L > S)).any(axis=1)
    if bool(outside.any()):
        i = int(np.flatnonzero(outside)[0])
        raise ConfigError(f"tensor {names[rows.fid[i]]!r}: rank {rows.rank[i]} wrote region "
                          f"{_region(rows, i)} outside its shape {list(shapes[rows.fid[i]])}")
    numel = rows.L.prod(axis=1)
    wrong = rows.nbytes != numel * specs.itemsize[rows.fid]
    if bool(wrong.any()):
        i = int(np.flatnonzero(wrong)[0])
        raise ConfigError(f"tensor {names[rows.fid[i]]!r}: rank {rows.rank[i]} recorded {rows.nbytes[i]} bytes "
                          f"for region {_region(rows, i)}")
    fsize = np.asarray([data_files.get(f, -1) for f in rows.files] or [0], np.int64)
    past = (rows.byte_offset < 0) | (rows.byte_offset + rows.nbytes > fsize[rows.file])
    if bool(past.any()):
        i = int(np.flatnonzero(past)[0])
        raise ConfigError(f"rank {rows.rank[i]}: chunk of tensor {names[rows.fid[i]]!r} lies outside data file "
                          f"{rows.files[rows.file[i]]}")


def _region(rows: _Rows, i: int) -> Region:
    nd = int(rows.ndim[i])
    return Region(tuple(int(x) for x in rows.O[i, :nd]), tuple(int(x) for x in rows.L[i, :nd]))


def check_chunks(
    batches: Sequence[ChunkBatch],
    tensors: Mapping[str, Mapping[str, Any]],
    data_files: Mapping[str, int],
    *,
    ranks: Sequence[int] | None = None,
    whole: bool = True,
) -> _Rows:
    """The checks a checkpoint must pass before it may be committed (module
    docstring): on every rank's chunks at the coordinator (``whole``: they
    must tile every tensor exactly), or on one rank's before it writes its
    index part (``whole=False``: no two of them overlap). ``ranks``: the
    rank of each batch, for the errors. -> the rows, empty chunks dropped."""
    specs = specs_of(tensors)
    rows = _Rows(batches, specs, ranks)
    _check_boxes(rows, specs, data_files)
    rows.take(rows.L.prod(axis=1) > 0)  # empty chunks hold nothing anyone reads
    _check_tiling(rows, specs, counts=whole)
    return rows


def _check_tiling(rows: _Rows, specs: _Specs, *, counts: bool = True) -> None:
    """Elements add up per tensor (``counts``), and no two chunks overlap: exact tiling."""
    names, shapes = specs.names, specs.shapes
    nf = len(names)
    numel = rows.L.prod(axis=1)
    held = np.zeros(nf, np.int64)
    np.add.at(held, rows.fid, numel)
    for i in np.flatnonzero(held != specs.numel[:nf]) if counts else []:
        raise ConfigError(f"tensor {names[i]!r} of shape {list(shapes[i])}: the ranks' shards hold "
                          f"{int(held[i])} of its {math.prod(shapes[i])} elements")
    if not len(numel):
        return
    # chunks contiguous in row-major order (row slabs, flat-range pieces,
    # whole tensors) are checked as 1-d ranges, the others as boxes
    contiguous = contiguous_boxes(rows.O, rows.L, rows.shape[rows.fid])
    boxy = np.zeros(nf, bool)
    boxy[rows.fid[~contiguous]] = True
    lin = np.flatnonzero(~boxy[rows.fid])
    if len(lin):
        # one key orders by tensor, then by start: each tensor's elements
        # numbered after the previous tensors'
        base = np.concatenate([[0], np.cumsum(rows.shape.prod(axis=1))[:-1]])
        start = base[rows.fid[lin]] + rows.lin[lin]
        order = np.argsort(start, kind="stable")
        s_, n_, f_ = start[order], numel[lin][order], rows.fid[lin][order]
        clash = (f_[1:] == f_[:-1]) & (s_[1:] < s_[:-1] + n_[:-1])
        if bool(clash.any()):
            j = int(np.flatnonzero(clash)[0])
            _overlap(rows, names, lin[order[j]], lin[order[j + 1]])
    for f in np.flatnonzero(boxy):
        ids = np.flatnonzero(rows.fid == f)
        boxes = [_region(rows, int(i)) for i in ids]
        pair = find_overlap(boxes, dim=int(np.argmax((rows.O[ids] > 0).sum(axis=0))))
        if pair is not None:
            raise ConfigError(f"tensor {names[f]!r} of shape {list(shapes[f])}: shards {pair[0]} and {pair[1]} overlap")


def _overlap(rows: _Rows, names: list[str], a: int, b: int) -> None:
    raise ConfigError(f"tensor {names[rows.fid[a]]!r}: shards {_region(rows, a)} (rank {rows.rank[a]}) and "
                      f"{_region(rows, b)} (rank {rows.rank[b]}) overlap")


def _band_dims(rows: _Rows, nf: int) -> np.ndarray:
    """Per tensor, the dimension most of its chunks start inside of (ties: the first)."""
    split = np.zeros((nf, rows.D), np.int64)
    for d in range(rows.D):
        np.add.at(split[:, d], rows.fid, (rows.O[:, d] > 0).astype(np.int64))
    return np.argmax(split, axis=1)


def _layout(rows: _Rows, names: list[str], shapes: list[tuple[int, ...]], band: np.ndarray,
            save_id: str, threads: int) -> BuiltIndex:
    n = len(rows.fid)
    nf = len(names)
    buckets = int(min(MAX_BUCKETS, max(1, -(-n // ROWS_PER_BUCKET))))
    d = band[rows.fid]
    ar = np.arange(n)
    o, ln = rows.O[ar, d], rows.L[ar, d]
    size = rows.shape[rows.fid, d]
    lo = o * buckets // size
    hi = (o + ln - 1) * buckets // size
    span = hi - lo + 1
    widest = np.zeros(nf, np.int64)
    np.maximum.at(widest, rows.fid, span)
    # wide: 0-d tensors, a chunk over too many bands, and tensors without
    # chunks (no elements: nobody reads them)
    wide_t = (widest > MAX_SPAN) | (widest == 0) | (np.asarray([len(s) for s in shapes] or [0], np.int64)[:nf] == 0)
    is_wide = wide_t[rows.fid]
    # band segments: each chunk in every band it meets
    bi = np.flatnonzero(~is_wide)
    rep = np.repeat(bi, span[bi])
    first = np.repeat(np.cumsum(span[bi]) - span[bi], span[bi])
    bucket = np.repeat(lo[bi], span[bi]) + (np.arange(len(rep)) - first)
    order = np.lexsort((rows.lin[rep], bucket * nf + rows.fid[rep]))
    rep, bucket = rep[order], bucket[order]
    cuts = np.flatnonzero(np.diff(bucket)) + 1
    band_groups = [(int(bucket[s]), g) for s, g in zip(np.concatenate([[0], cuts]).astype(int), np.split(rep, cuts), strict=True) if len(g)]
    # wide segments: by name, WIDE_ROWS at a time
    wi = np.flatnonzero(is_wide)
    wi = wi[np.lexsort((rows.lin[wi], rows.fid[wi]))]
    wide_groups = [wi[s : s + WIDE_ROWS] for s in range(0, len(wi), WIDE_ROWS)]

    # one table of every row in file order; each segment is a slice of it
    order = np.concatenate([rep, *wide_groups]) if len(rep) or wide_groups else np.zeros(0, np.int64)
    table = rows_table(rows, names, order)
    bounds = np.cumsum([0, *(len(g) for _, g in band_groups), *(len(g) for g in wide_groups)])
    slices = [(int(a), int(b - a)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    if len(slices) < 64 or threads <= 1:  # small indexes: no threads (nothing to gain)
        blobs = [encode_segment(table.slice(*sl)) for sl in slices]
    else:
        with concurrent.futures.ThreadPoolExecutor(threads, "bytecp-index") as ex:
            blobs = list(ex.map(lambda sl: encode_segment(table.slice(*sl)), slices))
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in blobs])]).astype(int).tolist()
    crcs = [crc32c(b) for b in blobs]
    nb = len(band_groups)
    directory = IndexDirectory(
        file=f"index/{save_id}/index.bin",
        nbytes=int(offsets[-1]),
        buckets=buckets,
        band={"bucket": [b for b, _ in band_groups], "offset": offsets[:nb],
              "nbytes": [len(b) for b in blobs[:nb]], "rows": [len(g) for _, g in band_groups],
              "crc32c": crcs[:nb]},
        wide={"first": [names[rows.fid[g[0]]] for g in wide_groups], "last": [names[rows.fid[g[-1]]] for g in wide_groups],
              "offset": offsets[nb:-1], "nbytes": [len(b) for b in blobs[nb:]],
              "rows": [len(g) for g in wide_groups], "crc32c": crcs[nb:]},
    )
    band_dims = {names[f]: int(band[f]) for f in range(nf) if not wide_t[f]}
    return BuiltIndex(blobs, directory, band_dims)


def rows_table(rows: _Rows, names: list[str], idx: np.ndarray, schema: pa.Schema = INDEX_SCHEMA_V2) -> pa.Table:
    """The rows ``idx`` (in this order) as one Arrow table of the index schema."""
    nd = rows.ndim[idx]
    ptr = pa.array(np.concatenate([[0], np.cumsum(nd)]).astype(np.int64))
    mask = rows.mask[idx]
    return pa.table(
        [
            pa.DictionaryArray.from_arrays(pa.array(rows.fid[idx].astype(np.int32)), pa.array(names)).cast(pa.string()),
            pa.LargeListArray.from_arrays(ptr, pa.array(rows.O[idx][mask])).cast(pa.list_(pa.int64())),
            pa.LargeListArray.from_arrays(ptr, pa.array(rows.L[idx][mask])).cast(pa.list_(pa.int64())),
            pa.DictionaryArray.from_arrays(pa.array(rows.file[idx]), pa.array(rows.files, pa.string())).cast(pa.string()),
            pa.array(rows.byte_offset[idx]),
            pa.array(rows.nbytes[idx]),
            pa.array(rows.crc[idx]),
        ],
        schema=schema,
    )


def encode_segment(table: pa.Table) -> bytes:
    """One segment or page: a complete Parquet file (strings dictionary-encoded by the writer)."""
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd", write_statistics=False)  # the directory says what is where
    return sink.getvalue()
