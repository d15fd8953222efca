"""A torch.distributed.checkpoint (DCP) directory read as a bytecp
checkpoint, without conversion: ``.metadata`` becomes bytecp metadata and
each DCP chunk one row naming its ``.distcp`` file and byte range.

DCP's ``FileSystemWriter`` writes ``.metadata`` (a pickle of
``torch.distributed.checkpoint.metadata.Metadata``: every key's tensor
properties and chunks, or bytes; ``planner_data``, the flattened keys'
paths in the state dict; ``storage_data``, each item's file, offset and
length) and ``__<rank>_<n>.distcp`` files holding, at those ranges, each
tensor chunk as a ``torch.save`` archive and each non-tensor value as a
``torch.save`` blob. So:

- each tensor chunk (a box of the global tensor) is one
  :class:`~bytecp.format.metadata.ChunkRecord` pointing at its storage's
  bytes inside the archive (:func:`bytecp.interop.torch_zip.read_torch_file`
  locates them; nothing is read but the archive's headers), and every rank
  reads only the boxes it needs, at any world size and layout;
- each non-tensor value is decoded once by the coordinator with the
  restricted unpickler (``weights_only``): inline when it is JSON, else an
  object record pointing at its blob (checksummed here);
- the state tree is rebuilt from ``planner_data`` (DCP's own record of the
  flattened paths), so names are DCP's flattened keys exactly: ``model.<fqn>``
  and ``optim.state.<fqn>.exp_avg`` as ``get_state_dict`` writes them are the
  names bytecp's adapters give model and optimizer state, and
  ``optim.param_groups`` a list of groups naming parameters by FQN.

``.metadata`` is hostile input: it is unpickled by
:func:`bytecp.interop.torch_zip.restricted_loads` admitting only DCP's
metadata classes (as inert stand-ins: nothing of DCP is imported or run),
``torch.Size``, dtypes, layouts and memory formats, within the pickle
budget; every tensor is checked (known dtype, at most
:data:`~bytecp.format.limits.MAX_NDIM` dimensions, chunks inside it and
tiling it, their bytes inside their files) and the tensors' total size
against the ``.distcp`` files' before anything is allocated. Items written
with storage transforms (compression), by
``serialization_format=SAFETENSORS``, or as tensors that are not dense
are refused in one line naming the file and the key (load those with
``dcp.load``).

Who calls what: :func:`bytecp.interop.find_source` calls :func:`detect`
(file names only) when a URL has no ``metadata.json``;
:func:`bytecp.loading.opened.open_checkpoint` (the coordinator of a load)
then :func:`read`. The helpers live in :mod:`bytecp.interop.dcp_items`.
"""

from __future__ import annotations

import math
from typing import Any

from bytecp.format import metadata as fmt
from bytecp.interop import dcp_heads, dcp_items
from bytecp.interop.dcp_items import bad
from bytecp.storage_api import Storage
from bytecp.tree.dtype_names import ITEMSIZES

__all__ = ["METADATA_FILE", "SUFFIX", "FRAMEWORK", "NAMES", "is_dcp_dir", "read_dcp_dir", "detect", "read"]

#: DCP's metadata file
METADATA_FILE = ".metadata"
#: DCP's data files
SUFFIX = ".distcp"
#: ``Metadata.framework`` of a checkpoint read from a DCP directory
FRAMEWORK = "dcp"
#: names are matched exactly and dtypes never cast (:func:`bytecp.interop.exact_names`)
NAMES = "exact"


def is_dcp_dir(storage: Storage) -> bool:
    """(any process; cheap: one listing of names) Whether ``storage`` holds a
    DCP checkpoint: a ``.metadata`` file and at least one ``.distcp`` file."""
    if not storage.exists(METADATA_FILE):
        return False
    try:
        return any(n.endswith(SUFFIX) for n in storage.list_files(""))
    except FileNotFoundError:
        return False


def read_dcp_dir(storage: Storage) -> tuple[fmt.Metadata, list[fmt.ChunkRecord]]:
    """(coordinator) The directory's ``.metadata`` as bytecp metadata and one
    row per DCP tensor chunk, every size checked (module docstring)."""
    where = f"{storage.url}/{METADATA_FILE}"
    sizes = {n: s for n, s in storage.file_sizes("").items() if n.endswith(SUFFIX)}
    md = dcp_items.read_metadata(storage, where)
    items = dcp_items.storage_items(md, where, sizes)
    tensors: dict[str, dict[str, Any]] = {}
    chunks: list[tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...], Any]] = []
    byte_keys: list[str] = []
    total, budget = 0, sum(sizes.values())
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(key, str):
            raise bad(where, f"names an entry {key!r:.60}, not a string")
        if type(entry).__name__ == "BytesStorageMetadata":
            byte_keys.append(key)
            continue
        dtype, shape, boxes = dcp_items.tensor_entry(where, key, entry)
        total += math.prod(shape) * ITEMSIZES[dtype]
        if total > budget:
            raise bad(where, f"declares tensors (up to {key!r}, {dtype} {list(shape)}) larger in total than its "
                             f"{len(sizes)} .distcp files ({budget} bytes); refusing to allocate them")
        tensors[key] = {"dtype": dtype, "shape": list(shape)}
        for offsets, lengths in boxes:
            info = items.get((key, offsets))
            if info is None:
                raise bad(where, f"has no storage item for chunk {list(offsets)} of tensor {key!r}")
            chunks.append((key, dtype, shape, offsets, lengths, info))
    rows = dcp_heads.locate_chunks(storage, chunks)
    objects = {}
    for key in byte_keys:
        info = items.get((key, None))
        if info is None:
            raise bad(where, f"has no storage item for value {key!r}")
        objects[key] = dcp_items.read_value(storage, key, info)
    files = sorted({r.file for r in rows} | {o.file for o in objects.values() if o.file is not None})
    skeleton = dcp_items.skeleton(md, where, tensors, objects)
    meta = fmt.Metadata(
        save_id=dcp_items.save_id(md), world_size=dcp_items.world_size(sizes), framework=FRAMEWORK,
        parallelism={}, skeleton=skeleton, tensors=tensors, objects=objects, per_rank={}, index_files=[],
        data_files={f: sizes[f] for f in files}, user_metadata={"dcp_version": dcp_items.version(md)},
    )
    return meta, rows


#: the source protocol of :data:`bytecp.interop.SOURCES`
detect = is_dcp_dir
read = read_dcp_dir

