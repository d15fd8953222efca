"""Property tests for boxes and flat-range decomposition (brute force as oracle)."""

from __future__ import annotations

import itertools
import math

from hypothesis import given
from hypothesis import strategies as st

from bytecp.tree.regions import Region, element_span, flat_range_to_boxes, row_major_strides

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)


def flat_indices(shape: tuple[int, ...], box: Region) -> list[int]:
    strides = row_major_strides(shape)
    ranges = [range(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True)]
    return [sum(i * s for i, s in zip(idx, strides, strict=True)) for idx in itertools.product(*ranges)]


def box_in(shape: tuple[int, ...]) -> st.SearchStrategy[Region]:
    def one(d: int) -> st.SearchStrategy[tuple[int, int]]:
        return st.integers(0, d).flatmap(lambda o: st.integers(0, d - o).map(lambda n: (o, n)))

    return st.tuples(*[one(d) for d in shape]).map(
        lambda pairs: Region(tuple(p[0] for p in pairs), tuple(p[1] for p in pairs))
    )


@given(shapes.flatmap(lambda s: st.tuples(st.just(s), st.integers(0, math.prod(s)), st.integers(0, math.prod(s)))))
def test_flat_range_decomposition_covers_range_in_order(args: tuple) -> None:
    shape, a, b = args
    a, b = min(a, b), max(a, b)
    boxes = flat_range_to_boxes(shape, a, b)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    got: list[int] = []
    for box in boxes:
        idx = flat_indices(shape, box)
        # each box is contiguous in row-major order
        assert idx == list(range(idx[0], idx[0] + len(idx)))
        assert box.numel > 0
        got += idx
    assert got == list(range(a, b))


@given(shapes.flatmap(lambda s: st.tuples(st.just(s), box_in(s), box_in(s))))
def test_intersection_matches_brute_force(args: tuple) -> None:
    shape, b1, b2 = args
    inter = b1.intersect(b2)
    want = set(flat_indices(shape, b1)) & set(flat_indices(shape, b2))
    if inter is None:
        assert not want
    else:
        assert set(flat_indices(shape, inter)) == want
        assert b1.contains(inter) and b2.contains(inter)


@given(shapes.flatmap(lambda s: st.tuples(st.just(s), box_in(s))))
def test_element_span_bounds_the_box(args: tuple) -> None:
    shape, box = args
    first, end = element_span(box, shape)
    idx = flat_indices(shape, box)
    if not idx:
        assert (first, end) == (0, 0)
    else:
        assert (first, end) == (min(idx), max(idx) + 1)


@given(shapes.flatmap(lambda s: st.tuples(st.just(s), box_in(s), st.integers(1, 6))))
def test_split_partitions_the_box(args: tuple) -> None:
    shape, box, parts = args
    pieces = box.split(parts)
    assert len(pieces) <= max(parts, 1)
    got = sorted(i for p in pieces for i in flat_indices(shape, p))
    assert got == sorted(flat_indices(shape, box))


def test_zero_dim_and_errors() -> None:
    assert flat_range_to_boxes((), 0, 1) == [Region((), ())]
    assert flat_range_to_boxes((3, 4), 5, 5) == []
    try:
        flat_range_to_boxes((3, 4), 0, 13)
    except ValueError as e:
        assert "13" in str(e)
    else:  # pragma: no cover
        raise AssertionError("out-of-range flat range accepted")



def cells(r: Region) -> set[tuple[int, ...]]:
    return set(itertools.product(*[range(o, o + n) for o, n in zip(r.offsets, r.lengths, strict=True)]))


@given(st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple).flatmap(
    lambda shape: st.tuples(box_in(shape), box_in(shape))))
def test_subtract_leaves_exactly_the_elements_outside(boxes: tuple[Region, Region]) -> None:
    a, b = boxes
    parts = a.subtract(b)
    got = [cells(p) for p in parts]
    want = cells(a) - cells(b)
    assert all(p.numel for p in parts) and len(parts) <= 2 * max(1, a.ndim)
    assert sum(len(g) for g in got) == len(want) and set().union(*got) == want  # disjoint, exact
