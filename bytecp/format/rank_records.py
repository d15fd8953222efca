"""One per-rank value's records (``metadata.json`` ``per_rank[fqn]``: saved rank
-> object record) as a mapping that crosses a broadcast compactly.

Why: a load's coordinator parses ``metadata.json`` and broadcasts the parsed
metadata; every rank unpickles it. A data loader saved by W ranks has W
records there (4.2 MB of JSON at 16,384 ranks for torchdata's states), each
an :class:`ObjectRecord` around a nested dict: unpickling them cost every
loading rank 0.6-0.9 s at 16,384 ranks (``benchmarks/scale_data.py``),
though a rank uses one or two of them. :class:`RankRecords` pickles as one
compact JSON text per record and decodes a record only when a rank asks
for it: a loading rank then receives W short byte strings and decodes what
it reads. Nothing changes on storage (FORMAT.md §6.3).

Built by ``Metadata.from_bytes`` (the coordinator: every record decoded,
as validation needs); used through the ``Mapping`` interface everywhere.
"""

from __future__ import annotations

import json
import zlib
from array import array
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, TypeVar

__all__ = ["RankRecords"]


class _Record(Protocol):
    def to_json(self) -> dict[str, Any]: ...


R = TypeVar("R", bound=_Record)


class RankRecords(Mapping[int, R]):
    """Saved rank -> its record, decoded on first access after a broadcast.

    Pickled as the ranks (their count when they are ``0..n-1``), the
    records' compact JSON texts one after the other, zlib-compressed (alike
    records compress well), and their end offsets; a received table
    decompresses the texts once, on its first look-up, and decodes only the
    records asked for. ``decode`` makes a record from its JSON
    (``ObjectRecord.from_json``; pickled by reference)."""

    __slots__ = ("_ranks", "_packed", "_texts", "_ends", "_decoded", "_decode")

    def __init__(self, records: Mapping[int, R], decode: Callable[[dict[str, Any]], R]) -> None:
        self._ranks: tuple[int, ...] | range = tuple(records)
        self._packed: bytes | None = None  # compressed texts (a received table, before its first look-up)
        self._texts: bytes | None = None
        self._ends: array[int] | None = None
        self._decoded: dict[int, R] = dict(records)
        self._decode = decode

    @classmethod
    def _received(cls, ranks: int | tuple[int, ...], packed: bytes, ends: bytes,
                  decode: Callable[[dict[str, Any]], R]) -> RankRecords[R]:
        out: RankRecords[R] = cls.__new__(cls)
        out._ranks = range(ranks) if isinstance(ranks, int) else ranks
        out._packed, out._texts, out._decoded, out._decode = packed, None, {}, decode
        out._ends = array("Q")
        out._ends.frombytes(ends)
        return out

    def __reduce__(self) -> tuple[Any, ...]:
        ranks = self._ranks
        if self._ends is not None:
            packed = self._packed if self._packed is not None else zlib.compress(self._texts or b"", 1)
            ends = self._ends
        else:
            texts = [json.dumps(self._decoded[r].to_json(), separators=(",", ":")).encode() for r in ranks]
            ends, n = array("Q"), 0
            for t in texts:
                n += len(t)
                ends.append(n)
            packed = zlib.compress(b"".join(texts), 1)
        count: int | tuple[int, ...] = len(ranks) if list(ranks) == list(range(len(ranks))) else tuple(ranks)
        return (RankRecords._received, (count, packed, ends.tobytes(), self._decode))

    def __getitem__(self, rank: int) -> R:
        got = self._decoded.get(rank)
        if got is not None:
            return got
        if self._ends is None:
            raise KeyError(rank)
        ranks = self._ranks
        if isinstance(rank, int) and 0 <= rank < len(ranks) and ranks[rank] == rank:
            i = rank  # every rank recorded, in order: the usual table
        else:
            try:
                i = ranks.index(rank)
            except ValueError:
                raise KeyError(rank) from None
        if self._texts is None:
            self._texts = zlib.decompress(self._packed or b"")
            self._packed = None
        start = self._ends[i - 1] if i else 0
        got = self._decoded[rank] = self._decode(json.loads(self._texts[start:self._ends[i]]))
        return got

    def __iter__(self) -> Iterator[int]:
        return iter(self._ranks)

    def __len__(self) -> int:
        return len(self._ranks)

    def __contains__(self, rank: object) -> bool:
        return rank in self._decoded or (self._ends is not None and rank in self._ranks)

    def __repr__(self) -> str:
        return f"RankRecords({len(self._ranks)} ranks)"
