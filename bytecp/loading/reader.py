"""Ranged reads of an opened checkpoint's data files straight into target
tensors.

Called by the load pipeline (every rank executes its own read requests) and
by ``bytecp export`` (one process), with rows from the opened checkpoint
(:mod:`bytecp.loading.opened`), already checked against its metadata, and
the requests :func:`bytecp.plan.load_plan.plan_load` made from them. A
checksum mismatch, a short or missing file raises
:class:`~bytecp.errors.CorruptCheckpointError` naming the file and tensor.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Sequence

import torch
from torch.autograd.graph import increment_version

from bytecp.errors import CorruptCheckpointError
from bytecp.format import metadata as fmt
from bytecp.format.checksum import crc32c
from bytecp.plan.load_plan import ReadRequest
from bytecp.recorder import Trace
from bytecp.storage_api import Storage
from bytecp.tree.dtypes import byte_view, dtype_from_name, dtype_name, host_memoryview
from bytecp.tree.regions import Region, row_major_strides

__all__ = ["Target", "execute_reads", "READ_BATCH_MIN_BYTES"]

#: reads smaller than this per file are not split across threads
READ_BATCH_MIN_BYTES = 8 << 20


@dataclasses.dataclass
class Target:
    """A box of tensor ``fqn`` to fill, and the local tensor (view) that holds it."""

    fqn: str
    box: Region
    view: torch.Tensor


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
        # straight into the target when the bytes read are exactly its box (a
        # whole chunk, or rows of one: FSDP2's shards) in its dtype; else staged (and cast)
        direct = (dest.is_contiguous() and dest.device.type == "cpu"
                  and req.nbytes == req.box.numel * dest.element_size()
                  and dtype_name(dest.dtype) == self.chunks[req.chunk].dtype)
        raw = byte_view(dest) if direct else torch.empty(req.nbytes, dtype=torch.uint8)
        return dest, raw, direct

    def _finish(self, req: ReadRequest, dest: torch.Tensor, raw: torch.Tensor, direct: bool) -> None:
        c = self.chunks[req.chunk]
        if self.verify and req.whole_chunk and crc32c(host_memoryview(raw)) != c.crc32c:
            raise CorruptCheckpointError(
                f"{self.storage.url}/{c.file}: checksum mismatch in tensor {c.fqn!r} region "
                f"{Region(c.offsets, c.lengths)} (bytes {c.byte_offset}..{c.byte_offset + c.nbytes})"
            )
        if direct:  # read into its memory, behind its version counter: incremental saves must see it
            increment_version(dest)
        elif req.box.numel:
            typed = raw.view(dtype_from_name(c.dtype))  # copy_ casts a foreign source's dtype
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
