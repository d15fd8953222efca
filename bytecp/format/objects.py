"""Non-tensor values: JSON when they round-trip exactly, else a ``torch.save``
blob that loads with ``weights_only=True``; arbitrary pickles only when the
caller opts in on save *and* on load.

Called by the writer (:func:`serialize`, every rank, for the values it
writes) and by the load matcher (:func:`read_object`, every rank, for the
values its slots rebuild).
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import torch

from bytecp.errors import ConfigError, CorruptCheckpointError, PickleNotAllowedError
from bytecp.format import limits
from bytecp.format import metadata as fmt
from bytecp.format.checksum import crc32c
from bytecp.storage_api import Storage
from bytecp.tree.recent import Recent
from bytecp.tree.state import is_json_leaf

__all__ = ["Serialized", "serialize", "read_object"]


@dataclasses.dataclass(frozen=True)
class Serialized:
    """A value ready to store: ``json`` inline, or ``blob`` bytes for a data file."""

    json: Any = None
    blob: bytes | None = None
    #: the blob needs a full unpickler (stored only with allow_pickle=True)
    pickle: bool = False


#: the last blob of each value name that loaded with ``weights_only=True``: a
#: save whose value serializes to the same bytes again (an optimizer's param
#: groups, every save: 20 ms of unpickling at 20,000 parameters) is not loaded
#: again to check it; 64 names, blobs up to :data:`CHECKED_MAX_BYTES`
_CHECKED: Recent[str, bytes] = Recent(64)
CHECKED_MAX_BYTES = 1 << 22


def serialize(fqn: str, value: Any, allow_pickle: bool) -> Serialized:
    """(every rank, for the values it writes) How ``value`` is stored."""
    if is_json_leaf(value):
        return Serialized(json=value)
    if not allow_pickle and isinstance(value, torch.utils.data.DataLoader):  # (a StatefulDataLoader: its state)
        raise ConfigError(  # (before torch.save: it would pickle the whole dataset, or fail on a lambda)
            f"{fqn!r} is a torch DataLoader, which keeps no position to save: use torchdata's "
            "StatefulDataLoader (its position is saved, and resharded to another world size: "
            "docs/saving-and-loading.md), or leave the loader out of the state (allow_pickle=True "
            "would load a new loader that starts the epoch over)")
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
    except Exception as e:
        raise ConfigError(f"cannot serialize {fqn!r} ({type(value).__name__}): {e}") from e
    blob = buf.getvalue()
    if _CHECKED.get(fqn) == blob:  # (the same bytes load the same: checked before)
        return Serialized(blob=blob)
    try:
        torch.load(io.BytesIO(blob), weights_only=True)
        if len(blob) <= CHECKED_MAX_BYTES:
            _CHECKED.put(fqn, blob)
        return Serialized(blob=blob)
    except Exception as e:
        if not allow_pickle:
            # a generator's state is a tensor: what to store instead, and how to put it back into the same object
            how = (f"store its state instead ({fqn.rsplit('.', 1)[-1]}.get_state(), a tensor) and after the load "
                   "put it back into your generator with set_state(), so the objects using it (a DataLoader's "
                   "sampler) see it" if isinstance(value, torch.Generator) else
                   "convert it to tensors/JSON-able values, or pass allow_pickle=True to save (and to load)")
            raise ConfigError(
                f"{fqn!r} is a {type(value).__name__}, which can only be stored as an arbitrary pickle "
                f"(it does not load with weights_only=True: {e.__class__.__name__}); {how}"
            ) from None
        return Serialized(blob=blob, pickle=True)


def read_object(
    storage: Storage, fqn: str, rec: fmt.ObjectRecord, *, verify: bool, allow_pickle: bool
) -> Any:
    """(every rank that rebuilds ``fqn``) The stored value; never unpickles
    arbitrary objects unless ``allow_pickle``."""
    if not rec.is_blob:
        return rec.json
    assert rec.file is not None
    if rec.pickle and not allow_pickle:
        raise PickleNotAllowedError(
            f"{storage.url}: {fqn!r} was saved as an arbitrary pickle (in {rec.file}); loading it "
            "could run code from the checkpoint. Pass allow_pickle=True only if you trust it"
        )
    try:
        blob = storage.read_bytes(rec.file, rec.byte_offset, rec.nbytes)
    except FileNotFoundError as e:
        raise CorruptCheckpointError(f"{storage.url}: data file {rec.file} holding {fqn!r} is missing") from e
    if verify and crc32c(blob) != rec.crc32c:
        raise CorruptCheckpointError(
            f"{storage.url}/{rec.file}: checksum mismatch in object {fqn!r} "
            f"(bytes {rec.byte_offset}..{rec.byte_offset + rec.nbytes})"
        )
    return limits.load_blob(blob, f"{storage.url}: object {fqn!r} in {rec.file}",
                            safe=not (rec.pickle and allow_pickle))
