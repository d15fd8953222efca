"""The skeleton of a saved state tree: its dicts, lists and tuples, and the
name of every leaf value.

Built by :func:`bytecp.tree.state.flatten_tree` when a state is saved, stored in
``metadata.json`` (docs/FORMAT.md §6.4), parsed back into
:class:`Node` once by :mod:`bytecp.format.metadata`, and read by the load matcher and
the adapters (which look up optimizer entries by FQN). Nothing else
interprets the JSON form.

JSON nodes: ``{"k": [key, ...], "v": [node, ...]}`` (a dict; keys keep their
JSON type; versions 1-3: ``{"d": [[key, node], ...]}``), ``{"l": [...]}``
(list), ``{"t": [...]}`` (tuple), and the leaves ``"T"`` (a tensor),
``"O"`` (one stored object) and ``"R"`` (one value per rank), each named by
its position's FQN (versions 1-3 and any other name: ``{"tensor": fqn}``,
``{"obj": fqn}``, ``{"rank": fqn}``). The same form travels between ranks
at commit.

This module imports neither torch nor pyarrow.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

from bytecp.errors import CorruptCheckpointError
from bytecp.tree.bulk import gc_paused

__all__ = ["Node", "NodeKind", "LEAF_KINDS", "MAX_DEPTH", "decode_compact", "key_ok", "key_id"]

NodeKind = Literal["dict", "list", "tuple", "tensor", "obj", "rank"]
#: leaf kinds: the name of a tensor, of an object record, of a per-rank record
LEAF_KINDS: tuple[NodeKind, ...] = ("tensor", "obj", "rank")
#: containers nested deeper than this are refused (a crafted checkpoint must
#: not exhaust the stack); real training states are rarely 10 deep
MAX_DEPTH = 256

_TO_JSON: dict[NodeKind, str] = {"dict": "d", "list": "l", "tuple": "t"}
_FROM_JSON: dict[str, NodeKind] = {v: k for k, v in _TO_JSON.items()}
_LEAF_TAGS: dict[str, NodeKind] = {k: k for k in LEAF_KINDS}
#: version 4's compact leaves: the letter of a leaf named by its position's FQN
_LETTER: dict[NodeKind, str] = {"tensor": "T", "obj": "O", "rank": "R"}
_FROM_LETTER: dict[str, NodeKind] = {v: k for k, v in _LETTER.items()}


class Node:
    """One node of a skeleton: a container with children, or a leaf naming a stored value."""

    __slots__ = ("kind", "name", "items")

    def __init__(self, kind: NodeKind, *, name: str = "", items: Sequence[tuple[Any, Node]] = ()) -> None:
        self.kind: NodeKind = kind
        #: for a leaf, the FQN of the stored value (tensor, object or per-rank record)
        self.name = name
        #: for a container, ``(key, child)`` pairs in order (list/tuple keys are indices)
        self.items: tuple[tuple[Any, Node], ...] = tuple(items)

    # -- construction -----------------------------------------------------
    @classmethod
    def leaf(cls, kind: NodeKind, name: str) -> Node:
        if kind not in LEAF_KINDS:
            raise ValueError(f"not a leaf kind: {kind!r}")
        return cls(kind, name=name)

    @classmethod
    def container(cls, kind: NodeKind, items: Sequence[tuple[Any, Node]]) -> Node:
        if kind not in _TO_JSON:
            raise ValueError(f"not a container kind: {kind!r}")
        return cls(kind, items=items)

    @property
    def is_leaf(self) -> bool:
        return self.kind in LEAF_KINDS

    # -- JSON ---------------------------------------------------------------
    def to_json(self, prefix: str = "") -> Any:
        """The compact form (format version 4): a leaf named by its position's
        FQN (every leaf bytecp writes) is its kind's letter, a dict is its
        keys and its nodes. ``prefix``: the FQN of this node's position."""
        if self.is_leaf:
            return _LETTER[self.kind] if self.name == prefix else {self.kind: self.name}
        sub = [c.to_json(f"{prefix}.{k}" if prefix else str(k)) for k, c in self.items]
        if self.kind == "dict":
            return {"k": [k for k, _ in self.items], "v": sub}
        return {_TO_JSON[self.kind]: sub}

    @classmethod
    def from_json(cls, data: Any, where: str = "metadata.json", shared: Callable[[str], str] | None = None) -> Node:
        """Parse a skeleton in either form (versions 1-3 write ``{"d": [[key,
        node], ...]}`` dicts and ``{"tensor": fqn}`` leaves, version 4 the
        compact form of :meth:`to_json`); a malformed or too deeply nested
        one is :class:`~bytecp.errors.CorruptCheckpointError` naming ``where``.
        ``shared``: the string to keep for a one-letter leaf's FQN (metadata.json's
        own tensor name, one string for both: 19 MB fewer for 181,580 tensors)."""
        same = shared or str
        keys_seen: dict[str, str] = {}

        def bad(why: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"{where}: malformed skeleton: {why}")

        def parse(node: Any, depth: int, fqn: str) -> Node:
            if type(node) is str:
                kind = _FROM_LETTER.get(node)
                if kind is None:
                    raise bad(f"node {node!r:.80}")
                return cls(kind, name=fqn)
            if depth > MAX_DEPTH:
                raise bad(f"nested deeper than {MAX_DEPTH} levels")
            if not isinstance(node, dict) or not 1 <= len(node) <= 2:
                raise bad(f"node {node!r:.80}")
            if len(node) == 2:
                keys, vals = node.get("k"), node.get("v")
                if type(keys) is not list or type(vals) is not list or len(keys) != len(vals):
                    raise bad(f"dict node {node!r:.80}: want keys 'k' and nodes 'v' of one length")
                base = f"{fqn}." if fqn else ""
                items: list[tuple[Any, Node]] = []
                append, letter, new = items.append, _FROM_LETTER.get, Node.__new__
                for k, c in zip(keys, vals, strict=True):  # the hot loop: a state of 200,000 tensors has as many keys
                    if type(k) is str:
                        k = keys_seen.setdefault(k, k)  # one "exp_avg" for every parameter's
                        path = base + k
                    elif key_ok(k):
                        path = base + str(k)
                    else:
                        raise bad(f"dict key {k!r:.80}")
                    kind = letter(c) if type(c) is str else None
                    if kind is None:
                        append((k, parse(c, depth + 1, path)))
                    else:  # a leaf, made inline (no __init__, no call)
                        leaf = new(Node)
                        leaf.kind, leaf.name, leaf.items = kind, same(path), ()
                        append((k, leaf))
                return cls("dict", items=items)
            ((tag, val),) = node.items()
            leaf_kind = _LEAF_TAGS.get(tag)
            if leaf_kind is not None:
                if not isinstance(val, str):
                    raise bad(f"{tag} leaf names {val!r:.80}, not a string")
                return cls(leaf_kind, name=val)
            kind = _FROM_JSON.get(tag)
            if kind is None:
                raise bad(f"unknown node kind {tag!r:.40}")
            if not isinstance(val, list):
                raise bad(f"{tag} node holds {type(val).__name__}, not a list")
            if kind == "dict":
                items = []
                for pair in val:
                    if not isinstance(pair, list) or len(pair) != 2:
                        raise bad(f"dict entry {pair!r:.80}")
                    items.append((pair[0], parse(pair[1], depth + 1, _fqn(fqn, pair[0], bad))))
                return cls(kind, items=items)
            return cls(kind, items=[(i, parse(c, depth + 1, f"{fqn}.{i}" if fqn else str(i)))
                                    for i, c in enumerate(val)])

        with gc_paused():
            return parse(data, 0, "")

    # -- traversal --------------------------------------------------------
    def walk(self, prefix: str = "") -> Iterator[tuple[str, Node]]:
        """``(fqn, node)`` for every node, parents first; keys joined with ``.``.
        (With a stack, not nested generators: each of those passed every node of
        its subtree up through its parents, a cost per node that grew with the
        depth: a load indexes its checkpoint's skeleton twice.)"""
        stack = [(prefix, self)]
        while stack:
            fqn, node = stack.pop()
            yield fqn, node
            if node.items:
                stack.extend((f"{fqn}.{key}" if fqn else str(key), child) for key, child in reversed(node.items))

    def index(self) -> dict[str, Node]:
        """Every node by FQN."""
        return dict(self.walk())

    def without(self, drop: Callable[[str], bool], prefix: str = "") -> Node:
        """This tree less the entries of its dicts whose FQN ``drop`` names
        (lists and tuples keep every item: their positions are their names)."""
        if self.is_leaf or not self.items:
            return self
        items = []
        for key, child in self.items:
            fqn = f"{prefix}.{key}" if prefix else str(key)
            if self.kind == "dict" and drop(fqn):
                continue
            items.append((key, child.without(drop, fqn)))
        return Node(self.kind, items=items)

    def leaves(self) -> Iterator[Node]:
        """Every leaf, in :meth:`walk`'s order (without building their FQNs)."""
        stack = [self]
        while stack:
            node = stack.pop()
            if node.kind in LEAF_KINDS:
                yield node
            elif node.items:
                stack.extend(c for _, c in reversed(node.items))

    def child(self, key: Any) -> Node | None:
        for k, c in self.items:
            if k == key:
                return c
        return None

    def build(self, leaf: Callable[[NodeKind, str], Any]) -> Any:
        """Rebuild the tree: containers as dict/list/tuple, ``leaf(kind, name)`` for leaves."""
        if self.is_leaf:
            return leaf(self.kind, self.name)
        if self.kind == "dict":
            return {k: c.build(leaf) for k, c in self.items}
        values = [c.build(leaf) for _, c in self.items]
        return values if self.kind == "list" else tuple(values)

    def merge(self, other: Node) -> Node:
        """Union with another rank's skeleton (ranks may differ: optimizer state
        that exists only where a rank holds elements of the parameter). Keys of
        ``self`` keep their order; leaves of ``self`` win."""
        return self.merge_all([other])

    def merge_all(self, others: Sequence[Node]) -> Node:
        """The union of ``self`` with ``others`` in order, as :meth:`merge`
        one after the other would make it, in one pass over every node
        (the coordinator merges the skeleton of every rank that sent one:
        64 expert groups of 2,800 leaves each, merged one by one, copied the
        growing tree 63 times)."""
        others = [o for o in others if o.kind == self.kind]
        if self.is_leaf or not others:
            return self
        items = list(self.items)
        more: dict[int, list[Node]] = {}
        if self.kind == "dict":
            pos = {key_id(k): i for i, (k, _) in enumerate(items)}
            for o in others:
                for k, c in o.items:
                    kid = key_id(k)
                    i = pos.get(kid)
                    if i is None:
                        pos[kid] = len(items)
                        items.append((k, c))
                    else:
                        more.setdefault(i, []).append(c)
        else:
            for o in others:
                for i, c in o.items:
                    if i < len(items):
                        more.setdefault(i, []).append(c)
                    else:
                        items.append((i, c))
        for i, cs in more.items():
            items[i] = (items[i][0], items[i][1].merge_all(cs))
        return Node(self.kind, items=items)

    def digest(self) -> str:
        """Equal digests mean equal skeletons (used to skip sending them)."""
        return hashlib.blake2b(json.dumps(self.to_json()).encode(), digest_size=16).hexdigest()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Node) and self.to_json() == other.to_json()

    def __hash__(self) -> int:  # pragma: no cover - nodes are not used as keys
        return hash(self.digest())

    def __repr__(self) -> str:
        return f"Node({self.to_json()!r:.120})"


