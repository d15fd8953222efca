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

With ``scatter=True`` (and ``changed_since``, ``dtype``: the run's serving
dtype) it yields ``(name, positions, values)`` triples instead: a tensor the
run's serving deltas take from ``changed_since`` to ``url`` for fewer bytes
(:mod:`bytecp.serving.deltas`: the chain of steps merged, every part's
crc32c checked) as the flat positions that changed and their new values,
for an in-place scatter into the engine's copy (``param.view(-1)[positions]
= values``); any other changed tensor whole, as ``(name, None, tensor)``.
The engine's copy is not seen here, so the element checksums are not
checked: ``bytecp.follow(..., dtype=)`` checks them against the state it holds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bytecp.errors import ConfigError
from bytecp.format.references import name_of, run_url
from bytecp.format.serving_wire import serving_dtype_name
from bytecp.interop.export import TensorReader, select_tensors
from bytecp.interop.hf_export import resolve_config
from bytecp.interop.mapped_export import MappedReader, choose_spec
from bytecp.loading.opened import OpenedCheckpoint, open_checkpoint
from bytecp.serving.changes import changed_tensors, rows_by_tensor
from bytecp.storage_api import open_storage
from bytecp.tree.bulk import gc_paused
from bytecp.tree.dtypes import dtype_from_name, dtype_name

__all__ = ["iter_weights", "Change"]

log = logging.getLogger("bytecp")

#: what ``iter_weights(..., scatter=True)`` yields: (name, flat positions or None for a whole tensor, values)
Change = tuple[str, torch.Tensor | None, torch.Tensor]


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
    scatter: bool = False,
) -> Iterator[Any]:
    """Yield ``(name, tensor)`` for the model tensors of checkpoint ``url``.

    ``names``: ``"bytecp"`` (stored names, ``prefix`` stripped) or ``"hf"``
    (Hugging Face names: through ``spec`` -- a registered spec name, or
    detected from the Hugging Face ``config`` / the checkpoint's
    ``hf_config`` -- else the stored names, which are a transformers model's
    own). ``dtype``: cast floating tensors (``"bf16"``, ``torch.float16``...).
    ``changed_since``: an older checkpoint of the same run; only tensors that
    differ from it are yielded (with a spec: every target of a changed
    source). ``checksums=False``: only references prove a tensor unchanged.
    ``scatter=True`` (with ``changed_since`` and ``dtype``, the run's serving
    dtype): ``(name, positions, values)`` triples, see the module's docstring.
    """
    if names not in ("bytecp", "hf"):
        raise ConfigError(f"names must be 'bytecp' or 'hf', got {names!r}")
    if scatter and (changed_since is None or dtype is None or spec is not None):
        raise ConfigError("scatter=True yields the changes since an older checkpoint in the run's serving dtype: "
                          "pass changed_since= and dtype= (and no spec=)")
    if names == "bytecp" and spec is not None:
        raise ConfigError("spec= converts to Hugging Face names: pass names='hf' with it")
    cast = dtype_name(dtype) if isinstance(dtype, torch.dtype) else dtype
    options = storage_options or {}
    # what is read and chosen before the first tensor makes an object or more per tensor: made with the
    # cyclic collector paused (else collections of the whole heap: 0.26 s each at 20,000 tensors), never
    # paused across a yield
    with gc_paused():
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
        if chosen is None:
            items, _ = select_tensors(md, url, prefix=prefix, dtype=cast, safetensors=False)
            items = [it for it in items if changed is None or it.fqn in changed]
            reader = TensorReader(opened) if not scatter else None
    if chosen is not None:
        yield from _mapped(opened, url, chosen, cfg, prefix, cast, changed)
        return
    if scatter:
        assert changed_since is not None
        yield from _scatter(opened, url, changed_since, items, serving_dtype_name(dtype), options)
        return
    assert reader is not None
    for it, t in reader.read(items):
        yield it.name, t.to(dtype_from_name(it.out_dtype))


def _scatter(opened: OpenedCheckpoint, url: str, since: str, items: list[Any], dtype: str,
             options: dict[str, Any]) -> Iterator[Change]:
    """``scatter=True``: each changed tensor as its changes from ``since`` (the
    deltas' chain, merged) or whole."""
    from bytecp.saving.serving import floating
    from bytecp.serving.delta_apply import Target, bring_forward, parts_for
    from bytecp.serving.delta_update import resolver
    from bytecp.serving.deltas import Chain, Mode, choose, read_payloads, walk
    from bytecp.tree.regions import Region

    md = opened.metadata
    held = open_checkpoint(open_storage(since, **options)).metadata.save_id
    served = [it for it in items if floating(it.dtype)]
    chain, modes = Chain([], False, []), {}
    if served and run_url(since) == run_url(url) and name_of(since) != name_of(url):
        budget = sum(it.numel * dtype_from_name(it.dtype).itemsize for it in served)
        chain = walk((url, "storage", opened.storage), md.save_id, held, dtype,
                     resolver({"storage": run_url(url)}, {"storage": options}), budget,
                     [(it.fqn, it.numel) for it in served])
        modes = {it.fqn: choose(chain, it.fqn, it.numel, it.dtype) for it in served}
    tdtype = dtype_from_name(dtype)
    targets = [Target(it.fqn, Region((0,) * len(it.shape), it.shape), it.shape, tdtype, [], owned=False)
               for it in served if modes.get(it.fqn, Mode("rows")).kind != "rows"]
    payloads, bad = read_payloads(chain, parts_for(chain, modes, targets))
    brought = bring_forward(chain, modes, targets, payloads, bad, dtype, {})
    why = [f"{k}: {v}" for k, v in sorted(brought.failed.items())] + chain.problems
    if why:
        log.warning("bytecp.iter_weights: %s: read whole instead of by serving deltas: %s", url, "; ".join(why[:3]))
    whole = []
    for it in items:
        key = (it.fqn, Region((0,) * len(it.shape), it.shape))
        if key in brought.nets:
            p, b = brought.nets[key]
            if not len(p):  # changed, but none of its values in the serving dtype: the engine holds them
                continue
            vals = torch.from_numpy(np.ascontiguousarray(b).view({1: np.uint8, 2: np.int16, 4: np.int32,
                                                                  8: np.int64}[tdtype.itemsize])).view(tdtype)
            yield it.name, torch.from_numpy(p), vals
        elif key in brought.staged:
            yield it.name, None, brought.staged[key].reshape(it.shape)
        else:
            whole.append(it)
    for it, t in TensorReader(opened).read(whole):
        yield it.name, None, t.to(dtype_from_name(it.out_dtype))


def _mapped(opened: OpenedCheckpoint, url: str, spec: str, cfg: bytes | None, prefix: str, cast: str | None,
            changed: set[str] | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Step 3 with a spec: the converted targets, those of changed sources only when asked."""
    reader = MappedReader(opened, url, spec, cfg, prefix=prefix, dtype=cast)
    head = prefix if not prefix or prefix.endswith(".") else prefix + "."
    plan = reader._plan  # each target's source, for changed_since
    items = [it for it in reader.items if changed is None or head + plan[it.fqn].source in changed]
    for it, t in reader.read(items):
        yield it.name, t
