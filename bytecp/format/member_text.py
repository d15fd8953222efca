"""``metadata.json``'s two largest members, encoded once for many saves.

A job saves one state again and again: its skeleton and tensor specs are
the same every time (for a DeepSeek-V3-like state of 181,580 tensors, 20 MB
of the 29 MB of ``metadata.json``, 0.35 s to encode on the coordinator).
The coordinator's commit (:mod:`bytecp.saving.commit`) keeps the union of
what the ranks describe between saves together with its JSON text, an
:class:`EncodedMembers`; :meth:`bytecp.format.metadata.Metadata.to_bytes`
splices that text in (:func:`dumps_object`) when the metadata holds
exactly those objects. The bytes are the same as encoding them again.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from bytecp.format.tensor_table import table_json
from bytecp.tree.skeleton import Node

__all__ = ["EncodedMembers", "encode_members", "dumps_object", "dumps", "LARGE_STATE", "is_large"]

#: a state of this many tensors and data files together is large: between
#: ranks its metadata travels as ``metadata.json`` text (a load) or without
#: its large members (a commit's outcome: :mod:`bytecp.saving.outcome`)
LARGE_STATE = 20_000


def is_large(md: Any) -> bool:
    """Whether the metadata ``md`` is of a large state (:data:`LARGE_STATE`)."""
    return len(md.tensors) + len(md.data_files) >= LARGE_STATE


def dumps(value: Any) -> str:
    """``metadata.json``'s JSON encoding of one value (compact, no NaN)."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


@dataclasses.dataclass(frozen=True, eq=False)
class EncodedMembers:
    """The JSON text of the ``skeleton`` and ``tensors`` members (format
    version 4) of these very objects, which nobody changes once encoded."""

    skeleton: Node
    tensors: Mapping[str, Any]
    #: member name -> its JSON text
    text: Mapping[str, str]

    def of(self, skeleton: Node, tensors: Mapping[str, Any]) -> Mapping[str, str]:
        """The text, when ``skeleton`` and ``tensors`` are the objects it
        encodes (else nothing: the caller encodes them)."""
        return self.text if skeleton is self.skeleton and tensors is self.tensors else {}


def encode_members(skeleton: Node, tensors: Mapping[str, Any], skeleton_text: str | None = None) -> EncodedMembers:
    """(coordinator, at a commit whose union of skeletons is new) The two
    members' text, as :meth:`~bytecp.format.metadata.Metadata.to_bytes`
    writes them (``skeleton_text``: the skeleton's, when the caller has it)."""
    return EncodedMembers(skeleton, tensors, {
        "tensors": dumps(table_json(tensors)),
        "skeleton": dumps(skeleton.to_json()) if skeleton_text is None else skeleton_text})


def dumps_object(d: Mapping[str, Any], text: Mapping[str, str]) -> bytes:
    """``d`` encoded as one JSON object, its members in order, those named
    in ``text`` as that text (the same bytes as :func:`dumps` of ``d`` with
    their values)."""
    if not text:
        return dumps(d).encode()
    return ("{" + ",".join(f"{dumps(k)}:{text[k] if k in text else dumps(v)}" for k, v in d.items())
            + "}").encode()
