"""The coordinator's one-pass skeleton merge (:meth:`Node.merge_all`) makes
the tree that merging the ranks' skeletons one after the other made."""

from __future__ import annotations

import json
import random
from typing import Any

from bytecp.tree.skeleton import Node, pruned


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


def test_merging_what_differs_from_the_coordinators_gives_the_same_tree() -> None:
    """The coordinator parses only the parts of a rank's skeleton that differ
    from its own (:func:`pruned`): the merged tree is the same."""
    rng = random.Random(11)
    pruned_some = 0
    for _ in range(300):
        base = [(k, _tree(rng, 1, k)) for k in rng.sample("xyz", rng.randint(1, 3))]
        trees = [Node("dict", items=base)]
        for _ in range(rng.randint(1, 5)):  # other ranks: the coordinator's tree, some keys changed or added
            items = [(k, c if rng.random() < 0.6 else _tree(rng, 1, k)) for k, c in base]
            items += [(k, _tree(rng, 1, k)) for k in rng.sample("uvw", rng.randint(0, 2))]
            trees.append(Node("dict", items=items))
        own = trees[0].to_json()
        docs = [pruned(t.to_json(), own) for t in trees[1:]]
        pruned_some += sum(d is None or d != t.to_json() for d, t in zip(docs, trees[1:], strict=True))
        got = trees[0].merge_all([Node.from_json(d) for d in docs if d is not None])
        assert got.to_json() == trees[0].merge_all(trees[1:]).to_json()
    assert pruned_some > 100
