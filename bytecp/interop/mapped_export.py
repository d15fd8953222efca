"""``bytecp export --spec NAME``: the checkpoint's tensors through a mapping
spec (:mod:`bytecp.interop.mapping`) before they are written in the Hugging Face
layout, e.g. a Megatron GPTModel as ``LlamaForCausalLM``.

Called by :func:`bytecp.interop.hf_export.export_hf` (one process) when a spec is
named, or detected: a Megatron checkpoint whose Hugging Face config's
``model_type`` names a registered spec. The conversion is planned from the
checkpoint's metadata alone (:func:`bytecp.interop.mapping.plan_conversion`: target
names, shapes and dtypes, every check made before a byte is read), then
streamed: each source tensor is read when the first of its targets is
written (a fused QKV, a layer-stacked tensor), converted, and dropped once
its targets are out, so memory holds one source tensor and its parts, not
the model.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from bytecp.errors import ConfigError
from bytecp.format import metadata as fmt
from bytecp.interop.export import CAST_DTYPES, CASTABLE, ExportTensor, TensorReader, select_tensors
from bytecp.interop.mapping import convert_planned, get_spec, plan_conversion, spec_names
from bytecp.loading.opened import OpenedCheckpoint
from bytecp.tree.dtypes import dtype_from_name, dtype_name

__all__ = ["choose_spec", "MappedReader", "spec_params"]



def choose_spec(md: fmt.Metadata, spec: str | None, config: bytes | None) -> str | None:
    """The spec to apply: ``spec`` (``"none"``: no spec), else the one named
    by the config's ``model_type`` when it is registered and converts from
    the framework that saved the checkpoint (its ``source_framework``; a
    checkpoint in that framework's own format read as a source, such as
    Megatron's ``megatron_torch_dist``, counts as that framework)."""
    if spec == "none":
        return None
    if spec is not None:
        get_spec(spec)  # a clear error for an unknown name
        return spec
    if config is None:
        return None
    model_type = json.loads(config).get("model_type")
    if model_type not in spec_names():
        return None
    source = get_spec(model_type).get("source_framework")
    return model_type if md.framework == source or md.framework.startswith(f"{source}_") else None


def spec_params(config: Mapping[str, Any]) -> dict[str, Any]:
    """``heads``, ``groups``, ``vocab_size`` from a Hugging Face config dict."""
    heads = config.get("num_attention_heads", config.get("n_head"))
    if heads is None or "vocab_size" not in config:
        raise ConfigError("the Hugging Face config names no num_attention_heads (n_head) or vocab_size; "
                          "pass the model's config.json with --config")
    return {"heads": int(heads), "groups": int(config.get("num_key_value_heads") or heads),
            "vocab_size": int(config["vocab_size"])}


class MappedReader:
    """The converted tensors, served like :class:`TensorReader` serves stored
    ones: :attr:`items` to plan shards, :meth:`read` to write them."""

    def __init__(self, opened: OpenedCheckpoint, where: str, spec: str, config: bytes | None, *,
                 prefix: str | None, dtype: str | None, masters: bool = False) -> None:
        if config is None:
            raise ConfigError(f"{where}: --spec {spec} needs the Hugging Face config (its heads, key/value heads "
                              "and vocabulary): pass --config FILE or save metadata={'hf_config': ...}")
        src, _ = select_tensors(opened.metadata, where, prefix=prefix, strip_prefix=True, masters=masters)
        self._sources = {it.name: it for it in src}
        self._params = spec_params(json.loads(config))
        shapes = {it.name: torch.empty(it.shape, dtype=dtype_from_name(it.dtype), device="meta") for it in src}
        self._plan = {p.name: p for p in plan_conversion(shapes, get_spec(spec), **self._params)}
        self._want = getattr(torch, CAST_DTYPES[dtype]) if dtype is not None else None
        self._reader = TensorReader(opened)
        self._held: tuple[str, torch.Tensor] | None = None
        self.items = [ExportTensor(p.name, p.name, dtype_name(p.dtype), dtype_name(self._cast(p.dtype)), p.shape)
                      for p in self._plan.values()]

    def _cast(self, dt: torch.dtype) -> torch.dtype:
        return self._want if self._want is not None and dtype_name(dt) in CASTABLE else dt

    def _fetch(self, source: str) -> torch.Tensor:
        """A source's full tensor; the last one stays held, so a source whose
        targets straddle two shard files is read once."""
        if self._held is None or self._held[0] != source:
            self._held = None  # drop the previous source before reading the next
            ((_, t),) = list(self._reader.read([self._sources[source]]))
            self._held = (source, t)
        return self._held[1]

    def read(self, items: Iterable[ExportTensor]) -> Iterator[tuple[ExportTensor, torch.Tensor]]:
        wanted = list(items)
        planned = convert_planned([self._plan[it.fqn] for it in wanted], self._fetch, **self._params)
        for it, (_, t) in zip(wanted, planned, strict=True):
            yield it, t.to(self._cast(t.dtype))

