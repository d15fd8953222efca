"""Read-only tools over a committed checkpoint: summary (``inspect``) and
checksum verification (``verify``). Used by the CLI and by tests; one process,
no ``torch.distributed``.

Both take a foreign source too (a DCP or torch_dist folder, a DeepSpeed
checkpoint, a Hugging Face directory: :data:`bytecp.interop.SOURCES`),
opened as a load opens it (``open_checkpoint(foreign=True)``); the summary
names the format, and :func:`verify_any` checks what the format allows
(:mod:`bytecp.tools.verify_source`)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import math
import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from bytecp.data.positions import summary
from bytecp.errors import BytecpError
from bytecp.format import limits, parts_stream
from bytecp.format.checksum import block_crc, crc32c, sums
from bytecp.format.index_check import Tiling
from bytecp.format.metadata import ChunkRecord
from bytecp.format.parts_schema import PartsDirectory
from bytecp.loading.checks import block_bytes_of
from bytecp.loading.opened import OpenedCheckpoint, open_checkpoint
from bytecp.storage_api import Storage
from bytecp.tools.progress import NO_PROGRESS, Progress
from bytecp.tools.verify_source import open_for_verify, verify_source
from bytecp.tree.dtypes import dtype_from_name, itemsize
from bytecp.tree.regions import Region

__all__ = ["summarize", "verify", "verify_any", "VerifyProblem"]


def summarize(storage: Storage) -> dict[str, Any]:
    """A JSON-able description of the checkpoint or source (what ``bytecp
    inspect`` prints); ``format``: ``"bytecp"`` or the source's name."""
    opened = open_checkpoint(storage, foreign=True)
    md = opened.metadata
    batches, tiling = _rows(opened)
    counts: dict[str, int] = defaultdict(int)
    n_chunks = 0
    for batch in batches:
        if tiling is not None:
            tiling.add(batch)
        n_chunks += len(batch)
        for c in batch:
            counts[c.fqn] += 1
    if tiling is not None:
        tiling.finish()
    opened.check_sizes()  # never report sizes the files do not have
    per: dict[str, dict[str, Any]] = {}
    for fqn, info in md.tensors.items():
        n = math.prod(info["shape"])
        per[fqn] = {
            "dtype": info["dtype"],
            "shape": info["shape"],
            "nbytes": n * itemsize(dtype_from_name(info["dtype"])),
            "chunks": counts.get(fqn, 0),
        }
    writers: dict[int, int] = defaultdict(int)
    own = md.own_data_files
    for path, size in own.items():
        head = path.rsplit("/", 1)[-1].split("-", 1)[0]
        writers[int(head) if head.isdigit() else -1] += size
    return {
        "url": storage.url,
        "format": opened.source_format,
        "checksums": not opened.foreign,  # a source's rows carry none
        "format_version": md.format_version,
        "bytecp_version": md.bytecp_version,
        "save_id": md.save_id,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(md.created)),
        "framework": md.framework,
        "parallelism": md.parallelism,
        "world_size": md.world_size,
        "step": md.step,
        "user_metadata": md.user_metadata,
        "tensors": per,
        "aliases": md.aliases,  # tied tensors: alias -> the stored tensor whose data it shares
        # version 3: checkpoints of the run whose data files this one reads
        "references": {name: {"save_id": sid, "files": len(md.files_of(name)),
                               "bytes": sum(md.files_of(name).values())} for name, sid in md.references.items()},
        "objects": {k: ("json" if not r.is_blob else f"blob {r.nbytes} B") for k, r in md.objects.items()},
        "per_rank_objects": {k: sorted(v) for k, v in md.per_rank.items()},
        # data loaders' positions: kind, epoch, samples consumed (bytecp.data)
        "data": {k: summary(v, md.world_size) for k, v in md.data.items()},
        "totals": {
            "tensors": len(per),
            "tensor_bytes": sum(p["nbytes"] for p in per.values()),
            "chunks": n_chunks,
            "data_files": len(own),
            "data_file_bytes": sum(own.values()),
            "referenced_bytes": sum(md.data_files.values()) - sum(own.values()),
            "bytes_written_per_rank": {str(r): b for r, b in sorted(writers.items())},
        },
    }


