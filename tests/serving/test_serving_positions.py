"""The serving deltas' position encoding (gaps as LEB128 varints): every
decoder path (gaps of one byte only, of one or two bytes, longer) gives back
exactly the positions encoded, and damaged position bytes are refused with
a CorruptCheckpointError naming where, never decoded into other positions."""

from __future__ import annotations

import numpy as np
import pytest

from bytecp.errors import CorruptCheckpointError
from bytecp.format import serving_wire as wire


@pytest.mark.parametrize("numel,count", [(1, 1), (100, 1), (100, 100), (100, 7), (20_000, 900), (2_400_000, 16_000),
                                         (2_400_000, 3), (1 << 40, 50)])
def test_positions_come_back_exactly(numel: int, count: int) -> None:
    rng = np.random.default_rng(numel + count)
    if numel > 1 << 31:  # sparse in a huge box: gaps of many bytes
        p = np.unique(rng.integers(0, numel, count, dtype=np.int64))
    else:
        p = np.sort(rng.choice(numel, count, replace=False)).astype(np.int64)
    raw = wire.encode_positions(p)
    assert np.array_equal(wire.decode_positions(raw, len(p), numel, "t"), p)


@pytest.mark.parametrize("gaps", [[0] + [1] * 50, [5] + [127] * 10, [0] + [128] * 10, [3, 200, 1, 16383, 2, 130],
                                  [0, 16384, 1, 2], [7, 1 << 21, 128, 1]])
def test_each_decoder_path_at_its_edges(gaps: list[int]) -> None:
    p = np.cumsum(np.array(gaps, dtype=np.int64))
    raw = wire.encode_positions(p)
    assert np.array_equal(wire.decode_positions(raw, len(p), int(p[-1]) + 1, "t"), p)


def test_damaged_position_bytes_are_refused() -> None:
    p = np.array([3, 200, 201, 16000, 16001], dtype=np.int64)  # gaps of one and two bytes
    raw = bytearray(wire.encode_positions(p))
    with pytest.raises(CorruptCheckpointError, match="^here: "):
        wire.decode_positions(bytes(raw), len(p), 16001, "here")  # the last position lies outside the box
    with pytest.raises(CorruptCheckpointError, match="^here: "):
        wire.decode_positions(bytes(raw), len(p) + 1, 20000, "here")  # fewer values than counted
    with pytest.raises(CorruptCheckpointError, match="^here: "):
        wire.decode_positions(bytes(raw[:-1]) + b"\x80", len(p), 20000, "here")  # ends inside a value
    with pytest.raises(CorruptCheckpointError, match="^here: "):
        wire.decode_positions(bytes([5, 0, 1]), 3, 100, "here")  # a gap of 0: not strictly increasing
    with pytest.raises(CorruptCheckpointError, match="^here: "):
        wire.decode_positions(b"\x01", 0, 100, "here")  # bytes for no position
