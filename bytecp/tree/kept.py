"""Answers about a state kept between its saves while its structure stays.

A save of tens of thousands of tensors asks the same questions of its state
at every save -- the plan phase's holdings and vote digests, the digest of
its tensors' specs and skeleton, the commit's tensor table -- and each costs
tens of milliseconds of Python (holding the GIL on an async save's thread,
beside training). When the state is described by kept
:class:`~bytecp.tree.state.Prebuilt` pieces (adapters keep them while the
modules and optimizers keep their structure: ``adapters/_watch.py``), the
answers of the last save stand while the pieces are the very same; they
live in the first piece's memo and go with it.

Called by the plan phase (:func:`bytecp.plan.exchange.holdings`,
:func:`~bytecp.plan.exchange.specs_digest`) and the commit
(:func:`bytecp.saving.union.tensor_table`), every rank, on the described
tree or on an async save's snapshot of it (which names the live tree it
copies in ``copy_of``: its specs and skeleton are the live tree's).
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable, Hashable
from typing import Any, TypeVar, cast

from bytecp.tree.recent import Recent
from bytecp.tree.state import FlatTree

__all__ = ["memoized", "state_digest", "Recent"]

_T = TypeVar("_T")
_K = TypeVar("_K", bound=Hashable)


def _held(memo: dict[Any, Any], key: Any, objects: tuple[Any, ...], make: Callable[[], _T],
          same: Any = None) -> _T:
    """``make()``, kept in ``memo`` under ``key`` and given again while the
    call names the very ``objects`` of the call that made it (and an equal ``same``)."""
    held = memo.get(key)
    if (held is not None and held[1] == same and len(held[0]) == len(objects)
            and all(map(operator.is_, held[0], objects))):
        return cast(_T, held[2])
    out = make()
    memo[key] = (objects, same, out)
    return out


def memoized(flat: FlatTree, key: Any, make: Callable[[], _T], *, specs: bool = False) -> _T:
    """``make()``, an answer that depends only on ``flat``'s tensors (their
    names, dtypes, shapes, shardings and the tensor objects; ``specs``: only
    their names, dtypes and shapes): for a state made only of pieces, kept
    in its first piece's memo under ``key`` and given again while every
    piece's tensors are those of the call that made it. A snapshot's tree
    asks the live tree it copies for ``specs`` answers; any other tree gets
    ``make()``."""
    if specs and flat.copy_of is not None:
        return memoized(flat.copy_of, key, make, specs=True)
    if not flat.pieces or flat.loose:
        return make()
    return _held(flat.pieces[0].memo, key, tuple(p.flat.tensors for p in flat.pieces), make)


def state_digest(flat: FlatTree) -> str:
    """:meth:`FlatTree.digest` (equal digests: equal skeletons and aliases),
    the skeleton's kept (:func:`_skeleton_digest`); a snapshot's tree, whose
    skeleton is the live tree's, asks that."""
    live = flat.copy_of
    if live is not None and live.skeleton is flat.skeleton:
        return state_digest(live)
    return flat.digest(_skeleton_digest(flat))


def _skeleton_digest(flat: FlatTree) -> str:
    """``flat.skeleton.digest()``; for a state whose top holds pieces (whose
    skeleton nodes never change), the last call's while the pieces are the
    same and the rest of the top is as it was then (a 20,120-tensor state's
    skeleton is 150,000 nodes of JSON: 25 ms a save)."""
    sk = flat.skeleton
    if not flat.pieces or sk.is_leaf:
        return sk.digest()
    roots = {id(p.flat.skeleton): i for i, p in enumerate(flat.pieces)}
    rest = json.dumps([sk.kind, [(k, roots.get(id(c), -1), None if id(c) in roots else c.to_json(str(k)))
                                 for k, c in sk.items]])
    return _held(flat.pieces[0].memo, "skeleton digest", tuple(p.flat.skeleton for p in flat.pieces), sk.digest,
                 same=rest)
