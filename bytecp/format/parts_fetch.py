"""The bytes of a version-4 index's segments, read part by part (docs/FORMAT.md section 5.6).

Called by :func:`bytecp.format.parts_read.read_parts` (every loading rank,
the segments its targets meet) and :func:`bytecp.format.parts_stream.iter_parts`
(``inspect``/``verify``: every segment), which hand each part's bytes to
their decoder in rank order. How they are read depends on the storage:

- remote (S3, HDFS): :data:`PART_READERS` parts at once, a request each, so
  a rank reading a segment of 2,058 parts does not wait 2,058 round trips
  one after another;
- a local disk: in batches of up to :data:`BATCH_BYTES`, one request each
  (``Storage.read_files``): a local request is bounded by a worker thread
  (the ``request_timeout`` option), and a thread hand-off per part cost
  more than its read (0.13 ms against 0.015 ms).

Memory: the bytes of one batch (or of the parts being read at once), never
of every segment; a damaged part is refused naming it, the lowest rank's
first whatever order the reads end in.
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from bytecp.errors import CorruptCheckpointError, StorageError, TransientStorageError
from bytecp.format.parts_schema import PartsDirectory, check_spans, part_file
from bytecp.storage_api import Storage

__all__ = ["Segment", "PART_READERS", "BATCH_BYTES", "by_part", "each_part", "read"]

#: one segment to read: (rank, offset, nbytes, rows, crc32c, band lo, band hi, the names its wide entries
#: read cover: their ``first`` ascending and, for each, the greatest ``last`` up to it (see
#: :func:`bytecp.format.segment_keep.keep`))
Segment = tuple[int, int, int, int, int, int, int, tuple[list[str], list[str]]]

#: parts one rank reads at once from a remote storage (a rank loading replicated experts reads a segment of
#: each holder's part: 2,058 at 131,072 ranks for an EP-64 MoE, a round trip each one at a time); a local
#: disk's reads take microseconds, and threads there only contend for the interpreter
PART_READERS = 16
#: bytes of segments read from a local disk in one request
BATCH_BYTES = 8 << 20

T = TypeVar("T")
Decode = Callable[[int, list[Segment], list[bytearray]], T]


def by_part(segments: list[Segment]) -> list[tuple[int, list[Segment]]]:
    """The segments grouped by the part (rank) they lie in, ranks ascending."""
    out: dict[int, list[Segment]] = defaultdict(list)
    for seg in segments:
        out[seg[0]].append(seg)
    return sorted(out.items())


def each_part(storage: Storage, d: PartsDirectory, parts: list[tuple[int, list[Segment]]], where: str,
              decode: Decode[T]) -> Iterator[T]:
    """``decode(rank, segments, their bytes)`` of each of ``parts``, in their order."""
    if storage.remote:
        return _at_once(parts, PART_READERS, lambda rank, mine: decode(rank, mine, _fetch(storage, d, rank, mine, where)))
    return _batched(storage, d, parts, where, decode)


def read(storage: Storage, path: str, spans: Sequence[tuple[int, int]], what: str) -> list[bytearray]:
    """The ``(offset, nbytes)`` spans of ``path``, in one request; a missing or short file is a corrupt index
    (a transient storage error is raised as it is)."""
    bufs = [bytearray(n) for _, n in spans]
    try:
        storage.read_ranges(path, [(off, memoryview(b)) for (off, _), b in zip(spans, bufs, strict=True)])
    except TransientStorageError:
        raise  # (a timeout or a dropped connection, not a damaged index: the caller may retry)
    except (FileNotFoundError, StorageError) as e:
        raise CorruptCheckpointError(f"{what} named in metadata.json is missing or short ({e})") from e
    return bufs


def _spans(d: PartsDirectory, rank: int, segments: list[Segment], where: str) -> list[tuple[int, int]]:
    """The byte spans of a part's ``segments``, refused if two overlap or one lies past the part's end."""
    check_spans([s[1] for s in segments], [s[2] for s in segments], d.part_size(rank) or 0,
                lambda why: CorruptCheckpointError(f"{where}/{part_file(d.save_id, rank)}: the directory places two "
                                                   f"segments {why}"))
    return [(s[1], s[2]) for s in segments]


def _fetch(storage: Storage, d: PartsDirectory, rank: int, segments: list[Segment], where: str) -> list[bytearray]:
    path = part_file(d.save_id, rank)
    return read(storage, path, _spans(d, rank, segments, where), f"{where}: index part {path}")


def _at_once(parts: list[tuple[int, list[Segment]]], width: int,
             run: Callable[[int, list[Segment]], T]) -> Iterator[T]:
    """``run`` of each part, in ``parts``' order, up to ``width`` at once and at most
    ``2 * width`` done ahead of the caller (a streaming reader holds that many parts);
    the first failure in that order is raised once the running reads end, the others cancelled."""
    if len(parts) < 2 or width < 2:
        yield from (run(rank, mine) for rank, mine in parts)
        return
    ex = concurrent.futures.ThreadPoolExecutor(min(width, len(parts)), "bytecp-index")
    ahead: collections.deque[concurrent.futures.Future[T]] = collections.deque()
    try:
        for rank, mine in parts:
            ahead.append(ex.submit(run, rank, mine))
            if len(ahead) > 2 * width:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


def _batched(storage: Storage, d: PartsDirectory, parts: list[tuple[int, list[Segment]]], where: str,
             decode: Decode[T]) -> Iterator[T]:
    """``decode`` of each part, read in batches of up to :data:`BATCH_BYTES` (one part at least), one request each;
    a batch that fails is read again a part at a time (its faults then come in rank order, as from remote)."""
    sizes = [sum(s[2] for s in mine) for _, mine in parts]
    i = 0
    while i < len(parts):
        j, size = i + 1, sizes[i]
        while j < len(parts) and size + sizes[j] <= BATCH_BYTES:
            size += sizes[j]
            j += 1
        try:
            batch = [(rank, mine, _spans(d, rank, mine, where)) for rank, mine in parts[i:j]]
            bufs = [[bytearray(n) for _, n in spans] for _, _, spans in batch]
            storage.read_files([(part_file(d.save_id, rank), [(off, memoryview(b)) for (off, _), b in
                                 zip(spans, got, strict=True)]) for (rank, _, spans), got in zip(batch, bufs, strict=True)])
        except (CorruptCheckpointError, FileNotFoundError, StorageError):
            # a fault in the batch: read it a part at a time, so that the lowest rank's fault is the one named
            yield from (decode(rank, mine, _fetch(storage, d, rank, mine, where)) for rank, mine in parts[i:j])
        else:
            yield from (decode(rank, mine, got) for (rank, mine, _), got in zip(batch, bufs, strict=True))
        i = j
