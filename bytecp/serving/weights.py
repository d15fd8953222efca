"""``bytecp.iter_weights``: a checkpoint's model weights as ``(name, tensor)``
pairs, one tensor at a time -- what vLLM's and SGLang's
``model.load_weights(weights)`` and a transformers model's
``load_state_dict`` take.

Called by user code in one process (an inference engine's worker, an
evaluation job). In order:

1. opens the checkpoint (:func:`bytecp.loading.opened.open_checkpoint`):
   its metadata and every index row, sizes checked against the real files;
2. with ``changed_since``, keeps only the tensors whose rows differ from that
   older checkpoint's (:func:`bytecp.serving.changes.changed_tensors`: no
   data read to decide);
3. names them: bytecp's names under ``prefix`` with it stripped, as
   ``bytecp export`` writes them (a transformers model saved as
   ``{"model": model}`` gives its own Hugging Face names); with
   ``names="hf"`` and a spec (named, or detected for a Megatron checkpoint
   from its Hugging Face config), the spec's conversion
   (:class:`bytecp.interop.mapped_export.MappedReader`);
4. reads them through :class:`bytecp.interop.export.TensorReader` (planned
   ranged reads, every chunk's crc32c checked), casting floating tensors to
   ``dtype``; the consumer holds each tensor only as long as it wants.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from bytecp.errors import ConfigError
from bytecp.interop.export import TensorReader, select_tensors
from bytecp.interop.hf_export import resolve_config
from bytecp.interop.mapped_export import MappedReader, choose_spec
from bytecp.loading.opened import OpenedCheckpoint, open_checkpoint
from bytecp.serving.changes import changed_tensors, rows_by_tensor
from bytecp.storage_api import open_storage
from bytecp.tree.dtypes import dtype_from_name, dtype_name

__all__ = ["iter_weights"]


def _open(url: str, options: dict[str, Any]) -> OpenedCheckpoint:
    opened = open_checkpoint(open_storage(url, **options))
    opened.all_rows()
    opened.check_sizes()
    return opened


def iter_weights(
    url: str,
    *,
    names: str = "bytecp",
    spec: str | None = None,
    dtype: str | torch.dtype | None = None,
    changed_since: str | None = None,
    prefix: str = "model.",
    config: str | Path | dict[str, Any] | None = None,
    checksums: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for the model tensors of checkpoint ``url``.

    ``names``: ``"bytecp"`` (stored names, ``prefix`` stripped) or ``"hf"``
    (Hugging Face names: through ``spec`` -- a registered spec name, or
    detected from the Hugging Face ``config`` / the checkpoint's
    ``hf_config`` -- else the stored names, which are a transformers model's
    own). ``dtype``: cast floating tensors (``"bf16"``, ``torch.float16``...).
    ``changed_since``: an older checkpoint of the same run; only tensors that
    differ from it are yielded (with a spec: every target of a changed
    source). ``checksums=False``: only references prove a tensor unchanged.
    """
    if names not in ("bytecp", "hf"):
        raise ConfigError(f"names must be 'bytecp' or 'hf', got {names!r}")
    if names == "bytecp" and spec is not None:
        raise ConfigError("spec= converts to Hugging Face names: pass names='hf' with it")
    cast = dtype_name(dtype) if isinstance(dtype, torch.dtype) else dtype
    options = storage_options or {}
    opened = _open(url, options)
    md = opened.metadata
    rows = rows_by_tensor(opened.all_rows())
    changed: set[str] | None = None
    if changed_since is not None:
        old = _open(changed_since, options)
        changed = set(changed_tensors(list(md.tensors), rows, url, rows_by_tensor(old.all_rows()),
                                      changed_since, checksums=checksums).changed)
    chosen = None
    cfg: bytes | None = None
    if names == "hf":
        cfg, _ = resolve_config(md, url, config, None)
        chosen = choose_spec(md, spec, cfg)
    if chosen is not None:
        yield from _mapped(opened, url, chosen, cfg, prefix, cast, changed)
        return
    items, _ = select_tensors(md, url, prefix=prefix, dtype=cast, safetensors=False)
    items = [it for it in items if changed is None or it.fqn in changed]
    for it, t in TensorReader(opened).read(items):
        yield it.name, t.to(dtype_from_name(it.out_dtype))


def _mapped(opened: OpenedCheckpoint, url: str, spec: str, cfg: bytes | None, prefix: str, cast: str | None,
            changed: set[str] | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Step 3 with a spec: the converted targets, those of changed sources only when asked."""
    reader = MappedReader(opened, url, spec, cfg, prefix=prefix, dtype=cast)
    head = prefix if not prefix or prefix.endswith(".") else prefix + "."
    plan = reader._plan  # each target's source, for changed_since
    items = [it for it in reader.items if changed is None or head + plan[it.fqn].source in changed]
    for it, t in reader.read(items):
        yield it.name, t
