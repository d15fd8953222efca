"""One rank's chunk records as columns: what the save's commit gathers.

Built by every rank after its write phase (:meth:`ChunkBatch.of`) and sent
once to the coordinator in the commit's gather, which concatenates every
rank's batch into the global index (:mod:`bytecp.format.index_build`). Tensor names
travel as 64-bit hashes (:func:`fqn_hash`): a rank sends about 60 bytes per
chunk, and the coordinator maps hashes back to the names it knows. Nothing
here is stored; the stored form is the index of docs/FORMAT.md.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import operator
from collections.abc import Sequence

import numpy as np

from bytecp.format.metadata import ChunkRecord

__all__ = ["ChunkBatch", "fqn_hash", "fqn_hashes"]

_FQN, _FILE, _OFFSETS, _LENGTHS = (operator.attrgetter(a) for a in ("fqn", "file", "offsets", "lengths"))
_BYTE_OFFSET, _NBYTES, _CRC, _BLOCKS = (operator.attrgetter(a) for a in ("byte_offset", "nbytes", "crc32c", "blocks"))


@functools.lru_cache(maxsize=1 << 16)
def fqn_hash(fqn: str) -> int:
    """A 64-bit digest of a tensor name (the same on every rank and process)."""
    return int.from_bytes(hashlib.blake2b(fqn.encode(), digest_size=8).digest(), "little")


def fqn_hashes(names: Sequence[str]) -> np.ndarray:
    """:func:`fqn_hash` of every name (uint64), without its cache: the
    coordinator hashes every tensor of the state, more than the cache holds."""
    digests = b"".join(hashlib.blake2b(n.encode(), digest_size=8).digest() for n in names)
    return np.frombuffer(digests, "<u8").astype(np.uint64)


@dataclasses.dataclass
class ChunkBatch:
    """Chunk records of one rank, one array element per chunk.

    ``offsets``/``lengths`` hold each chunk's ``ndim`` values one after the
    other; ``file`` indexes ``files``; ``blocks`` each chunk's block checksums
    (``nblocks`` of them) one chunk after the other: they stay on the rank
    (its index part), the commit's gather sends the batch :meth:`without_blocks`.
    """

    fqn_hash: np.ndarray  # uint64
    ndim: np.ndarray  # uint8
    offsets: np.ndarray  # int64, concatenated
    lengths: np.ndarray  # int64, concatenated
    file: np.ndarray  # int32, index into files
    files: list[str]
    byte_offset: np.ndarray  # int64
    nbytes: np.ndarray  # int64
    crc32c: np.ndarray  # uint32
    nblocks: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))  # int64
    blocks: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.uint32))  # uint32, concatenated

    def __len__(self) -> int:
        return len(self.fqn_hash)

    @classmethod
    def of(cls, chunks: Sequence[ChunkRecord]) -> ChunkBatch:
        """(every rank, before the commit) The columns of ``chunks`` (each read with
        ``map`` and ``attrgetter``, which run in C: tens of thousands of chunks
        on a MoE rank, on every save)."""
        n = len(chunks)
        files: dict[str, int] = {}
        file_ids = [files.setdefault(f, len(files)) for f in map(_FILE, chunks)]
        chain = itertools.chain.from_iterable
        return cls(
            fqn_hash=np.fromiter(map(fqn_hash, map(_FQN, chunks)), np.uint64, n),
            ndim=np.fromiter(map(len, map(_OFFSETS, chunks)), np.uint8, n),
            offsets=np.fromiter(chain(map(_OFFSETS, chunks)), np.int64),
            lengths=np.fromiter(chain(map(_LENGTHS, chunks)), np.int64),
            file=np.asarray(file_ids, dtype=np.int32),
            files=list(files),
            byte_offset=np.fromiter(map(_BYTE_OFFSET, chunks), np.int64, n),
            nbytes=np.fromiter(map(_NBYTES, chunks), np.int64, n),
            crc32c=np.fromiter(map(_CRC, chunks), np.uint32, n),
            nblocks=np.fromiter(map(len, map(_BLOCKS, chunks)), np.int64, n) // 4,
            blocks=np.frombuffer(b"".join(map(_BLOCKS, chunks)), "<u4").astype(np.uint32),
        )

    def without_blocks(self) -> ChunkBatch:
        """The batch as the commit's gather sends it (the coordinator checks boxes, not block checksums)."""
        return dataclasses.replace(self, nblocks=np.zeros(len(self), np.int64), blocks=np.zeros(0, np.uint32))

    def block_starts(self) -> np.ndarray:
        """Where each chunk's block checksums start in ``blocks`` (and, last, their count)."""
        out = np.zeros(len(self) + 1, np.int64)
        np.cumsum(self.nblocks, out=out[1:])
        return out

    @classmethod
    def empty(cls) -> ChunkBatch:
        return cls.of([])