class _NotCompact(Exception):
    """(decode_compact) Not the plain compact form: the caller decodes it as JSON."""


def decode_compact(text: str, pos: int, shared: Callable[[str], str] | None = None) -> tuple[Node | None, int]:
    """The skeleton whose JSON starts at ``text[pos]`` in the compact form
    (version 4: ``{"k", "v"}`` dicts, ``{"l"}``/``{"t"}`` lists, one-letter
    leaves), and where its JSON ends: the :class:`Node` :meth:`Node.from_json`
    makes of it, built as the JSON is read, each dict's JSON dropped as soon
    as it is read (the JSON of a MoE's whole skeleton is 34 MB beside the
    33 MB of its nodes). ``(None, pos)`` for any other form and anything
    :meth:`~Node.from_json` refuses: the caller decodes it whole and that
    names the fault. JSON that is not JSON raises ``ValueError``, as
    ``json`` does."""
    keys_seen: dict[str, str] = {}
    letter, new = _FROM_LETTER.get, Node.__new__

    def hook(obj: dict[str, Any]) -> Node:
        if len(obj) == 2:
            keys, vals = obj.get("k"), obj.get("v")
            if type(keys) is not list or type(vals) is not list or len(keys) != len(vals):
                raise _NotCompact
            kind: NodeKind = "dict"
        elif len(obj) == 1 and ("l" in obj or "t" in obj):
            kind = "list" if "l" in obj else "tuple"
            vals = obj["l" if kind == "list" else "t"]
            if type(vals) is not list:
                raise _NotCompact
            keys = range(len(vals))
        else:
            raise _NotCompact
        items: list[tuple[Any, Node]] = []
        for k, c in zip(keys, vals, strict=True):
            if type(k) is str:
                k = keys_seen.setdefault(k, k)
            elif not key_ok(k):
                raise _NotCompact
            if type(c) is str:  # a leaf: named below, once its position's FQN is known
                leaf_kind = letter(c)
                if leaf_kind is None:
                    raise _NotCompact
                c = new(Node)
                c.kind, c.name, c.items = leaf_kind, "", ()
            elif type(c) is not Node:
                raise _NotCompact
            items.append((k, c))
        return Node(kind, items=items)

    try:
        root, end = json.JSONDecoder(object_hook=hook).raw_decode(text, pos)
        if type(root) is str and root in _FROM_LETTER:
            return Node(_FROM_LETTER[root]), end
        if type(root) is not Node:
            return None, pos
        _name_leaves(root, shared or str)
    except _NotCompact:
        return None, pos
    return root, end


