"""Read a committed checkpoint: its metadata, its chunk index, and byte
ranges straight into target tensors.

Called by the load pipeline (the coordinator reads metadata and index; every
rank executes its own read requests), by ``bytecp export``, ``inspect``,
``verify`` and ``gc`` (one process). Everything read is validated before it
is trusted: a tampered, truncated or mixed-up checkpoint raises
:class:`~bytecp.errors.CorruptCheckpointError` naming the file and tensor.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
from collections.abc import Mapping, Sequence

import torch

from bytecp.errors import CorruptCheckpointError, StorageError
from bytecp.format import index_read, limits
from bytecp.format import metadata as fmt
from bytecp.format.checksum import crc32c
from bytecp.loading import diagnose
from bytecp.plan.planner import ReadRequest, find_overlap
from bytecp.recorder import Trace
from bytecp.storage_api import Storage
from bytecp.tree.dtypes import byte_view, dtype_from_name, host_memoryview, itemsize
from bytecp.tree.regions import Region, row_major_strides

__all__ = [
    "Target", "read_metadata", "read_chunks", "check_chunks", "check_rows", "execute_reads", "READ_BATCH_MIN_BYTES",
]

#: reads smaller than this per file are not split across threads
READ_BATCH_MIN_BYTES = 8 << 20


@dataclasses.dataclass
class Target:
    """A box of tensor ``fqn`` to fill, and the local tensor (view) that holds it."""

    fqn: str
    box: Region
    view: torch.Tensor


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
    check_rows(storage, md, chunks)
    boxes: dict[str, list[Region]] = {}
    for c in chunks:
        if math.prod(c.lengths) or not md.index:  # version 2 lists no empty chunks
            boxes.setdefault(c.fqn, []).append(Region(c.offsets, c.lengths))
    for fqn, info in md.tensors.items():
        bs = boxes.get(fqn, [])
        total = math.prod(info["shape"])
        held = sum(b.numel for b in bs)
        if not bs and total == 0:
            continue  # no elements: no chunk (version 2), or one empty chunk or none (version 1)
        pair = find_overlap(bs, dim=int(info.get("band_dim", 0))) if held >= total and len(bs) > 1 else None
        if held != total or pair is not None:
            what = f"chunks {pair[0]} and {pair[1]} overlap" if pair else f"chunks hold {held} of {total} elements"
            raise CorruptCheckpointError(f"{storage.url}: tensor {fqn!r}: {what}")


def check_rows(storage: Storage, md: fmt.Metadata, chunks: Sequence[fmt.ChunkRecord]) -> None:
    """Each index row agrees with metadata.json: a listed tensor, its dtype
    and shape, a box inside it, the bytes the box needs, inside a listed data
    file (every rank checks the rows it reads)."""
    sizes: dict[str, int] = {}

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


def read_chunks(
    storage: Storage, md: fmt.Metadata, real: Mapping[str, int | None] | None = None
) -> list[fmt.ChunkRecord]:
    """(one-process tools; the version-1 load's coordinator) The whole
    validated chunk index; ``real``: the data files' real sizes when the
    caller listed them already."""
    if md.index is not None:
        limits.check_index_file(storage, md)  # before any buffer is sized from the directory
        if real is None:
            real = limits.real_data_sizes(storage, md)
        chunks = index_read.read_segments(storage, md, index_read.all_segments(md),
                                          budget=index_read.max_rows(md, real))
        check_chunks(storage, md, chunks)
        return chunks
    blobs = []
    for f in md.index_files:
        try:
            blobs.append((f, storage.read_bytes(f)))
        except FileNotFoundError as e:
            raise CorruptCheckpointError(
                f"{storage.url}: index file {f} named in metadata.json is missing ({e})"
            ) from e
    chunks = fmt.read_index(
        blobs, where=storage.url,
        row_budget=lambda: limits.max_index_rows(md, real if real is not None else limits.real_data_sizes(storage, md)),
    )
    check_chunks(storage, md, chunks)
    return chunks


def _batches(chunks: Sequence[fmt.ChunkRecord], reqs: Sequence[ReadRequest], io_threads: int) -> list[list[ReadRequest]]:
    """The requests of each file in offset order, cut so that every reader
    thread has work (about ``io_threads`` batches per file at least)."""
    by_file: dict[str, list[ReadRequest]] = {}
    for r in reqs:
        by_file.setdefault(chunks[r.chunk].file, []).append(r)
    batches: list[list[ReadRequest]] = []
    for file_reqs in by_file.values():
        file_reqs.sort(key=lambda r: r.byte_offset)
        cap = max(READ_BATCH_MIN_BYTES, -(-sum(r.nbytes for r in file_reqs) // io_threads))
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
    return batches


class _BatchReader:
    """Reads one batch (one ranged-read call: backends coalesce) into its targets."""

    def __init__(self, storage: Storage, chunks: Sequence[fmt.ChunkRecord], targets: Sequence[Target], verify: bool) -> None:
        self.storage, self.chunks, self.targets, self.verify = storage, chunks, targets, verify

    def _dest(self, req: ReadRequest) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(destination view, buffer to read into, whether the buffer is the destination)."""
        t = self.targets[req.target]
        dest = t.view[req.box.relative_to(t.box).slices()]
        direct = req.whole_chunk and dest.is_contiguous() and dest.device.type == "cpu"
        raw = byte_view(dest) if direct else torch.empty(req.nbytes, dtype=torch.uint8)
        return dest, raw, direct

    def _finish(self, req: ReadRequest, dest: torch.Tensor, raw: torch.Tensor, direct: bool) -> None:
        c = self.chunks[req.chunk]
        if self.verify and req.whole_chunk and crc32c(host_memoryview(raw)) != c.crc32c:
            raise CorruptCheckpointError(
                f"{self.storage.url}/{c.file}: checksum mismatch in tensor {c.fqn!r} region "
                f"{Region(c.offsets, c.lengths)} (bytes {c.byte_offset}..{c.byte_offset + c.nbytes})"
            )
        if not direct and req.box.numel:
            typed = raw.view(dest.dtype)
            dest.copy_(torch.as_strided(typed, req.box.lengths, row_major_strides(c.lengths), 0))

    def __call__(self, batch: list[ReadRequest]) -> int:
        bufs = [self._dest(r) for r in batch]
        first = self.chunks[batch[0].chunk]
        try:
            self.storage.read_ranges(
                first.file, [(r.byte_offset, host_memoryview(raw)) for r, (_, raw, _) in zip(batch, bufs, strict=True)]
            )
        except CorruptCheckpointError as e:
            names = sorted({self.chunks[r.chunk].fqn for r in batch})
            more = f" and {len(names) - 1} more from {first.file}; first region" if len(names) > 1 else " region"
            raise CorruptCheckpointError(f"{e} (reading tensor {names[0]!r}{more} {batch[0].box})") from e
        except FileNotFoundError as e:
            raise CorruptCheckpointError(
                f"{self.storage.url}: data file {first.file} holding tensor {first.fqn!r} region "
                f"{Region(first.offsets, first.lengths)} is missing"
            ) from e
        for r, (dest, raw, direct) in zip(batch, bufs, strict=True):
            self._finish(r, dest, raw, direct)
        return sum(r.nbytes for r in batch)


def execute_reads(
    storage: Storage,
    chunks: Sequence[fmt.ChunkRecord],
    targets: Sequence[Target],
    reqs: Sequence[ReadRequest],
    *,
    io_threads: int,
    verify: bool,
    trace: Trace,
) -> int:
    """(every rank, its own requests) Read ``reqs`` into ``targets`` with
    ``io_threads`` threads; returns the bytes read."""
    batches = _batches(chunks, reqs, io_threads)
    run = _BatchReader(storage, chunks, targets, verify)
    with trace.span("read") as sp:
        if len(batches) <= 1 or io_threads == 1:
            total = sum(run(b) for b in batches)
        else:
            with concurrent.futures.ThreadPoolExecutor(io_threads, "bytecp-read") as ex:
                total = sum(ex.map(run, batches))
        sp.nbytes = total
        sp.files = len({chunks[b[0].chunk].file for b in batches})
    return total
