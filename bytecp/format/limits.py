"""The hostile-input budget: checks on every size a checkpoint declares,
made before anything is allocated from it.

A checkpoint is data someone else may have written. Its ``metadata.json``
and index say how large tensors, chunks, blobs and files are; a reader that
believed them could be made to allocate terabytes from a few kilobytes, or
to recurse until the interpreter gives up. These functions turn every such
claim into either a checked fact or a :class:`~bytecp.errors.CorruptCheckpointError`
that names the file and the entry at fault. The budget they enforce:

- ``metadata.json`` itself: at most :func:`max_metadata_bytes` (1 GiB unless
  ``BYTECP_MAX_METADATA_BYTES`` says otherwise), checked from its size before
  it is read (:func:`bytecp.format.metadata.read_metadata`);
- structure: a skeleton at most :data:`MAX_SKELETON_DEPTH` deep, tensors of
  at most :data:`MAX_NDIM` dimensions with non-negative integer sizes and a
  known dtype, object records with non-negative offsets and sizes;
- sizes: every data file's declared size equals its real size on storage;
  every chunk and blob lies inside its file; the tensors' total bytes do not
  exceed the data files' total (each element is stored at least once);
- the index: at most ``FIXED_ROWS`` rows plus one per 4096-byte block of real
  data (chunks are 4096-aligned, FORMAT.md 4.2) plus the empty chunks that
  zero-element tensors may have, at most :data:`MAX_NDIM` values per row in
  each column and column data that decodes to at most
  ``MAX_INDEX_EXPANSION`` times the file's size (plus ``FIXED_BYTES``), both
  from the footer before anything is decoded (pages whose headers contradict
  the footer are not checked before decoding -- a known limit);
- blobs: a ``torch.save`` zip whose entries are stored uncompressed and
  together no larger than the blob, so the (restricted) loader never
  inflates anything.

So reading a checkpoint allocates at most a small multiple of its real
size plus a fixed allowance, and deep nesting fails as a typed error.

Who calls what: :meth:`bytecp.format.metadata.Metadata.validate` calls
:func:`check_structure` (every reader, on every ``metadata.json``);
:func:`bytecp.format.index_check.decode_table` calls :func:`check_index_metadata` before
decoding an index file (a Parquet one: version-4 part segments are flat words that
:func:`bytecp.format.segment_wire.decode` checks against their length first); the load path and ``inspect`` call
:func:`check_sizes` (coordinator) before any tensor is allocated; the object
reader and ``verify`` call :func:`check_blob` before a blob is unpickled.
"""

from __future__ import annotations

import io
import math
import os
import zipfile
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from bytecp.errors import ConfigError, CorruptCheckpointError, PickleNotAllowedError
from bytecp.format.parquet_footer import footer_row_groups
from bytecp.format.tensor_table import MAX_NDIM as _MAX_NDIM
from bytecp.format.tensor_table import TensorTable
from bytecp.tree.dtype_names import ITEMSIZES
from bytecp.tree.skeleton import MAX_DEPTH

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow.parquet as pq

    from bytecp.format.metadata import ChunkRecord, Metadata
    from bytecp.storage_api import Storage

__all__ = [
    "MAX_SKELETON_DEPTH",
    "MAX_NDIM",
    "FIXED_ROWS",
    "FIXED_BYTES",
    "MAX_INDEX_EXPANSION",
    "max_metadata_bytes",
    "check_metadata_size",
    "check_structure",
    "check_sizes",
    "real_data_sizes",
    "max_index_rows",
    "check_index_file",
    "check_index_metadata",
    "check_chunk_records",
    "check_blob",
    "load_blob",
]

#: deepest nesting of the state tree a checkpoint may have (real ones: < 20)
MAX_SKELETON_DEPTH = MAX_DEPTH  # enforced while the skeleton is parsed (bytecp.tree.skeleton)
#: most dimensions a tensor may have (torch's own limit is 25 for most ops; the tensor table checks it)
MAX_NDIM = _MAX_NDIM
#: most ranks a checkpoint may say saved it
MAX_WORLD_SIZE = 1 << 20
#: index rows every checkpoint may have, whatever its data size
FIXED_ROWS = 1 << 16
#: bytes of decoded index data every checkpoint may have, whatever its size
FIXED_BYTES = 64 << 20
#: decoded index data per byte of index file (Parquet with zstd on real indexes: < 20)
MAX_INDEX_EXPANSION = 256
#: the largest ``metadata.json`` read by default (``BYTECP_MAX_METADATA_BYTES`` sets another): the
#: scale benchmark's DeepSeek-V3-like MoE at 131,072 ranks, 181,580 tensors, writes 29 MB
MAX_METADATA_BYTES = 1 << 30
#: the blocks chunks are aligned to (FORMAT.md 4.2)
_ALIGN = 4096
_KEY_TYPES = (str, int, bool, type(None))