def _name_leaves(root: Node, same: Callable[[str], str]) -> None:
    """(decode_compact) Each one-letter leaf's name: its position's FQN, as
    :meth:`Node.from_json` names it (a dict's leaves by ``same``); containers
    nested deeper than :data:`MAX_DEPTH` are refused."""
    # depth first, one iterator per open container (a stack of every sibling's FQN: 7 MB for a MoE's optimizer)
    stack: list[tuple[Iterator[tuple[Any, Node]], str, Callable[[str], str]]] = []
    node: Node | None = root
    fqn = ""
    while True:
        if node is not None:
            if len(stack) > MAX_DEPTH:
                raise _NotCompact
            stack.append((iter(node.items), f"{fqn}." if fqn else "", same if node.kind == "dict" else str))
        items, base, named = stack[-1]
        k, c = next(items, (None, None))
        if c is None:
            stack.pop()
            if not stack:
                return
            node = None
            continue
        fqn = base + k if type(k) is str else base + str(k)
        if c.items or c.kind not in LEAF_KINDS:
            node = c
        else:
            c.name = named(fqn)
            node = None


def key_ok(k: Any) -> bool:
    """A key a skeleton dict may hold (JSON keeps its type: str, int, bool, None)."""
    return type(k) in (str, int, bool) or k is None


def _fqn(prefix: str, key: Any, bad: Callable[[str], CorruptCheckpointError]) -> str:
    """The FQN of ``key`` under ``prefix`` (FORMAT.md §6.5), the key checked first."""
    if not key_ok(key):
        raise bad(f"dict key {key!r:.80}")
    return f"{prefix}.{key}" if prefix else str(key)


def key_id(k: Any) -> Any:
    """Dict keys of different JSON types never merge (1 and "1" are distinct)."""
    return k if type(k) is str else (type(k).__name__, k)
