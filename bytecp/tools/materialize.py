"""``bytecp materialize CK OUT``: a self-contained copy of a checkpoint that
references others (format version 3).

One process. The checkpoint is opened (its references checked), every data
file it reads -- its own and those it references in other checkpoints of
the run -- is copied into ``OUT`` under its own name (``data/<save_id>/...``:
save ids are unique, so names never clash), the index is rebuilt with rows
naming the copies, and ``metadata.json`` without references is committed
last. Bytes are copied as they are (checksums unchanged); each chunk's
crc32c is checked on the way and its block checksums computed (the copy is
of the current format version, which records them: a copy of a version-4
checkpoint gains them), so the copy loads, verifies and exports without
the run beside it.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterator, Sequence

from bytecp.errors import CheckpointExistsError, CorruptCheckpointError
from bytecp.format import metadata as fmt
from bytecp.format.checksum import Summer
from bytecp.format.parts_build import build_whole
from bytecp.loading.opened import open_checkpoint
from bytecp.storage_api import Storage
from bytecp.tools.progress import NO_PROGRESS, Progress
from bytecp.tree.regions import Region

__all__ = ["materialize", "COPY_PIECE"]

#: bytes copied per read (memory: about one piece)
COPY_PIECE = 64 << 20


def _own(path: str) -> str:
    """``../<name>/data/<save_id>/<file>`` -> ``data/<save_id>/<file>``."""
    return path.split("/", 2)[2] if path.startswith("../") else path


def _pieces(src: Storage, path: str, size: int, progress: Progress, rows: Sequence[fmt.ChunkRecord],
            summers: dict[fmt.ChunkRecord, Summer]) -> Iterator[bytes]:
    """The file's bytes in pieces, each chunk of ``rows`` (this file's, by
    offset) summed on the way into ``summers``."""
    starts = [r.byte_offset for r in rows]
    for off in range(0, size, COPY_PIECE):
        data = src.read_bytes(path, off, min(COPY_PIECE, size - off))
        end = off + len(data)
        view = memoryview(data)
        k = max(0, bisect.bisect_right(starts, off) - 1)
        while k < len(rows) and rows[k].byte_offset < end:
            r = rows[k]
            lo, hi = max(off, r.byte_offset), min(end, r.byte_offset + r.nbytes)
            if lo < hi:
                summers.setdefault(r, Summer()).update(view[lo - off : hi - off])
            k += 1
        progress.advance(len(data))
        yield data


def _summed(rows: Sequence[fmt.ChunkRecord], summers: dict[fmt.ChunkRecord, Summer], where: str,
            ) -> list[fmt.ChunkRecord]:
    """The rows with their block checksums, each chunk's crc32c checked against the bytes copied."""
    out = []
    for r in rows:
        got = summers[r].result() if r in summers else Summer().result()
        if got.crc != r.crc32c:
            raise CorruptCheckpointError(f"{where}/{r.file}: checksum mismatch in tensor {r.fqn!r} region "
                                         f"{Region(r.offsets, r.lengths)} (bytes "
                                         f"{r.byte_offset}..{r.byte_offset + r.nbytes}); nothing was committed")
        out.append(dataclasses.replace(r, file=_own(r.file), blocks=got.blocks))
    return out


def materialize(src: Storage, out: Storage, *, overwrite: bool = False,
                progress: Progress = NO_PROGRESS) -> fmt.Metadata:
    """Copy the checkpoint at ``src`` to ``out`` with every referenced byte
    inside it; returns the new metadata (same save id, no references)."""
    opened = open_checkpoint(src)
    opened.check_sizes()
    md, rows = opened.metadata, opened.all_rows()
    if out.exists(fmt.METADATA_FILE) and not overwrite:
        raise CheckpointExistsError(f"{out.url} already holds a committed checkpoint; pass --overwrite to replace it")
    progress.start(sum(md.data_files.values()))
    by_file: dict[str, list[fmt.ChunkRecord]] = {}
    for r in sorted(rows, key=lambda r: r.byte_offset):
        by_file.setdefault(r.file, []).append(r)
    summers: dict[fmt.ChunkRecord, Summer] = {}
    for path, size in md.data_files.items():
        out.write_stream(_own(path), _pieces(opened.storage, path, size, progress, by_file.get(path, []), summers),
                         size_hint=size)
    rows = _summed(rows, summers, opened.storage.url.rstrip("/"))
    files = {_own(p): n for p, n in md.data_files.items()}
    tensors = {k: {x: y for x, y in v.items() if x != "band_dim"} for k, v in md.tensors.items()}
    index_files, directory = build_whole(rows, tensors, files, md.save_id)
    new = dataclasses.replace(md, data_files=files, references={}, tensors=tensors, index=directory,
                              index_files=[], format_version=fmt.FORMAT_VERSION)
    for path, blobs in index_files.items():
        out.write_file(path, blobs)
    out.commit(fmt.METADATA_FILE, new.to_bytes(), exclusive=not overwrite)
    return new