def damaged(url: str) -> str:
    """What to do about a checkpoint at ``url`` whose files are not what its commit recorded (the end of those errors)."""
    if url.startswith("keeper://"):  # the memory tier: a keeper lost or evicted them
        return ("; the memory tier no longer holds all of it (a keeper lost or evicted it): load the storage "
                "tier's copy or an earlier checkpoint (CheckpointManager.restore falls back to them)")
    return ("; the checkpoint changed after its commit (a partial copy, a full disk, a hand): copy it again from "
            "where it came, or load an earlier one (`bytecp ls RUN_DIR` lists them)")


def max_metadata_bytes() -> int:
    """The largest ``metadata.json`` a reader reads (:data:`MAX_METADATA_BYTES`, or
    ``BYTECP_MAX_METADATA_BYTES`` when set: a whole number of bytes)."""
    raw = os.environ.get("BYTECP_MAX_METADATA_BYTES", "").strip()
    if not raw:
        return MAX_METADATA_BYTES
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n <= 0:
        raise ConfigError(f"BYTECP_MAX_METADATA_BYTES={raw!r:.40} is not a positive whole number of bytes "
                          f"(unset it for the default, {MAX_METADATA_BYTES})")
    return n


def check_metadata_size(nbytes: int, where: str, name: str = "metadata.json") -> None:
    """(every reader of a ``metadata.json`` -- or of the ``base.json`` retention
    leaves in its place -- before reading it) Refuse one larger than
    :func:`max_metadata_bytes`: a crafted file (a sparse one of terabytes costs
    nothing on disk) would otherwise be read into memory whole."""
    cap = max_metadata_bytes()
    if nbytes > cap:
        raise CorruptCheckpointError(
            f"{where}: {name} is {nbytes:,} bytes, more than the {cap:,} bytecp reads "
            f"(a job of hundreds of thousands of tensors writes tens of MB): not a checkpoint's, or damaged. "
            "If it is a real one, set BYTECP_MAX_METADATA_BYTES above its size")


def _bad(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: metadata.json {what}; the checkpoint is corrupt or was tampered with")


# ----------------------------------------------------------------- structure
def check_structure(md: Metadata, where: str) -> None:
    """(every reader) Shapes, dtypes, object records and the skeleton's depth
    are well-formed; no recursion and no allocation depend on their values."""
    if not isinstance(md.world_size, int) or not 1 <= md.world_size <= MAX_WORLD_SIZE:
        raise _bad(where, f"says world_size {md.world_size!r:.40} (want 1..{MAX_WORLD_SIZE})")
    if not (isinstance(md.created, float) and 0 <= md.created < 2**33):  # finite, before year 2242
        raise _bad(where, f"says it was created at {md.created!r:.40} (seconds since 1970)")
    for fqn, info in ({} if isinstance(md.tensors, TensorTable) else md.tensors).items():  # a table: checked
        if not isinstance(info, Mapping):
            raise _bad(where, f"describes tensor {fqn!r} as {info!r:.80}, not an object")
        dtype, shape = info.get("dtype"), info.get("shape")
        if not isinstance(dtype, str) or dtype not in ITEMSIZES:
            raise _bad(where, f"gives tensor {fqn!r} the unknown dtype {dtype!r:.40}")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_NDIM
            or not all(type(n) is int and n >= 0 for n in shape)
        ):
            raise _bad(
                where,
                f"gives tensor {fqn!r} the shape {shape!r:.80} (want at most {MAX_NDIM} "
                "non-negative integers)",
            )
        band = info.get("band_dim")
        if band is not None and not (type(band) is int and 0 <= band < len(shape) and shape[band] > 0):
            raise _bad(where, f"gives tensor {fqn!r} of shape {shape} the band dimension {band!r:.40}")
    for name, rec in _object_records(md):
        if rec.is_blob and (rec.byte_offset < 0 or rec.nbytes < 0):
            raise _bad(
                where,
                f"places {name} at byte {rec.byte_offset} with {rec.nbytes} bytes in {rec.file} "
                "(offsets and sizes must be non-negative)",
            )
    for path, size in md.data_files.items():
        if size < 0:
            raise _bad(where, f"says data file {path} has {size} bytes")


def _object_records(md: Metadata) -> list[tuple[str, Any]]:
    out = [(f"object {k!r}", r) for k, r in md.objects.items()]
    out += [(f"object {k!r} of rank {rank}", r) for k, v in md.per_rank.items() for rank, r in v.items()]
    return out