#: ``inspect`` and ``verify`` of a version-4 checkpoint read its index a
#: part at a time and keep every row's box for the exact tiling check up to
#: this many rows (about 80 MB of boxes); beyond, each tensor's elements
#: must add up to its size and no two rows of one part may overlap
#: (:class:`~bytecp.format.index_check.Tiling`), so a checkpoint of 131,072
#: ranks and 19M rows is checked in the memory of its directory and one part
EXACT_ROWS = 250_000


def _rows(opened: OpenedCheckpoint) -> tuple[Iterable[list[ChunkRecord]], Tiling | None]:
    """The checkpoint's rows in batches, with the check still to run on
    them: a version-4 checkpoint's a part at a time (checked as they come);
    any other's whole, already checked (:meth:`OpenedCheckpoint.all_rows`)."""
    md = opened.metadata
    if opened.foreign or not isinstance(md.index, PartsDirectory):
        return [opened.all_rows()], None
    opened.index.check_files(opened)
    _, batches = parts_stream.iter_parts(opened.storage, md, budget=opened.max_rows)
    return batches, Tiling(opened.storage.url, md, EXACT_ROWS)


def verify_any(storage: Storage, *, io_threads: int = 8,
               progress: Progress = NO_PROGRESS) -> tuple[str, int, list[VerifyProblem]]:
    """(``bytecp verify``) ``(format, bytes checked, problems)`` of a bytecp
    checkpoint (:func:`verify`: every byte against its crc32c) or of a
    foreign source (:func:`bytecp.tools.verify_source.verify_source`: its
    structure, which is all a format without checksums allows)."""
    opened, broken = open_for_verify(storage)
    if broken is not None:
        return broken.format, 0, [VerifyProblem(broken.file, "", "", broken.message)]
    assert opened is not None
    if opened.foreign:
        nbytes, found = verify_source(opened, progress)
        return opened.source_format, nbytes, [VerifyProblem(*p) for p in found]
    return "bytecp", *_verify_bytecp(opened, io_threads, progress)


@dataclasses.dataclass
class VerifyProblem:
    file: str
    what: str  # tensor fqn or object name
    region: str
    message: str

    def __str__(self) -> str:
        where, msg = " ".join(x for x in (self.what, self.region) if x), self.message
        return f"{self.file}: {where}: {msg}" if where else msg if msg.startswith(self.file) else f"{self.file}: {msg}"


def verify(storage: Storage, *, io_threads: int = 8, progress: Progress = NO_PROGRESS) -> tuple[int, list[VerifyProblem]]:
    """Read every chunk and object blob, check sizes and crc32c, and decode
    every blob saved without ``allow_pickle`` with the safe loader.

    Returns ``(bytes checked, problems)``; no problems means the checkpoint
    is intact. ``progress`` hears the bytes as they are checked. A foreign
    source: its structure (:func:`verify_any`).
    """
    return verify_any(storage, io_threads=io_threads, progress=progress)[1:]


#: what ``verify`` checks of one chunk or blob: file, what, region, offset, size, crc32c, and a chunk's
#: block checksums (None: a blob, which has none)
_Item = tuple[str, str, str, int, int, int, "bytes | None"]


