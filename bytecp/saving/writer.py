"""Write one rank's staged boxes and objects into data files, and its index.

Called by the save pipeline's write phase (every rank, on the caller's
thread for a sync save, on the background thread for an async one): the
staged boxes are packed into up to ``io_threads`` data files, each written
by its own thread as one sequence of buffers (no copy), 4 KiB aligned, the
crc32c of every chunk computed on the way (unless the stager computed it
during its copy). Boxes staged in an arena the storage lent
(:meth:`~bytecp.storage_api.Storage.staging_arena`) are not written: the
storage adopts the arena as one data file and answers the chunks' crc32c. What was written comes back as a
:class:`RankOutput` (chunk records, file sizes, object records) for the
commit.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from bytecp import faults
from bytecp.errors import ConfigError
from bytecp.format import metadata as fmt
from bytecp.format.checksum import Sums, crc32c, sums, writer_block_bytes
from bytecp.format.chunk_batch import ChunkBatch
from bytecp.format.objects import serialize
from bytecp.format.parts_build import build_part
from bytecp.format.parts_schema import buckets_for, part_file
from bytecp.plan.planner import WriteItem
from bytecp.saving.own_threads import serial_torch
from bytecp.storage_api import SharedArena, Storage
from bytecp.tree.buffers import Guard
from bytecp.tree.dtypes import host_memoryview
from bytecp.tree.regions import Region
from bytecp.tree.state import TensorLeaf

__all__ = [
    "PAD_ZEROS",
    "Staged",
    "RankOutput",
    "source_view",
    "as_host_bytes",
    "write_data_files",
    "for_commit",
    "EXACT_CHECK_RANKS",
    "held_checksums",
    "FILE_TARGET_BYTES",
]

#: zero bytes that pad a box to the data files' alignment (writer and staging arena)
PAD_ZEROS = bytes(fmt.ALIGNMENT)
#: below this many bytes per file, more files (and writer threads) do not pay
FILE_TARGET_BYTES = 32 << 20


@dataclasses.dataclass(slots=True)
class Staged:
    """A box to write and its bytes (a view of the live tensor or of the staging arena)."""

    item: WriteItem
    data: memoryview
    #: crc32c and block checksums of ``data`` when the stager computed them on the way (else the writer does)
    sums: Sums | None = None
    #: ``data`` followed by zeros up to a multiple of :data:`~bytecp.format.metadata.ALIGNMENT`
    #: (page-aligned in the staging arena): written whole in place of data + padding
    padded: memoryview | None = None
    #: the storage's lent arena holding ``data`` at ``offset`` (laid out as a data file): adopted, not written
    arena: SharedArena | None = None
    offset: int = 0
    #: the reused arena ``data`` lies in and the token of the stage that filled it (checked once written)
    use: tuple[Guard, int] | None = None

    def for_item(self, item: WriteItem) -> Staged:
        """These bytes as the record of ``item`` (the same box, as a plan names it
        again): every other field as it is (``dataclasses.replace`` costs 5x
        more, once per box of a save)."""
        return Staged(item, self.data, self.sums, self.padded, self.arena, self.offset, self.use)


@dataclasses.dataclass
class RankOutput:
    """What one rank wrote: the commit turns every rank's output into
    metadata.json. Each rank writes its own index part; its entries
    (``part``) and, in jobs of up to :data:`EXACT_CHECK_RANKS` ranks, its chunk
    records as one :class:`~bytecp.format.chunk_batch.ChunkBatch` (``batch``,
    not objects) travel to the coordinator."""

    chunks: list[fmt.ChunkRecord] = dataclasses.field(default_factory=list)
    data_files: dict[str, int] = dataclasses.field(default_factory=dict)
    batch: ChunkBatch | None = None
    objects: dict[str, fmt.ObjectRecord] = dataclasses.field(default_factory=dict)
    per_rank: dict[str, fmt.ObjectRecord] = dataclasses.field(default_factory=dict)
    #: per-rank fqn -> this rank's data position as JSON text (merged by the coordinator: bytecp.data.positions)
    data: dict[str, str] = dataclasses.field(default_factory=dict)
    #: with verify_replicas: crc32c of every box this rank holds, by (fqn, region)
    replica_crcs: dict[tuple[str, Region], int] | None = None
    #: at commit: the entries of the index part this rank wrote and its 0-dim
    #: chunks, encoded (:meth:`~bytecp.format.parts_wire.PartEntries.encode`:
    #: a few dozen words, decoded with every rank's at once by the coordinator)
    part: bytes | None = None

    def extend(self, other: RankOutput) -> None:
        """Add a later write batch of the same rank."""
        self.chunks += other.chunks
        self.data_files.update(other.data_files)
        self.objects.update(other.objects)
        self.per_rank.update(other.per_rank)
        self.data.update(other.data)


def source_view(leaf: TensorLeaf, region: Region, fqn: str) -> torch.Tensor:
    """The live tensor view holding ``region`` of ``leaf`` on this rank."""
    for sh in leaf.shards:
        if sh.region == region:  # the whole shard (most boxes): no indexing
            return sh.tensor
        if sh.region.contains(region):
            return sh.tensor[region.relative_to(sh.region).slices()]
    raise ConfigError(f"tensor {fqn!r}: this rank holds no shard containing {region}")


def held_checksums(items: Sequence[WriteItem], flat: Any) -> dict[tuple[str, Region], int]:
    """crc32c of every box this rank holds (``items``: its local plan), for
    comparing replicas across ranks."""
    return {(it.fqn, it.region): crc32c(as_host_bytes(source_view(flat.tensors[it.fqn], it.region, it.fqn)))
            for it in items}


def as_host_bytes(t: torch.Tensor) -> memoryview:
    """The logical bytes of a tensor view, without copying when it is a
    contiguous CPU tensor (never the whole underlying storage)."""
    if t.device.type != "cpu":
        t = t.to("cpu")
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return host_memoryview(t)


_Blob = tuple[str, str, bytes]  # (table "obj"/"rank", fqn, bytes)


def _split_files(staged: Sequence[Staged], blobs: list[_Blob], n: int) -> list[tuple[list[Staged], list[_Blob]]]:
    """Spread the boxes over at most ``n`` files of similar size (largest first);
    the blobs go with the smallest."""
    sizes = [len(s.data) for s in staged]
    n = max(1, min(n, -(-sum(sizes) // FILE_TARGET_BYTES), len(staged)))
    bins: list[tuple[list[Staged], list[_Blob]]] = [([], []) for _ in range(n)]
    if n == 1:
        bins[0][0].extend(staged)
        bins[0][1].extend(blobs)
    else:
        loads = [0] * n
        for k in sorted(range(len(staged)), key=sizes.__getitem__, reverse=True):
            i = loads.index(min(loads))
            bins[i][0].append(staged[k])
            loads[i] += sizes[k]
        bins[loads.index(min(loads))][1].extend(blobs)
    for b in bins:  # (a rank's boxes of one tensor never share offsets: the tuples order them, compared in C)
        b[0].sort(key=_layout_order)
    return [b for b in bins if b[0] or b[1]]


def _layout_order(s: Staged) -> tuple[str, tuple[int, ...]]:
    item = s.item
    return item.fqn, item.region.offsets


def _write_one_file(
    storage: Storage, path: str, staged: list[Staged], blobs: list[_Blob]
) -> tuple[list[fmt.ChunkRecord], list[tuple[_Blob, int, int]], int]:
    """Lay out and write one data file; -> (chunks, (blob, offset, crc) list, size)."""
    buffers: list[Any] = []
    chunks: list[fmt.ChunkRecord] = []
    placed: list[tuple[_Blob, int, int]] = []
    pos = 0
    block = writer_block_bytes()

    def append(data: Any) -> int:
        nonlocal pos
        start = pos
        if len(data):
            buffers.append(data)
        pos += len(data)
        pad = (-pos) % fmt.ALIGNMENT
        if pad:
            buffers.append(PAD_ZEROS[:pad])
            pos += pad
        return start

    for s in staged:
        if s.padded is not None and len(s.padded) == len(s.data) + (-len(s.data)) % fmt.ALIGNMENT:
            start = pos  # aligned: every append ends on a multiple of ALIGNMENT
            buffers.append(s.padded)
            pos += len(s.padded)
        else:
            start = append(s.data)
        it, got, n = s.item, s.sums, len(s.data)
        if got is not None:
            crc, blocks = got.crc, got.blocks
        elif n <= block:  # (most boxes: one call, no block checksums)
            crc, blocks = crc32c(s.data), b""
        else:
            got = sums(s.data, block)
            crc, blocks = got.crc, got.blocks
        chunks.append(fmt.ChunkRecord(it.fqn, it.dtype, it.global_shape, it.region.offsets, it.region.lengths,
                                      path, start, n, crc, blocks))
    for blob in blobs:
        placed.append((blob, append(blob[2]), crc32c(blob[2])))
    storage.write_file(path, buffers)
    faults.handoff("write")
    for use in {s.use for s in staged if s.use is not None}:  # the arena was not released while it was written
        use[0].check(use[1])
    return chunks, placed, pos


def _adopt_one_file(
    storage: Storage, path: str, staged: list[Staged]
) -> tuple[list[fmt.ChunkRecord], list[tuple[_Blob, int, int]], int]:
    """The storage takes over the lent arena holding ``staged`` as the data
    file ``path`` (laid out as :func:`_write_one_file` would, page-aligned,
    zero-padded), checksumming each chunk; -> (chunks, no blobs, size)."""
    arena = staged[0].arena
    assert arena is not None
    got, starts, size = storage.adopt(path, arena, [(s.offset, len(s.data)) for s in staged])
    chunks = [
        fmt.ChunkRecord(s.item.fqn, s.item.dtype, s.item.global_shape, s.item.region.offsets,
                        s.item.region.lengths, path, start, len(s.data), x.crc, x.blocks)
        for s, x, start in zip(staged, got, starts, strict=True)
    ]
    return chunks, [], size


def write_data_files(
    storage: Storage,
    save_id: str,
    rank: int,
    staged: Sequence[Staged],
    objects: dict[str, Any],
    per_rank: dict[str, Any],
    *,
    io_threads: int,
    allow_pickle: bool,
    first_file: int = 0,
    data: dict[str, dict[str, Any]] | None = None,
) -> RankOutput:
    """(every rank) Write data files ``first_file``, ``first_file+1``... of this
    rank (one per writer thread) holding ``staged`` and the blobs of
    ``objects``/``per_rank``; JSON-able values become inline records. The
    data positions of ``per_rank``'s loaders (``data``) go to the commit as
    JSON text (alike on most ranks: the coordinator groups them by text)."""
    out = RankOutput(data={k: json.dumps(v, sort_keys=True, separators=(",", ":")) for k, v in (data or {}).items()})
    blobs: list[_Blob] = []
    pickled: set[tuple[str, str]] = set()
    for table, values in (("obj", objects), ("rank", per_rank)):
        records = out.objects if table == "obj" else out.per_rank
        for fqn, value in values.items():
            s = serialize(fqn, value, allow_pickle)
            if s.blob is None:
                records[fqn] = fmt.ObjectRecord(json=s.json)
            else:
                blobs.append((table, fqn, s.blob))
                if s.pickle:
                    pickled.add((table, fqn))

    lent: dict[int, list[Staged]] = {}  # boxes in a lent arena: the arena becomes the file
    for st in staged:
        if st.arena is not None:
            lent.setdefault(id(st.arena), []).append(st)
    rest = [st for st in staged if st.arena is None]
    groups = _split_files(rest, blobs, io_threads) if rest or blobs else []
    jobs: list[tuple[str, Any]] = [(fmt.data_file(save_id, rank, first_file + i), g)
                                   for i, g in enumerate([*lent.values(), *groups])]

    def run(job: tuple[str, Any]) -> tuple[list[fmt.ChunkRecord], list[tuple[_Blob, int, int]], int]:
        path, group = job
        if isinstance(group, list):
            return _adopt_one_file(storage, path, group)
        return _write_one_file(storage, path, *group)

    if len(jobs) <= 1:
        results = [run(job) for job in jobs]
    else:
        with concurrent.futures.ThreadPoolExecutor(len(jobs), "bytecp-write", initializer=serial_torch) as ex:
            results = list(ex.map(run, jobs))
    for guard, token in {s.use for s in staged if s.use is not None}:  # written: nothing reads the arena now
        if guard.token() == token:
            faults.handoff("release")
            guard.release()
    for (path, _), (chunks, placed, size) in zip(jobs, results, strict=True):
        out.chunks.extend(chunks)
        out.data_files[path] = size
        for (table, fqn, blob), offset, crc in placed:
            rec = fmt.ObjectRecord(file=path, byte_offset=offset, nbytes=len(blob), crc32c=crc,
                                   pickle=(table, fqn) in pickled)
            (out.objects if table == "obj" else out.per_rank)[fqn] = rec
    return out


#: up to this many ranks, every rank's chunk records also go to the
#: coordinator, which checks that together they tile every tensor exactly;
#: beyond, each rank checks its own (:func:`bytecp.format.parts_build.build_part`)
#: and the coordinator receives a few part entries per rank
EXACT_CHECK_RANKS = 1024


def for_commit(out: RankOutput, storage: Storage, tensors: Mapping[str, Mapping[str, Any]], save_id: str,
               rank: int, world_size: int) -> RankOutput:
    """(every rank, at commit, before the gather) Check this rank's chunks
    (of the tensors ``tensors`` it describes), write its index part and
    return the output as sent to the coordinator: the part's entries, and
    up to :data:`EXACT_CHECK_RANKS` ranks the chunk records as columns."""
    batch = ChunkBatch.of(out.chunks)
    part = build_part(batch, tensors, out.data_files, save_id, rank, buckets_for(world_size))
    if part.blobs:
        storage.write_file(part_file(save_id, rank), part.blobs)
    return dataclasses.replace(out, chunks=[], batch=batch.without_blocks() if world_size <= EXACT_CHECK_RANKS else None,
                               part=part.entries.encode())