def real_data_sizes(
    storage: Storage, md: Metadata, listed: Mapping[str, int] | None = None
) -> dict[str, int | None]:
    """(coordinator) The real size of every data file metadata.json lists (None: missing).

    One listing of ``data/`` (:meth:`~bytecp.storage_api.Storage.file_sizes`;
    ``listed``: the caller's); a file the listing lacks is asked for
    directly, so an eventually consistent listing never makes a present file
    look missing.
    """
    if listed is None:
        listed = storage.file_sizes("data")
    out: dict[str, int | None] = {}
    for path in md.data_files:
        size = listed.get(path)
        if size is None:
            try:
                size = storage.size(path)
            except FileNotFoundError:
                size = None
        out[path] = size
    return out


def check_sizes(
    storage: Storage,
    md: Metadata,
    chunks: list[ChunkRecord] | Callable[[], list[ChunkRecord]],
    real: Mapping[str, int | None] | None = None,
) -> None:
    """(coordinator, before any tensor is allocated) Declared sizes are real.

    Every data file exists with the size metadata.json declares; every object
    blob lies inside its file; the tensors' total size is at most the data
    files' total. Chunks were checked against the declared sizes already
    (:func:`bytecp.format.index_check.check_index`), so they are inside the real files too.
    ``chunks`` (or a function reading them, called only to name the tensors
    a bad file holds) name the tensors in the error.
    """
    if real is None:
        real = real_data_sizes(storage, md)
    for path, declared in md.data_files.items():
        got = real.get(path)
        if got == declared:
            continue
        holds: set[str] = set()
        try:
            for c in chunks() if callable(chunks) else chunks:
                if c.file == path and len(holds) < 3:
                    holds.add(c.fqn)
        except CorruptCheckpointError:
            pass  # the file's own error is the one to report
        what = f" (holding {', '.join(repr(n) for n in sorted(holds))})" if holds else ""
        if got is None:
            raise CorruptCheckpointError(f"{storage.url}: data file {path}{what} is missing{damaged(storage.url)}")
        state = "is truncated" if got < declared else "is larger than recorded"
        raise CorruptCheckpointError(
            f"{storage.url}: data file {path}{what} {state}: {got} bytes on storage, "
            f"metadata.json says {declared}{damaged(storage.url)}"
        )
    for name, rec in _object_records(md):
        if not rec.is_blob:
            continue
        size = md.data_files.get(rec.file)
        if size is None:
            raise CorruptCheckpointError(
                f"{storage.url}: {name} is stored in {rec.file}, which metadata.json does not list"
            )
        if rec.byte_offset + rec.nbytes > size:
            raise CorruptCheckpointError(
                f"{storage.url}: {name} claims bytes [{rec.byte_offset}, {rec.byte_offset + rec.nbytes}) "
                f"of {rec.file}, which has {size} bytes"
            )
    data_total = sum(md.data_files.values())
    if isinstance(md.tensors, TensorTable):
        over = md.tensors.first_over(data_total)
        if over is not None:
            fqn = md.tensors.names[over]
            raise CorruptCheckpointError(
                f"{storage.url}: metadata.json declares tensors (up to {fqn!r}, shape {md.tensors.shape(over)}) "
                f"larger in total than all its data files ({data_total} bytes); refusing to allocate them")
        return
    tensor_total = 0
    for fqn, info in md.tensors.items():
        tensor_total += math.prod(info["shape"]) * ITEMSIZES[info["dtype"]]
        if tensor_total > data_total:
            raise CorruptCheckpointError(
                f"{storage.url}: metadata.json declares tensors (up to {fqn!r}, shape "
                f"{info['shape']}) larger in total than all its data files ({data_total} bytes); "
                "refusing to allocate them"
            )


def check_index_file(storage: Storage, md: Metadata) -> None:
    """(coordinator, version 2) The index file exists with the size its directory declares."""
    d = md.index
    if d is None:
        return
    try:
        got: int | None = storage.size(d.file)
    except FileNotFoundError:
        got = None
    if got != d.nbytes:
        state = "is missing" if got is None else f"has {got} bytes, metadata.json says {d.nbytes}"
        raise CorruptCheckpointError(f"{storage.url}: index file {d.file} {state}{damaged(storage.url)}")