def _blocks_wrong(data: bytes, off: int, crc: int, blocks: bytes, block_bytes: int) -> str:
    """What is wrong with a chunk's bytes against its crc32c and block checksums ('' if nothing)."""
    got = sums(data, block_bytes)
    if len(got.blocks) != len(blocks):
        return f"{len(blocks) // 4} block checksums recorded for {len(got.blocks) // 4} blocks"
    wrong = [k for k in range(len(blocks) // 4) if block_crc(got.blocks, k) != block_crc(blocks, k)]
    if not wrong and got.crc == crc:
        return ""
    where = ", ".join(f"{k} (bytes {off + k * block_bytes}..{off + min(len(data), (k + 1) * block_bytes)})"
                      for k in wrong[:4]) + (f" and {len(wrong) - 4} more" if len(wrong) > 4 else "")
    return (f"crc32c mismatch: stored {crc:#010x}, read {got.crc:#010x}"
            + (f"; block checksum mismatch in block(s) {where}" if wrong else ""))


def _verify_bytecp(opened: OpenedCheckpoint, io_threads: int, progress: Progress) -> tuple[int, list[VerifyProblem]]:
    storage = opened.storage  # reads follow the references of a version-3 checkpoint
    md = opened.metadata
    batches, tiling = _rows(opened)
    problems: list[VerifyProblem] = []
    sizes = opened.data_sizes
    for path, want in md.data_files.items():
        if sizes[path] is None:
            problems.append(VerifyProblem(path, "data file", "", "missing"))
            continue
        if sizes[path] != want:
            problems.append(VerifyProblem(path, "data file", "", f"size {sizes[path]} B, metadata says {want} B"))

    block_bytes = block_bytes_of(md)  # version 5: each chunk's block checksums checked too
    items: list[_Item] = []  # the objects' blobs (the chunks come in batches)
    blobs: dict[tuple[str, int, int], bool] = {}  # (file, offset, nbytes) -> decode safely
    for name, rec in md.objects.items():
        if rec.is_blob and rec.file:
            items.append((rec.file, f"object {name!r}", "", rec.byte_offset, rec.nbytes, rec.crc32c, None))
            blobs[(rec.file, rec.byte_offset, rec.nbytes)] = not rec.pickle
    for name, recs in md.per_rank.items():
        for r, rec in recs.items():
            if rec.is_blob and rec.file:
                items.append((rec.file, f"object {name!r} of rank {r}", "", rec.byte_offset, rec.nbytes, rec.crc32c,
                              None))
                blobs[(rec.file, rec.byte_offset, rec.nbytes)] = not rec.pickle

    def check(item: _Item) -> VerifyProblem | None:
        try:
            return _check(item)
        finally:
            progress.advance(item[4])

    def _check(item: _Item) -> VerifyProblem | None:
        file, what, region, off, n, crc, blocks = item
        size = sizes.get(file, -1)
        if size is None:
            return VerifyProblem(file, what, region, "data file missing")
        if size is not None and size >= 0 and off + n > size:
            return VerifyProblem(file, what, region, f"truncated: needs bytes {off}..{off + n}, file has {size}")
        try:
            data = storage.read_bytes(file, off, n)
        except Exception as e:
            return VerifyProblem(file, what, region, f"unreadable: {e}")
        if block_bytes is not None and blocks is not None:
            bad = _blocks_wrong(data, off, crc, blocks, block_bytes)
            if bad:
                return VerifyProblem(file, what, region, bad)
        elif (got := crc32c(data)) != crc:
            return VerifyProblem(file, what, region, f"crc32c mismatch: stored {crc:#010x}, read {got:#010x}")
        if blobs.get((file, off, n)):  # an object saved without allow_pickle must load without it
            try:
                limits.load_blob(data, what, safe=True)
            except BytecpError as e:
                return VerifyProblem(file, what, region, f"does not load with the safe loader: {e}")
        return None

    if tiling is None:  # the rows are in memory already
        batches = list(batches)
        chunk_bytes = sum(c.nbytes for batch in batches for c in batch)
    else:  # each element is stored once in one chunk (an index that says otherwise fails its tiling check)
        chunk_bytes = sum(math.prod(i["shape"]) * itemsize(dtype_from_name(i["dtype"])) for i in md.tensors.values())
    progress.start(chunk_bytes + sum(i[4] for i in items))
    checked = 0
    with concurrent.futures.ThreadPoolExecutor(io_threads, "bytecp-verify") as ex:
        for batch in itertools.chain(batches, [None]):  # a part at a time: never every row at once
            if batch is None:  # the objects, after every chunk
                todo = items
            else:
                if tiling is not None:
                    tiling.add(batch)
                todo = [(c.file, c.fqn, str(Region(c.offsets, c.lengths)), c.byte_offset, c.nbytes, c.crc32c,
                         c.blocks) for c in batch]
            checked += sum(i[4] for i in todo)
            problems += [p for p in ex.map(check, todo) if p is not None]
    if tiling is not None:
        tiling.finish()
    return checked, problems


