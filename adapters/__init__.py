"""Framework adapters (``bytecp.adapters``): plain/DDP, FSDP1, FSDP2, Megatron-Core.

The core finds them through :mod:`bytecp.adapter_api`'s registry; each turns
its framework's live state into the core's state tree without copying and
writes loaded data back in place.

This package is also the surface for writing an adapter
(docs/extending.md): the interface (:class:`Adapter`, :class:`AdapterCall`,
:class:`LoadTarget`, :func:`register_adapter`), the state tree's leaves
(:class:`TensorLeaf`, :class:`Shard`, :class:`Region`, :class:`ReplicaSet`,
:data:`EVERY_RANK`, :class:`PerRank`, :class:`Whole`, :class:`Slot`), the
built-in adapters to subclass, and :mod:`bytecp.adapters.testing`, the
contract suite. Names are imported on first use, so importing the package
imports no framework.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "Adapter",
    "AdapterCall",
    "LoadTarget",
    "register_adapter",
    "detect_adapter",
    "get_adapter",
    "TensorLeaf",
    "Shard",
    "Region",
    "ReplicaSet",
    "EVERY_RANK",
    "PerRank",
    "Whole",
    "Slot",
    "PlainAdapter",
    "DDPAdapter",
    "FSDP1Adapter",
    "FSDP2Adapter",
]

_WHERE = {
    "Adapter": "bytecp.adapter_api",
    "AdapterCall": "bytecp.adapter_api",
    "LoadTarget": "bytecp.adapter_api",
    "register_adapter": "bytecp.adapter_api",
    "detect_adapter": "bytecp.adapter_api",
    "get_adapter": "bytecp.adapter_api",
    "TensorLeaf": "bytecp.tree.state",
    "Shard": "bytecp.tree.state",
    "ReplicaSet": "bytecp.tree.state",
    "EVERY_RANK": "bytecp.tree.state",
    "PerRank": "bytecp.tree.state",
    "Whole": "bytecp.tree.state",
    "Slot": "bytecp.tree.state",
    "Region": "bytecp.tree.regions",
    "PlainAdapter": "bytecp.adapters.plain",
    "DDPAdapter": "bytecp.adapters.ddp",
    "FSDP1Adapter": "bytecp.adapters.fsdp1",
    "FSDP2Adapter": "bytecp.adapters.fsdp2",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
