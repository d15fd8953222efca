"""Lightning's own distributed checkpoints, resumed by bytecp's strategies.

A job that trained with Lightning's ``ModelParallelStrategy`` (FSDP2, tensor
parallel) left ``ModelCheckpoint`` folders such as ``step=6.ckpt/``: a torch
DCP checkpoint of ``{"state_dict": <model>, "optimizer_0": <optimizer>,
...}`` plus ``meta.pt``, ``torch.save`` of the rest of Lightning's checkpoint
(loops, callbacks, LR schedulers, ``global_step``). When that job moves onto
bytecp (``BytecpModelParallelStrategy``, ``BytecpDDPStrategy``,
``BytecpSingleDeviceStrategy``), ``trainer.fit(ckpt_path=...)`` on such a
folder is read by bytecp's DCP source (:mod:`bytecp.interop.dcp`), each
rank reading only its own boxes, and ``meta.pt`` with ``weights_only``
(``allow_pickle=True`` on the plugin reads it in full).

Called by :meth:`bytecp.adapters.lightning.BytecpCheckpointIO.load_into`
(every rank) when the URL is not a bytecp checkpoint but one of these.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch import nn

import bytecp
from bytecp.errors import ConfigError, CorruptCheckpointError, StateMismatchError
from bytecp.format import metadata as fmt
from bytecp.interop.dcp import is_dcp_dir
from bytecp.storage_api import Storage

__all__ = ["META_FILE", "is_native", "load_native"]

#: Lightning's file of the non-tensor checkpoint beside the DCP files
META_FILE = "meta.pt"


def is_native(storage: Storage) -> bool:
    """Whether ``storage`` holds a checkpoint Lightning's ModelParallelStrategy wrote."""
    return storage.exists(META_FILE) and not storage.exists(fmt.METADATA_FILE) and is_dcp_dir(storage)


def load_native(url: str, storage: Storage, model: nn.Module, optimizers: list[Any], *, strict: bool,
                allow_pickle: bool, options: dict[str, Any]) -> dict[str, Any]:
    """Fill ``model`` and ``optimizers`` in place from Lightning's DCP folder
    at ``url``; return the trainer state of its ``meta.pt``."""
    keys = [f"optimizer_{i}" for i in range(len(optimizers))]
    state: dict[str, Any] = {"state_dict": model, **dict(zip(keys, optimizers, strict=True))}
    result = bytecp.load(url, state, strict=False, format="dcp", allow_pickle=allow_pickle, **options)
    saved = {str(k) for k, _ in result.metadata.skeleton.items}
    if keys and not all(k in saved for k in keys):
        raise ConfigError(f"{url} holds no optimizer state for {', '.join(k for k in keys if k not in saved)} "
                          "(saved with save_weights_only=True?): it cannot resume training; load the weights "
                          "with trainer.validate/test(ckpt_path=...)")
    bad = [k for k in (*result.missing_keys, *result.unexpected_keys)
           if (k.startswith("state_dict.") and strict) or k.startswith("optimizer_")]
    if bad:
        raise StateMismatchError(f"{url} does not match the model and optimizers being restored: "
                                 f"{len(bad)} names differ, e.g. {bad[:4]}")
    data = storage.read_bytes(META_FILE)
    try:
        meta = torch.load(io.BytesIO(data), map_location="cpu", weights_only=not allow_pickle)
    except Exception as e:
        raise CorruptCheckpointError(
            f"{url}/{META_FILE}: Lightning's trainer state does not load with weights_only ({str(e)[:200]}); "
            "if you trust it, pass allow_pickle=True to BytecpCheckpointIO") from e
    if not isinstance(meta, dict):
        raise CorruptCheckpointError(f"{url}/{META_FILE}: holds a {type(meta).__name__}, not Lightning's checkpoint dict")
    return meta
