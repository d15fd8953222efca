"""metadata.json read member by member (bytecp/format/members.py): the large
members made into what a reader keeps as each is read, with the same result,
and the same refusals, as reading the whole file with json.loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bytecp.errors import CorruptCheckpointError
from bytecp.format import json_head, members
from bytecp.format import metadata as fmt
from bytecp.format.tensor_table import TensorTable
from bytecp.tree.skeleton import Node, decode_compact

GOLDEN = Path(__file__).parent.parent / "golden"
V4 = sorted(GOLDEN.glob("v4/*/checkpoint/metadata.json"))


def _whole(monkeypatch: pytest.MonkeyPatch, data: bytes) -> Any:
    """What from_bytes makes of ``data`` when it reads it whole (json.loads)."""
    with monkeypatch.context() as m:
        m.setattr(fmt, "decode_members", lambda *a: None)
        return _outcome(data)


def _outcome(data: bytes) -> Any:
    try:
        md = fmt.Metadata.from_bytes(data, "ck")
    except CorruptCheckpointError as e:
        return str(e)
    return md.to_bytes(), [(leaf.kind, leaf.name) for leaf in md.skeleton.leaves()]


def _doc(path: Path) -> dict[str, Any]:
    d: dict[str, Any] = json.loads(path.read_bytes())
    return d


@pytest.mark.parametrize("path", V4, ids=lambda p: p.parent.parent.name)
def test_member_by_member_reads_what_json_loads_reads(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = path.read_bytes()
    assert json_head.decode_members(data, members.MEMBER_DECODERS) is not None  # (read member by member)
    got = _outcome(data)
    assert isinstance(got, tuple) and got == _whole(monkeypatch, data)
    md = fmt.Metadata.from_bytes(data, "ck")
    assert isinstance(md.tensors, TensorTable)
    for leaf in md.skeleton.leaves():  # a tensor leaf keeps the table's own string
        if leaf.kind == "tensor":
            assert leaf.name is md.tensors.names[md.tensors.names.index(leaf.name)]


def test_a_member_named_twice_is_read_as_json_loads_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    data = V4[0].read_bytes()
    d = _doc(V4[0])
    assert json_head.decode_members(data[:-1] + b',"x":1,"x":2}', {}) is None  # (then read whole)
    # the last of two wins: a first tensors table that does not fit is replaced by the real one
    first = {"names": ["a"], "dtypes": ["float32"], "dtype": [0], "ndim": [0], "dims": []}
    text = data.decode()
    twice = text.replace('"tensors":', '"tensors":' + json.dumps(first) + ',"tensors":', 1).encode()
    got = fmt.Metadata.from_bytes(twice, "ck")
    assert list(got.tensors) == d["tensors"]["names"] and _outcome(twice) == _whole(monkeypatch, twice)
    # and the other way round: a valid table followed by one the skeleton does not fit
    later = (text[:-1] + ',"tensors":' + json.dumps(first) + "}").encode()
    assert "skeleton names tensor" in _outcome(later) and _outcome(later) == _whole(monkeypatch, later)
    # a header member named again after the others, with another value, is refused, as before
    d = {**{k: d.get(k, {}) for k in json_head.HEADER_KEYS}, **d}  # (references in the header)
    text = json.dumps(d, separators=(",", ":"))
    assert fmt.Metadata.from_bytes(text.encode(), "ck").step == d["step"]
    header_again = (text[:-1] + ',"step":' + json.dumps(d["step"] + 1) + "}").encode()
    assert _outcome(header_again) == _whole(monkeypatch, header_again)
    with pytest.raises(CorruptCheckpointError, match="names a header member twice or after its other members"):
        fmt.Metadata.from_bytes(header_again, "ck")


@pytest.mark.parametrize("edit", [
    lambda t: t + "x",  # not JSON after the object
    lambda t: t[:-1],  # cut off
    lambda t: "\ufeff" + t,  # a byte order mark in the text
    lambda t: "[" + t + "]",  # not an object
    lambda t: t.replace('"skeleton":{', '"skeleton":{"k":[1.5],"v":["T"],"x":', 1),
    lambda t: t.replace('"skeleton":{', '"skeleton":{"q":', 1),
    lambda t: t.replace('"dims":[', '"dims":[-1,', 1),
    lambda t: t.replace('"layout":"parts"', '"layout":"x"', 1),
    lambda t: t.replace('"data_files":{', '"data_files":{"data/a/b.bin":"12",', 1),
    lambda t: t.replace('"data_files":{', '"data_files":{"../x/0.bin":1,', 1),
])
def test_faults_are_named_as_when_read_whole(edit: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    for path in V4:
        data = edit(path.read_text()).encode()
        assert _outcome(data) == _whole(monkeypatch, data)


SKELETONS: list[Any] = [
    "T",
    {"k": [], "v": []},
    {"k": ["a", "b", 3, None, True], "v": ["T", "O", "R", {"l": ["T", {"t": ["O"]}]}, {"k": ["x"], "v": ["T"]}]},
    {"k": ["m"], "v": [{"k": ["s", "e"], "v": [{"k": ["step", "e"], "v": ["T", "T"]}, {"l": []}]}]},
    {"k": ["deep"], "v": [{"l": [{"l": [{"t": ["T", "T"]}]}]}]},
]
NOT_COMPACT: list[Any] = [
    {"d": [["a", "T"]]},  # versions 1-3
    {"k": ["a"], "v": [{"tensor": "x"}]},  # the long leaf form
    {"k": ["a"], "v": ["X"]},
    {"k": ["a", "b"], "v": ["T"]},
    {"k": [1.5], "v": ["T"]},
    {"k": [["a"]], "v": ["T"]},
    {"k": ["a"], "v": [3]},
    {"l": "T"},
    {"k": ["a"], "v": ["T"], "x": 1},
    [],
    "Q",
]


def test_the_skeleton_read_as_its_json_is_read_is_the_one_from_json_makes() -> None:
    names = ["a", "x", "m.s.step", "deep.0.0.1"]
    table = TensorTable.from_json({"names": names, "dtypes": ["float32"], "dtype": [0] * 4, "ndim": [0] * 4,
                                   "dims": []}, "ck")
    for doc in SKELETONS:
        text = " " + json.dumps(doc) + ",9"
        node, end = decode_compact(text, 1, table.shared)
        assert node is not None and text[end:] == ",9"
        want = Node.from_json(doc, "ck", table.shared)
        assert node == want and [(x.kind, x.name) for x in node.leaves()] == [(x.kind, x.name) for x in want.leaves()]
        for leaf, other in zip(node.leaves(), want.leaves(), strict=True):  # a dict's leaf keeps the table's string
            assert (leaf.name is table.shared(leaf.name)) == (other.name is table.shared(other.name))
    node, _ = decode_compact(json.dumps(SKELETONS[3]), 0, table.shared)
    assert node is not None and [leaf.name for leaf in node.leaves()][0] is names[2]  # (not a copy)
    for doc in NOT_COMPACT:
        assert decode_compact(json.dumps(doc), 0, table.shared) == (None, 0)
    deep: Any = "T"
    for _ in range(300):  # deeper than MAX_DEPTH: from_json names it
        deep = {"l": [deep]}
    assert decode_compact(json.dumps(deep), 0) == (None, 0)
    with pytest.raises(ValueError):
        decode_compact('{"k": ["a"], "v": ["T"', 0)


def test_a_tensor_table_numbers_its_rows_when_first_asked() -> None:
    names = ["w", "b", "s"]
    table = TensorTable.from_json({"names": names, "dtypes": ["float32", "int64"], "dtype": [0, 0, 1],
                                   "ndim": [2, 1, 0], "dims": [3, 4, 4]}, "ck")
    own = table.shared("b")
    assert own is names[1] and table.shared("zz") == "zz" and "s" in table and "zz" not in table
    assert table["s"] == {"dtype": "int64", "shape": []} and table["w"] == {"dtype": "float32", "shape": [3, 4]}
    assert table.shared("b") is own and table.rows_of(["s", "q", "w"]).tolist() == [2, -1, 0]
    assert table.to_json() == {"names": names, "dtypes": ["float32", "int64"], "dtype": [0, 0, 1],
                               "ndim": [2, 1, 0], "dims": [3, 4, 4]}
    assert table.empty_count() == 0 and table.first_over(10**6) is None and table.first_over(50) == 1 and table.first_over(40) == 0
    with pytest.raises(KeyError):
        table["zz"]
