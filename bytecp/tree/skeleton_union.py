"""The union of the skeletons the ranks send at a job's first save, merged as JSON.

Called by the coordinator (:func:`bytecp.saving.union.described_union`) when
it builds a new union at a job's first save: the ranks send their skeletons in the compact
JSON form (:meth:`~bytecp.tree.skeleton.Node.to_json`), and
``metadata.json`` wants that form back. Parsing 63 expert groups'
skeletons into nodes, merging the nodes and encoding the union again took
0.25 s for a DeepSeek-V3-like state of 181,580 tensors, and nothing in the
commit reads the nodes: :func:`union_json` merges the JSON itself (in one
walk, each dict's keys looked up once per rank) and :func:`deferred` stands
for the union's :class:`~bytecp.tree.skeleton.Node`, parsed from its text
the first time something reads it (a caller of ``save()`` that inspects
the returned metadata's skeleton; a training job never does).

This module imports neither torch nor pyarrow.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from typing import Any

from bytecp.tree.skeleton import MAX_DEPTH, Node, NodeKind, key_id, key_ok

__all__ = ["NotCompact", "union_json", "deferred"]

_LETTERS = frozenset({"T", "O", "R"})
_LEAF_TAGS = frozenset({"tensor", "obj", "rank"})


class NotCompact(Exception):
    """(union_json) A skeleton not in the plain compact form: the caller
    parses the skeletons into nodes and merges those (which names any fault)."""


def _kind(doc: Any) -> str:
    """"leaf", "dict", "l" or "t"; :class:`NotCompact` for anything else."""
    if type(doc) is str:
        if doc in _LETTERS:
            return "leaf"
    elif type(doc) is dict:
        if len(doc) == 2 and type(doc.get("k")) is list and type(doc.get("v")) is list \
                and len(doc["k"]) == len(doc["v"]):
            return "dict"
        if len(doc) == 1:
            ((tag, val),) = doc.items()
            if tag in _LEAF_TAGS and type(val) is str:
                return "leaf"
            if tag in ("l", "t") and type(val) is list:
                return tag
    raise NotCompact


def _checked_id(k: Any) -> Any:
    if not key_ok(k):
        raise NotCompact
    return key_id(k)


def _checked(docs: list[Any], depth: int) -> list[Any]:
    """``docs``, every node of each in the compact form (what the union takes
    whole from a rank is checked here, a level of every document at a
    time; the rest is merged level by level)."""
    level = docs
    while level:
        if depth > MAX_DEPTH:
            raise NotCompact
        below: list[list[Any]] = []
        if not {d for d in level if type(d) is str} <= _LETTERS:  # (the leaves: most of a level)
            raise NotCompact
        for doc in level:
            if type(doc) is str:
                continue
            if type(doc) is dict and len(doc) == 2:
                keys, vals = doc.get("k"), doc.get("v")
                if type(keys) is not list or type(vals) is not list or len(keys) != len(vals):
                    raise NotCompact
                if not set(map(type, keys)) <= {str}:
                    [_checked_id(k) for k in keys]
                below.append(vals)
            else:
                kind = _kind(doc)
                if kind != "leaf":
                    below.append(doc[kind])
        level = list(itertools.chain.from_iterable(below))
        depth += 1
    return docs


def union_json(base: Any, others: Sequence[Any], depth: int = 0) -> Any:
    """The compact JSON of ``Node.from_json(base).merge_all([Node.from_json(o)
    for o in others])`` (keys of ``base`` first, in order; a leaf of
    ``base`` wins; another node of a different kind is left out), sharing
    the unchanged parts of the documents given. :class:`NotCompact` when a
    document is not the compact form :meth:`Node.to_json` writes."""
    if depth > MAX_DEPTH:
        raise NotCompact
    others = [o for o in others if o is not base and o != base]  # (equal subtrees: compared in C, skipped)
    kind = _kind(base)
    same = [o for o in others if _kind(o) == kind]
    if kind == "leaf" or not same:
        return base
    more: dict[int, list[Any]] = {}
    if kind == "dict":
        keys, vals = list(base["k"]), list(base["v"])
        pos: dict[Any, int] = {}
        for i, k in enumerate(keys):
            if not key_ok(k):
                raise NotCompact
            pos[key_id(k)] = i
        deep = {i for i, v in enumerate(vals) if type(v) is not str}  # (a one-letter leaf of base wins: no merge)
        for o in same:
            ok, ov = o["k"], o["v"]
            ids = ok if set(map(type, ok)) <= {str} else [_checked_id(k) for k in ok]
            found = list(map(pos.get, ids))  # (each key looked up in C)
            new = [j for j, i in enumerate(found) if i is None]  # keys base lacks, in their order
            if len(new) != len({ids[j] for j in new}):
                raise NotCompact  # (a document naming a key twice)
            n = len(keys)
            pos.update(zip([ids[j] for j in new], range(n, n + len(new)), strict=True))
            keys += [ok[j] for j in new]
            vals += _checked([ov[j] for j in new], depth + 1)
            deep.update(i for i in range(n, len(vals)) if type(vals[i]) is not str)
            if deep:
                for at, c in zip(found, ov, strict=True):
                    if at is not None and at in deep:
                        more.setdefault(at, []).append(c)
        for i, cs in more.items():
            vals[i] = union_json(vals[i], cs, depth + 1)
        return {"k": keys, "v": vals}
    items = list(base[kind])
    for o in same:
        for i, c in enumerate(o[kind]):
            if i < len(items):
                more.setdefault(i, []).append(c)
            else:
                items += _checked([c], depth + 1)
    for i, cs in more.items():
        items[i] = union_json(items[i], cs, depth + 1)
    return {kind: items}


class _Deferred(Node):
    """A skeleton parsed from its compact JSON text when first read."""

    __slots__ = ("_text", "_where")

    def __init__(self, text: str, where: str) -> None:  # (no Node.__init__: its slots stay unset until read)
        self._text = text
        self._where = where

    def __getattr__(self, attr: str) -> Any:  # (only for a slot not set yet: kind, name, items)
        if attr not in Node.__slots__:
            raise AttributeError(attr)
        node = Node.from_json(json.loads(self._text), self._where)
        kind: NodeKind = node.kind
        self.kind, self.name, self.items = kind, node.name, node.items
        return getattr(node, attr)


def deferred(text: str, where: str) -> Node:
    """The :class:`Node` of the compact JSON ``text``, parsed when first
    read (a malformed one is then :class:`~bytecp.errors.CorruptCheckpointError`
    naming ``where``)."""
    return _Deferred(text, where)
