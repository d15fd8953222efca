"""metadata.json's skeleton and tensors members, encoded once and spliced in
(bytecp/format/member_text.py): the same bytes as encoding them again, and never
the text of other objects."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import bytecp
from bytecp.errors import CorruptCheckpointError
from bytecp.format import metadata as fmt
from bytecp.format.member_text import dumps, dumps_object, encode_members
from bytecp.format.tensor_table import table_json
from bytecp.saving import union
from bytecp.saving.commit import tensor_specs
from bytecp.saving.union import described_union, kept_unions
from bytecp.tree.recent import Recent
from bytecp.tree.skeleton import Node
from bytecp.tree.state import flatten_tree


def _saved(tmp_path: Path) -> fmt.Metadata:
    state = {"model": {"w": torch.ones(3, 2), "b": torch.zeros(2, dtype=torch.bfloat16)}, "step": 7,
             "opt": {"state": {0: {"exp_avg": torch.ones(4)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}}
    bytecp.save(str(tmp_path / "ck"), state)
    return fmt.Metadata.from_bytes((tmp_path / "ck" / fmt.METADATA_FILE).read_bytes(), "ck")


def test_spliced_members_give_the_same_bytes(tmp_path: Path) -> None:
    md = _saved(tmp_path)
    tensors = dict(md.tensors)  # (read as a TensorTable; the commit holds a dict)
    plain = dataclasses.replace(md, tensors=tensors)
    spliced = dataclasses.replace(plain, encoded=encode_members(plain.skeleton, tensors))
    assert spliced.to_bytes() == plain.to_bytes()
    assert fmt.Metadata.from_bytes(spliced.to_bytes(), "ck").to_bytes() == plain.to_bytes()
    d = {"a": [1, "é"], "b": None, "c": {"x": 1.5}}
    assert dumps_object(d, {"b": dumps({"k": [2]})}) == dumps(d | {"b": {"k": [2]}}).encode()


def test_the_text_of_other_objects_is_never_written(tmp_path: Path) -> None:
    md = _saved(tmp_path)
    tensors = dict(md.tensors)
    enc = encode_members(md.skeleton, tensors)
    changed = {**tensors, "model.w": {"dtype": "float32", "shape": [5, 2]}}
    other = dataclasses.replace(md, tensors=changed, encoded=enc)  # (a replace keeps the field)
    assert fmt.Metadata.from_bytes(other.to_bytes(), "ck").tensors["model.w"]["shape"] == [5, 2]
    older = dataclasses.replace(md, tensors=tensors, encoded=enc, format_version=3)
    assert json.loads(older.to_bytes())["tensors"] == tensors  # version 3's form, not the kept text


def test_a_union_is_reused_for_its_key_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(union, "_KEPT", Recent(union._KEPT.limit))
    tree = flatten_tree({"m": {"w": torch.ones(2, 2)}})
    asked: list[int] = []

    def own() -> tuple[Node, dict[str, dict[str, Any]], dict[str, str]]:
        asked.append(1)
        return tree.skeleton, tensor_specs(tree), {}

    other = flatten_tree({"n": {"v": torch.ones(3)}})
    sent = [(1, other.skeleton.to_json(), table_json(tensor_specs(other)), {"n.u": "n.v"})]
    first = described_union(own, sent, 0, "k1", slot="job")
    assert dict(first.tensors) == {"m.w": {"dtype": "float32", "shape": [2, 2]}, "n.v": {"dtype": "float32",
                                                                                          "shape": [3]}}
    assert first.elements == 7 and first.aliases == {"n.u": "n.v"}
    with pytest.raises(TypeError):  # read-only: later saves share it
        first.tensors["m.w"] = {"dtype": "float32", "shape": [9]}  # type: ignore[index]
    first.tensors["m.w"]["shape"].append(9)  # (a copy each time)
    assert first.tensors["m.w"]["shape"] == [2, 2]
    assert first.skeleton == tree.skeleton.merge(other.skeleton)  # (merged on a thread: kept once merged)
    assert kept_unions("job", 0) == [first] and kept_unions("other job", 0) == [] and kept_unions("job", 1) == []
    assert len(asked) == 1
    # a second state saved in turn: both kept, each found by its key
    again = described_union(own, [], 0, "k2", slot="job")
    assert dict(again.tensors) == {"m.w": {"dtype": "float32", "shape": [2, 2]}}
    assert kept_unions("job", 0) == [first, again]
    assert described_union(own, [], 0, "", slot="job") not in kept_unions("job", 0)  # no key: never kept
    for k in range(union._KEPT.limit):
        described_union(own, [], 0, f"more{k}", slot="job")
    assert first not in kept_unions("job", 0) and len(union._KEPT.items()) == union._KEPT.limit == 4  # oldest first


def test_a_new_union_is_merged_as_json_and_encoded_alike(tmp_path: Path) -> None:
    """The skeletons sent are merged as JSON, the union's node parsed only
    when read; a document in another form is parsed and merged as nodes, and
    a malformed one is refused naming its rank."""
    tree = flatten_tree({"m": {"w": torch.ones(2, 2)}, "opt": {"a": torch.ones(1)}})
    other = flatten_tree({"m": {"w": torch.ones(2, 2)}, "opt": {"b": torch.ones(3)}})

    def own() -> tuple[Node, dict[str, dict[str, Any]], dict[str, str]]:
        return tree.skeleton, tensor_specs(tree), {}

    want = tree.skeleton.merge(other.skeleton)
    legacy = {"d": [["opt", {"d": [["b", {"tensor": "opt.b"}]]}]]}  # (versions 1-3 wrote this form)
    for doc in (other.skeleton.to_json(), dumps(other.skeleton.to_json()), legacy):  # (ranks send the text)
        union = described_union(own, [(1, doc, table_json(tensor_specs(other)), {})], 0)
        assert union.skeleton == want and union.encoded.text["skeleton"] == dumps(want.to_json())
        assert union.elements == 4 + 1 + 3
    bad = {"k": ["opt"], "v": [{"k": ["b"], "v": ["X"]}]}
    broken = described_union(own, [(1, bad, table_json(tensor_specs(other)), {})], 0, "k", slot="job")
    for _ in range(2):  # (raised where the union is read, each time; never kept)
        with pytest.raises(CorruptCheckpointError, match=r"rank 1's skeleton: malformed skeleton: node 'X'"):
            broken.skeleton  # noqa: B018
    assert broken not in kept_unions("job", 0)
    garbled = described_union(own, [(3, '{"k": [', table_json(tensor_specs(other)), {})], 0)
    with pytest.raises(CorruptCheckpointError, match=r"^rank 3's skeleton: not JSON"):
        garbled.skeleton  # noqa: B018

