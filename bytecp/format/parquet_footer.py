"""Our own bounded reading of a Parquet footer (Thrift compact protocol).

Called by :func:`bytecp.format.limits.check_index_metadata` before an index file
or segment is decoded: pyarrow aborts the process (an uncaught C++
exception) when a damaged footer's column-chunk metadata is accessed through
its Python API, so the numbers the budget needs -- rows per row group,
values and decoded bytes per column chunk -- are read here, with every
length checked against the bytes there are.
"""

from __future__ import annotations

from typing import Any

from bytecp.errors import CorruptCheckpointError, one_line

__all__ = ["footer_row_groups"]

# Parquet's footer is a Thrift (compact protocol) FileMetaData struct; only
# row_groups[*].num_rows and their columns' meta_data num_values /
# total_uncompressed_size are needed.
_T_STOP, _T_TRUE, _T_FALSE, _T_BYTE, _T_I16, _T_I32, _T_I64, _T_DOUBLE = 0, 1, 2, 3, 4, 5, 6, 7
_T_BINARY, _T_LIST, _T_SET, _T_MAP, _T_STRUCT, _T_UUID = 8, 9, 10, 11, 12, 13


class _Thrift:
    """A bounded reader of Thrift compact-protocol values into plain Python values."""

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.pos = 0

    def byte(self) -> int:
        if self.pos >= len(self.buf):
            raise ValueError("footer ends early")
        b = self.buf[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        shift = out = 0
        while True:
            b = self.byte()
            out |= (b & 0x7F) << shift
            if not b & 0x80:
                return out
            shift += 7
            if shift > 70:
                raise ValueError("varint too long")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise ValueError("footer ends early")
        self.pos += n

    def value(self, t: int, depth: int) -> Any:
        if depth > 32:
            raise ValueError("footer nested too deeply")
        if t in (_T_TRUE, _T_FALSE):
            return t == _T_TRUE
        if t == _T_BYTE:
            return self.byte()
        if t in (_T_I16, _T_I32, _T_I64):
            return self.zigzag()
        if t == _T_DOUBLE:
            self.skip(8)
            return None
        if t == _T_UUID:
            self.skip(16)
            return None
        if t == _T_BINARY:
            self.skip(self.varint())
            return None
        if t in (_T_LIST, _T_SET):
            head = self.byte()
            size, et = head >> 4, head & 0x0F
            if size == 15:
                size = self.varint()
            if size > len(self.buf) - self.pos:  # every element takes at least a byte
                raise ValueError("list longer than the footer")
            if et in (_T_TRUE, _T_FALSE):  # booleans in lists take one byte each
                self.skip(size)
                return [None] * size
            return [self.value(et, depth + 1) for _ in range(size)]
        if t == _T_MAP:
            size = self.varint()
            if size > len(self.buf) - self.pos:
                raise ValueError("map longer than the footer")
            if size:
                kv = self.byte()
                for _ in range(size):
                    self.value(kv >> 4, depth + 1)
                    self.value(kv & 0x0F, depth + 1)
            return None
        if t == _T_STRUCT:
            return self.struct(depth + 1)
        raise ValueError(f"unknown Thrift type {t}")

    def struct(self, depth: int = 0) -> dict[int, Any]:
        out: dict[int, Any] = {}
        fid = 0
        while True:
            head = self.byte()
            t = head & 0x0F
            if t == _T_STOP:
                return out
            delta = head >> 4
            fid = fid + delta if delta else self.zigzag()
            out[fid] = self.value(t, depth)


def footer_row_groups(name: str, data: bytes | bytearray) -> list[tuple[int, list[tuple[int, int]]]]:
    """``[(num_rows, [(num_values, total_uncompressed_size) per column])]`` per row group."""
    try:
        if len(data) < 12 or data[-4:] != b"PAR1":
            raise ValueError("not a Parquet file (no PAR1 trailer)")
        n = int.from_bytes(data[-8:-4], "little")
        if n <= 0 or n > len(data) - 12:
            raise ValueError(f"footer length {n} does not fit the file")
        meta = _Thrift(bytes(data[-8 - n : -8])).struct()  # (the footer alone)
        out = []
        for rg in meta.get(4) or []:
            if not isinstance(rg, dict):
                raise ValueError("malformed row group")
            cols = []
            for cc in rg.get(1) or []:
                md = cc.get(3) if isinstance(cc, dict) else None
                if not isinstance(md, dict):
                    raise ValueError("column chunk without metadata")
                cols.append((int(md.get(5) or 0), int(md.get(6) or 0)))
            out.append((int(rg.get(3) or 0), cols))
        return out
    except (ValueError, TypeError, AttributeError) as e:
        raise CorruptCheckpointError(f"index file {name}: the Parquet footer is unreadable ({one_line(e)})") from e
