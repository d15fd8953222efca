"""Hand-off code: every format bytecp reads or writes besides its own.

Two registries, each ``name -> "module:attr"`` so nothing is imported until
it is used (the load path imports this package; a format's dependencies
are imported only when that format is read or written):

- :data:`SOURCES`: checkpoints of other formats that load as they are, with
  no conversion step. A source module exposes ``detect(storage) -> bool``
  (cheap: file names only, a few small reads at most) and
  ``read(storage) -> (Metadata, rows)``: the checkpoint's tensors as
  :class:`~bytecp.format.metadata.Metadata` and whole- or part-tensor
  :class:`~bytecp.format.metadata.ChunkRecord` rows naming the source's own
  files and byte ranges, so the normal load pipeline plans and reads only
  what each rank needs. :func:`bytecp.loading.opened.open_checkpoint` calls
  :func:`find_source` when a URL has no ``metadata.json``, in
  :data:`SOURCES` order (or the one ``format=`` names).
- :data:`WRITERS`: the ``bytecp export --format`` targets, each a function
  ``(src, out, **options) -> ExportResult`` (:mod:`bytecp.interop.export`).

Also here: :mod:`~bytecp.interop.mapping` (name/layout specs between
frameworks and Hugging Face), :mod:`~bytecp.interop.hf_names` (matching a
source's names to a target's as transformers does) and the exporters.
How to add a source or a writer: docs/extending.md.
"""

from __future__ import annotations

import importlib
from typing import Any

from bytecp.errors import ConfigError
from bytecp.storage_api import Storage

__all__ = ["SOURCES", "WRITERS", "find_source", "read_source", "exact_names", "writer", "source_names"]

#: source name -> module exposing ``detect(storage)`` and ``read(storage)``, in detection order
SOURCES: dict[str, str] = {
    "huggingface": "bytecp.interop.safetensors_dir",
    "torch_dist": "bytecp.interop.torch_dist",  # before dcp: a torch_dist folder is a DCP folder too
    "dcp": "bytecp.interop.dcp",
    "deepspeed": "bytecp.interop.deepspeed_zero",
    "deepspeed_universal": "bytecp.interop.deepspeed_universal",
}

#: ``bytecp export --format`` name -> ``"module:function"``
WRITERS: dict[str, str] = {
    "hf": "bytecp.interop.hf_export:export_hf",
    "safetensors": "bytecp.interop.export:export_safetensors",
    "torch": "bytecp.interop.export:export_torch",
    "dcp": "bytecp.interop.dcp_export:export_dcp",
}


def source_names() -> list[str]:
    """The ``format=`` values a load accepts besides ``"bytecp"``."""
    return list(SOURCES)


def _module(name: str) -> Any:
    return importlib.import_module(SOURCES[name])


def find_source(storage: Storage, fmt: str | None = None) -> str | None:
    """(the coordinator of a load, when ``storage`` has no ``metadata.json``)
    The name of the source format ``storage`` holds, or None. ``fmt`` forces
    one (an unknown name is a :class:`~bytecp.errors.ConfigError`); ``"bytecp"`` none."""
    if fmt == "bytecp":
        return None
    if fmt is not None:
        if fmt not in SOURCES:
            raise ConfigError(f"format={fmt!r} is not a format bytecp reads; use one of "
                              f"{', '.join(['bytecp', *SOURCES])}")
        return fmt
    for name in SOURCES:
        if _module(name).detect(storage):
            return name
    return None


def read_source(storage: Storage, name: str) -> tuple[Any, list[Any]]:
    """(the coordinator of a load) ``(Metadata, rows)`` of the source ``name`` at ``storage``."""
    md, rows = _module(name).read(storage)
    return md, list(rows)


def exact_names(name: str) -> bool:
    """Whether source ``name``'s names are matched with the state's exactly and
    its dtypes never cast (its module says ``NAMES = "exact"``: DCP), rather
    than as transformers matches a Hugging Face directory's."""
    return getattr(_module(name), "NAMES", "transformers") == "exact"


def writer(fmt: str) -> Any:
    """The export function for ``--format fmt``."""
    try:
        module, attr = WRITERS[fmt].split(":")
    except KeyError:
        raise ConfigError(f"--format {fmt} is not one bytecp writes; use one of {', '.join(WRITERS)}") from None
    return getattr(importlib.import_module(module), attr)