# ----------------------------------------------------------------- index
def max_index_rows(md: Metadata, real: Mapping[str, int | None] | None = None) -> int:
    """Rows the index may have: the fixed allowance, one per aligned block of
    data (real sizes when known, else declared), and the empty chunks of
    zero-element tensors (one per rank at most)."""
    sizes = real if real is not None else md.data_files
    blocks = sum((s or 0) // _ALIGN + 1 for s in sizes.values())
    return FIXED_ROWS + blocks + empty_tensors(md) * min(md.world_size, FIXED_ROWS)


def empty_tensors(md: Metadata) -> int:
    """How many of the checkpoint's tensors hold no element (a dimension of 0)."""
    if isinstance(md.tensors, TensorTable):
        return md.tensors.empty_count()
    return sum(1 for info in md.tensors.values() if 0 in info["shape"])


def check_chunk_records(name: str, chunks: list[ChunkRecord]) -> None:
    """(after an index file is decoded) Each row's box is well-formed: as many
    offsets and lengths as dimensions (at most :data:`MAX_NDIM`), all
    non-negative, and a non-negative byte range."""
    for c in chunks:
        nd = len(c.global_shape)
        if (
            nd > MAX_NDIM
            or len(c.offsets) != nd
            or len(c.lengths) != nd
            or min((*c.global_shape, *c.offsets, *c.lengths), default=0) < 0
            or c.byte_offset < 0
            or c.nbytes < 0
        ):
            raise CorruptCheckpointError(
                f"index file {name}: row of tensor {c.fqn!r:.80} has a malformed box or byte range "
                f"(shape {list(c.global_shape)[:8]}, offsets {list(c.offsets)[:8]}, lengths "
                f"{list(c.lengths)[:8]}, bytes {c.byte_offset}+{c.nbytes})"
            )


def check_index_metadata(name: str, meta: pq.FileMetaData, nbytes: int, max_rows: int | None, data: bytes | bytearray = b"") -> None:
    """(before an index file is decoded) Row count, values per row and decoded
    bytes within the budget; ``meta`` is the Parquet footer as pyarrow parsed
    it, ``data`` the file (its footer is read here too, see below)."""
    if max_rows is not None and meta.num_rows > max_rows:
        raise CorruptCheckpointError(
            f"index file {name} has {meta.num_rows} rows, more than the {max_rows} chunks the "
            "checkpoint's data files can hold"
        )
    # Column-chunk statistics come from our own reading of the footer: pyarrow
    # aborts the process (an uncaught C++ exception) when a damaged footer's
    # column-chunk metadata is accessed through its Python API.
    decoded = 0
    for rows, columns in footer_row_groups(name, data) if data else []:
        for num_values, uncompressed in columns:
            if num_values > max(1, rows) * MAX_NDIM or num_values < 0:
                raise CorruptCheckpointError(
                    f"index file {name}: a column holds {num_values} values for {rows} rows "
                    f"(at most {MAX_NDIM} per row)"
                )
            # decoded, a value costs at most 8 bytes plus its levels
            decoded += max(0, uncompressed) + 12 * num_values
    if decoded > MAX_INDEX_EXPANSION * nbytes + FIXED_BYTES:
        raise CorruptCheckpointError(
            f"index file {name} decodes to {decoded} bytes from {nbytes}: refusing (a compression bomb?)"
        )


# ----------------------------------------------------------------- blobs
def check_blob(blob: bytes, where: str) -> None:
    """A ``torch.save`` blob is a zip whose entries are stored (not compressed)
    and fit in the blob, so loading it inflates nothing."""
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError) as e:
        raise CorruptCheckpointError(f"{where}: not a torch.save archive ({e})") from e
    total = 0
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:
            raise CorruptCheckpointError(
                f"{where}: archive entry {info.filename!r} is compressed; torch.save writes stored "
                "entries only (refusing to inflate it)"
            )
        total += info.file_size
        if info.file_size > len(blob) or total > len(blob):
            raise CorruptCheckpointError(
                f"{where}: archive entries claim {total} bytes in a blob of {len(blob)}"
            )



def load_blob(blob: bytes, where: str, *, safe: bool) -> Any:
    """(object readers, ``verify``) Decode a ``torch.save`` blob after :func:`check_blob`.

    ``safe``: the restricted (``weights_only``) unpickler, whose refusal is a
    :class:`~bytecp.errors.PickleNotAllowedError`; any other failure to
    decode is a :class:`~bytecp.errors.CorruptCheckpointError` naming ``where``.
    """
    import pickle

    import torch

    check_blob(blob, where)
    try:
        return torch.load(io.BytesIO(blob), weights_only=safe)
    except pickle.UnpicklingError as e:
        if not safe:
            raise CorruptCheckpointError(f"{where}: the blob does not unpickle ({e})") from e
        raise PickleNotAllowedError(
            f"{where}: holds types a safe load refuses ({str(e).splitlines()[0]}); "
            "pass allow_pickle=True only if you trust the checkpoint"
        ) from e
    except Exception as e:  # noqa: BLE001 - any decoding failure of stored bytes is corruption
        raise CorruptCheckpointError(f"{where}: the blob does not decode ({type(e).__name__}: {e})") from e
