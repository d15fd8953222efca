"""Hugging Face checkpoints for the torchtitan manager: the last-step export and
the initial load (``last_save_in_hf``, ``initial_load_in_hf``).

Both go through the model's torchtitan state-dict adapter (``sd_adapter``),
which renames and, for Llama, permutes the attention weights between
torchtitan's layout and Hugging Face's. Called on every rank by
:class:`~bytecp.adapters.torchtitan.BytecpCheckpointManager`.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

import bytecp
from bytecp.errors import BytecpError
from bytecp.format import metadata as fmt
from bytecp.interop.hf_export import export_hf
from bytecp.storage_api import open_storage

__all__ = ["export_last_step_hf", "load_initial_hf", "staging_url"]


def staging_url(url: str) -> tuple[str, str]:
    """The folder and name of the bytecp checkpoint of the converted tensors an
    export reads (beside ``url``, removed after it)."""
    head, _, name = url.rstrip("/").rpartition("/")
    return head or ".", f".{name}.hf-staging"


def _config_json(sd_adapter: Any) -> str | None:
    assets = getattr(sd_adapter, "hf_assets_path", None)
    path = os.path.join(assets, "config.json") if assets else None
    return path if path and os.path.isfile(path) else None


def export_last_step_hf(sd_adapter: Any, model_sd: dict[str, Any], url: str, save_kwargs: dict[str, Any]) -> None:
    """(every rank) ``url`` becomes a Hugging Face directory (``model*.safetensors``,
    the index when sharded, ``config.json`` when ``hf_assets_path`` has one).

    Every rank saves its shards of ``sd_adapter.to_hf(model_sd)`` as a bytecp
    checkpoint beside ``url``; the coordinator streams it out with
    :func:`bytecp.interop.hf_export.export_hf` and removes it. A failure there is
    raised on every rank."""
    folder, name = staging_url(url)
    staging = f"{folder}/{name}"
    kwargs = dict(save_kwargs, step=None)
    bytecp.save(staging, {"model": sd_adapter.to_hf(model_sd)}, **kwargs)
    rank = dist.get_rank() if dist.is_initialized() else 0
    error: list[str | None] = [None]
    if rank == 0:
        try:
            so = save_kwargs.get("storage_options") or {}
            export_hf(open_storage(staging, **so), url, prefix="model.", config=_config_json(sd_adapter),
                      overwrite=True, out_options=so)
            root = open_storage(folder, **so)
            root.delete([f"{name}/{fmt.METADATA_FILE}"])  # it stops existing first
            root.delete_prefix(name)
        except Exception as e:
            error[0] = f"{type(e).__name__}: {e}"
    if dist.is_initialized():
        dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise BytecpError(f"rank 0: exporting the last step to Hugging Face safetensors at {url} failed: "
                          f"{error[0]} (the converted tensors stay in {staging})")


def load_initial_hf(sd_adapter: Any, model: Any, path: str, quantized: bool) -> None:
    """(every rank) Fill ``model`` (torchtitan's ``ModelWrapper``) from the
    Hugging Face safetensors directory ``path`` (any bytecp storage URL).

    ``sd_adapter.to_hf`` names the model's tensors as the files do;
    :func:`bytecp.load` reads the directory as a foreign source into them
    (each rank only the byte ranges of its shards, dtypes cast to the
    model's), then ``from_hf`` converts back. As torchtitan's own reader,
    tensors of the files the model lacks are ignored (``rotary_emb.inv_freq``,
    a tied ``lm_head.weight``) and the model's tensors the files lack are an
    error. ``quantized`` (fp8 blocks with their scales) still goes through
    torchtitan's quantized reader (torch DCP's), which dequantizes them."""
    if sd_adapter is None:
        raise BytecpError("checkpoint.initial_load_in_hf needs the model's state-dict adapter (its ModelSpec has none)")
    hf_sd = sd_adapter.to_hf(model.state_dict())
    if quantized:
        import torch.distributed.checkpoint as dcp

        dcp.load(hf_sd, storage_reader=sd_adapter.get_hf_storage_reader(path, quantized))
    else:
        result = bytecp.load(path, hf_sd, strict=False)
        if result.missing_keys:
            few = ", ".join(result.missing_keys[:3]) + (" ..." if len(result.missing_keys) > 3 else "")
            raise BytecpError(f"checkpoint.initial_load_in_hf: {len(result.missing_keys)} of the model's tensors "
                              f"({few}, Hugging Face names) are not in {path}; is it this model's checkpoint?")
    model.load_state_dict(sd_adapter.from_hf(hf_sd))
