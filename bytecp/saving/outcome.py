"""What the coordinator's commit sends every rank: the committed metadata,
its large members left in ``metadata.json`` when the state is large.

Called by the save pipeline's commit step: the coordinator broadcasts
:func:`outcome_of` its :class:`~bytecp.format.metadata.Metadata`, and every
other rank :meth:`~CommittedMetadata.attach`-es its own storage to what it
received. For a DeepSeek-V3-like state of 181,580 tensors at 131,072 ranks
the whole object pickles to 44 MB, which every rank then unpickled at every
save (1.8 s and 243 MB with the garbage collector running); a rank needs
none of it to go on training (the save's id and step are small). What
``save()`` returns there is a :class:`CommittedMetadata`: the small
members as sent, the large ones read from the checkpoint's
``metadata.json`` the first time one is asked for.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from bytecp.errors import CorruptCheckpointError
from bytecp.format import metadata as fmt
from bytecp.format.member_text import is_large
from bytecp.storage_api import Storage

__all__ = ["CommittedMetadata", "outcome_of", "LAZY_FIELDS"]

#: the members read from ``metadata.json`` when first asked for
LAZY_FIELDS = ("skeleton", "tensors", "objects", "per_rank", "index_files", "data_files", "aliases", "index",
               "references")


def outcome_of(md: fmt.Metadata) -> fmt.Metadata:
    """(coordinator, at commit) What the commit broadcasts: ``md``, or for a
    large state a :class:`CommittedMetadata` of its small members."""
    if not is_large(md):
        return dataclasses.replace(md, encoded=None)  # (the kept JSON text stays on the coordinator)
    out = CommittedMetadata.__new__(CommittedMetadata)
    out.__dict__.update({k: v for k, v in md.__dict__.items() if k not in LAZY_FIELDS and k != "encoded"})
    out.__dict__["encoded"] = None
    return out


def _lazy(name: str) -> property:
    def get(self: CommittedMetadata) -> Any:
        if name not in self.__dict__:
            self._read()
        return self.__dict__[name]

    def put(self: CommittedMetadata, value: Any) -> None:
        self.__dict__[name] = value

    return property(get, put)


class CommittedMetadata(fmt.Metadata):
    """The committed metadata as a rank other than the coordinator received
    it: the save id, step, world size and the other small members; the
    large ones (:data:`LAZY_FIELDS`) read from ``metadata.json`` on first
    use, through the storage the rank :meth:`attach`-ed. Built by
    :func:`outcome_of`. Its ``repr`` reads nothing; comparing, copying or
    ``dataclasses.replace`` read the large members first (and compare as a
    :class:`~bytecp.format.metadata.Metadata` would)."""

    def attach(self, storage: Storage) -> CommittedMetadata:
        """(every rank, after the broadcast) The checkpoint's storage, read
        from when a large member is first asked for (never sent along)."""
        self.__dict__["_storage"] = storage
        return self

    def _read(self) -> None:
        storage: Storage | None = self.__dict__.get("_storage")
        if storage is None:
            raise RuntimeError(f"the metadata of save {self.save_id} came without its large members and no storage "
                               "to read them from (CommittedMetadata.attach)")
        try:
            # (this save's own commit: read whole, without the readers' size cap, which the commit warned about)
            md = fmt.Metadata.from_bytes(storage.read_bytes(fmt.METADATA_FILE), storage.url)
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"{storage.url}: metadata.json of save {self.save_id} is gone (the checkpoint was removed after "
                "it was committed); its tensors were not kept on this rank") from None
        if md.save_id != self.save_id:
            raise CorruptCheckpointError(
                f"{storage.url}: metadata.json now holds save {md.save_id}, not save {self.save_id} that this "
                "rank committed (the checkpoint was overwritten since); its tensors were not kept on this rank")
        for name in LAZY_FIELDS:
            self.__dict__.setdefault(name, getattr(md, name))

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_storage"}

    def __repr__(self) -> str:
        return (f"CommittedMetadata(save_id={self.save_id!r}, step={self.step!r}, world_size={self.world_size}, "
                f"framework={self.framework!r}; skeleton, tensors, files and index read from metadata.json on first use)")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, fmt.Metadata):
            return NotImplemented
        return all(getattr(self, f.name) == getattr(other, f.name) for f in dataclasses.fields(fmt.Metadata) if f.compare)

    __hash__ = None  # type: ignore[assignment]  # (as the dataclass's)

    def __copy__(self) -> fmt.Metadata:
        return fmt.Metadata(**{f.name: getattr(self, f.name) for f in dataclasses.fields(fmt.Metadata)})

    def __deepcopy__(self, memo: dict[int, Any]) -> fmt.Metadata:
        return fmt.Metadata(**{f.name: copy.deepcopy(getattr(self, f.name), memo) for f in dataclasses.fields(fmt.Metadata)})


for _name in LAZY_FIELDS:
    setattr(CommittedMetadata, _name, _lazy(_name))
