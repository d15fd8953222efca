"""The pure range planning of storage/_ranges.py: parallel chunks of one read
and coalescing of nearby reads (part planning is tested in test_storage_s3.py)."""

from __future__ import annotations

from bytecp.storage._ranges import chunks, coalesce


def _v(n: int) -> memoryview:
    return memoryview(bytearray(n))


def test_chunks_cover_the_range_in_steps() -> None:
    assert chunks(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunks(8, 4) == [(0, 4), (4, 8)]
    assert chunks(0, 4) == []


def test_coalesce_merges_near_reads_up_to_the_span_limit() -> None:
    a, b, c, d = _v(10), _v(10), _v(10), _v(10)
    # b follows a after a gap of 5: merged; c would stretch that span past 30 bytes;
    # d lies 50 bytes past c, beyond the gap of 20
    spans, large = coalesce([(15, b), (0, a), (28, c), (88, d)], gap=20, max_span=30)
    assert large == []
    assert [(s, e, [off for off, _ in parts]) for s, e, parts in spans] == [
        (0, 25, [0, 15]),
        (28, 38, [28]),
        (88, 98, [88]),
    ]
    assert spans[0][2][1][1] is b


def test_coalesce_keeps_large_overlapping_and_empty_reads_apart() -> None:
    big, x, y = _v(100), _v(10), _v(10)
    spans, large = coalesce([(0, big), (500, x), (505, y), (600, _v(0))], gap=20, max_span=100)
    assert large == [(0, big)]
    assert [(s, e) for s, e, _ in spans] == [(500, 510), (505, 515)]
