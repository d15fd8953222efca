"""The coordinator's one-pass skeleton merge (:meth:`Node.merge_all`) makes
the tree that merging the ranks' skeletons one after the other made, and
its merge of their JSON (bytecp/tree/skeleton_union.py) the same document."""

from __future__ import annotations

import copy
import json
import pickle
import random
from typing import Any

import pytest

from bytecp.errors import CorruptCheckpointError
from bytecp.tree.skeleton import Node
from bytecp.tree.skeleton_union import NotCompact, deferred, union_json


def _pairwise(a: Node, b: Node) -> Node:
    """The merge as written before ``merge_all``: one rank at a time."""
    if a.kind != b.kind or a.is_leaf:
        return a
    if a.kind == "dict":
        items = list(a.items)
        pos = {json.dumps(k): i for i, (k, _) in enumerate(items)}
        for k, c in b.items:
            i = pos.get(json.dumps(k))
            if i is None:
                pos[json.dumps(k)] = len(items)
                items.append((k, c))
            else:
                items[i] = (items[i][0], _pairwise(items[i][1], c))
        return Node(a.kind, items=items)
    n = min(len(a.items), len(b.items))
    merged = [(i, _pairwise(x, y)) for (i, x), (_, y) in zip(a.items[:n], b.items[:n], strict=True)]
    longer = a.items if len(a.items) >= len(b.items) else b.items
    return Node(a.kind, items=merged + list(longer[n:]))


def _tree(rng: random.Random, depth: int, prefix: str) -> Node:
    roll = rng.random()
    if depth >= 3 or roll < 0.3:
        return Node.leaf(rng.choice(["tensor", "obj", "rank"]), prefix)
    kind = "dict" if roll < 0.8 else rng.choice(["list", "tuple"])
    keys: list[Any] = rng.sample(["a", "b", "c", 1, "1", True, None], rng.randint(0, 4)) if kind == "dict" \
        else list(range(rng.randint(0, 3)))
    return Node(kind, items=[(k, _tree(rng, depth + 1, f"{prefix}.{k}")) for k in keys])


def test_merge_all_equals_merging_one_rank_at_a_time() -> None:
    rng = random.Random(5)
    for _ in range(300):
        trees = [Node("dict", items=[(k, _tree(rng, 1, k)) for k in rng.sample("xyz", rng.randint(1, 3))])
                 for _ in range(rng.randint(1, 6))]
        want = trees[0]
        for t in trees[1:]:
            want = _pairwise(want, t)
        got = trees[0].merge_all(trees[1:])
        assert got.to_json() == want.to_json()
        assert trees[0].merge(trees[-1]).to_json() == _pairwise(trees[0], trees[-1]).to_json()


def test_keys_of_different_json_types_stay_apart() -> None:
    a = Node("dict", items=[(1, Node.leaf("tensor", "1")), (True, Node.leaf("obj", "True"))])
    b = Node("dict", items=[("1", Node.leaf("tensor", "x")), (None, Node.leaf("rank", "None"))])
    assert [k for k, _ in a.merge_all([b]).items] == [1, True, "1", None]


def _ranks(rng: random.Random) -> list[Node]:
    """The coordinator's tree and other ranks': the same, some keys changed
    (another tree, maybe of another kind) or added; some leaves named other
    than by their position."""
    base = [(k, _tree(rng, 1, k)) for k in rng.sample("xyz", rng.randint(1, 3))]
    trees = [Node("dict", items=base)]
    for _ in range(rng.randint(1, 5)):
        items = [(k, c if rng.random() < 0.6 else _tree(rng, 1, k)) for k, c in base]
        items += [(k, _tree(rng, 1, k)) for k in rng.sample("uvw", rng.randint(0, 2))]
        if rng.random() < 0.2:
            items.append(("named", Node.leaf("tensor", "elsewhere")))
        trees.append(Node("dict", items=items))
    return trees


def test_the_json_union_is_the_merged_trees_json() -> None:
    """The coordinator merges the skeletons the ranks send as JSON
    (:func:`union_json`): the same document as parsing, merging and encoding them."""
    rng = random.Random(11)
    shared = 0
    for _ in range(400):
        trees = _ranks(rng)
        own, docs = trees[0].to_json(), [t.to_json() for t in trees[1:]]
        got = union_json(own, docs)
        assert got == trees[0].merge_all(trees[1:]).to_json()
        assert Node.from_json(got).to_json() == got
        shared += got is own
    assert shared > 5  # (nothing new: the coordinator's own document, unchanged)


def test_a_document_not_in_the_compact_form_is_left_to_the_parser() -> None:
    own = Node("dict", items=[("a", Node.leaf("tensor", "a"))]).to_json()
    for doc in ({"d": [["b", "T"]]}, {"k": ["b"], "v": ["X"]}, {"k": [["b"]], "v": ["T"]}, {"k": ["b", "b"], "v": ["T", "T"]},
                {"k": ["a"], "v": []}):
        with pytest.raises(NotCompact):
            union_json(own, [doc])


def test_a_deferred_skeleton_is_parsed_when_first_read() -> None:
    tree = Node("dict", items=[("m", Node("dict", items=[("w", Node.leaf("tensor", "m.w"))])),
                               ("s", Node.leaf("obj", "s"))])
    text = json.dumps(tree.to_json())
    node = deferred(text, "the union")
    again = pickle.loads(pickle.dumps(node))  # unread: travels as its text
    assert node == tree and again == tree and copy.deepcopy(node) == tree
    assert [n.name for n in node.leaves()] == ["m.w", "s"] and node.index()["m.w"].kind == "tensor"
    with pytest.raises(CorruptCheckpointError, match="the union: malformed skeleton"):
        _ = deferred('{"k": ["a"], "v": ["X"]}', "the union").items
