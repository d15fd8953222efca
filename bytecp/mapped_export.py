"""``bytecp export --spec NAME``: the checkpoint's tensors through a mapping
spec (:mod:`bytecp.mapping`) before they are written in the Hugging Face
layout, e.g. a Megatron GPTModel as ``LlamaForCausalLM``.

Called by :func:`bytecp.hf_export.export_hf` (one process) when a spec is
named, or detected: a Megatron checkpoint whose Hugging Face config's
``model_type`` names a registered spec. The conversion needs whole
tensors of several source entries at once (fused QKV, stacked layers), so
the exported model is held in memory, once (not streamed tensor by tensor
as a plain export is).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from bytecp.errors import ConfigError
from bytecp.export import CAST_DTYPES, ExportTensor, TensorReader, select_tensors
from bytecp.format import metadata as fmt
from bytecp.loading.opened import OpenedCheckpoint
from bytecp.mapping import convert_state_dict, get_spec, spec_names

__all__ = ["choose_spec", "MappedReader", "spec_params"]

_CASTABLE = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def choose_spec(md: fmt.Metadata, spec: str | None, config: bytes | None) -> str | None:
    """The spec to apply: ``spec`` (``"none"``: no spec), else the config's
    ``model_type`` when the checkpoint was saved by Megatron and a spec of
    that name is registered."""
    if spec == "none":
        return None
    if spec is not None:
        get_spec(spec)  # a clear error for an unknown name
        return spec
    if md.framework != "megatron" or config is None:
        return None
    model_type = json.loads(config).get("model_type")
    return model_type if model_type in spec_names() else None


def spec_params(config: Mapping[str, Any]) -> dict[str, Any]:
    """``heads``, ``groups``, ``vocab_size`` from a Hugging Face config dict."""
    heads = config.get("num_attention_heads", config.get("n_head"))
    if heads is None or "vocab_size" not in config:
        raise ConfigError("the Hugging Face config names no num_attention_heads (n_head) or vocab_size; "
                          "pass the model's config.json with --config")
    return {"heads": int(heads), "groups": int(config.get("num_key_value_heads") or heads),
            "vocab_size": int(config["vocab_size"])}


class MappedReader:
    """The converted tensors in memory, served like :class:`TensorReader`
    serves stored ones: :attr:`items` to plan shards, :meth:`read` to write them."""

    def __init__(self, opened: OpenedCheckpoint, where: str, spec: str, config: bytes | None, *,
                 prefix: str, dtype: str | None) -> None:
        if config is None:
            raise ConfigError(f"{where}: --spec {spec} needs the Hugging Face config (its heads, key/value heads "
                              "and vocabulary): pass --config FILE or save metadata={'hf_config': ...}")
        src, _ = select_tensors(opened.metadata, where, prefix=prefix, strip_prefix=True)
        sd = {it.name: t for it, t in TensorReader(opened).read(src)}
        self.tensors = convert_state_dict(sd, get_spec(spec), **spec_params(json.loads(config)))
        want = getattr(torch, CAST_DTYPES[dtype]) if dtype is not None else None
        if want is not None:
            self.tensors = {k: v.to(want) if v.dtype in _CASTABLE else v for k, v in self.tensors.items()}
        self.items = [ExportTensor(k, k, str(v.dtype).removeprefix("torch."), str(v.dtype).removeprefix("torch."),
                                   tuple(v.shape)) for k, v in self.tensors.items()]

    def read(self, items: Iterable[ExportTensor]) -> Iterator[tuple[ExportTensor, torch.Tensor]]:
        for it in items:
            yield it, self.tensors[it.fqn]
