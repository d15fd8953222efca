"""Which Lightning the plugin builds on: ``lightning.pytorch`` (the
``lightning`` distribution, what ``import lightning as L`` gives) or
``pytorch_lightning`` (the ``pytorch-lightning`` distribution).

The two are separate copies of the same classes: a ``Trainer`` of one
refuses the other's strategies. Imported once by
:mod:`bytecp.adapters.lightning`, which subclasses the strategies and
``CheckpointIO`` of the package chosen here:

1. ``BYTECP_LIGHTNING=lightning.pytorch`` or ``=pytorch_lightning``, if set;
2. the one the program has imported already, if only one is;
3. ``lightning.pytorch`` if it is installed, else ``pytorch_lightning``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any

from bytecp.plugins import missing_extra

__all__ = ["PACKAGES", "choose", "PACKAGE", "CheckpointIO", "DDPStrategy", "ModelParallelStrategy",
           "SingleDeviceStrategy", "TrainerFn", "ModelCheckpoint"]

PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # "lightning" itself missing
        return False


def choose() -> str:
    """The Lightning package to build on (see the module docstring)."""
    asked = os.environ.get("BYTECP_LIGHTNING")
    if asked:
        if asked not in PACKAGES:
            from bytecp.errors import ConfigError

            raise ConfigError(f"BYTECP_LIGHTNING={asked!r}: use one of {', '.join(PACKAGES)}")
        return asked
    imported = [p for p in PACKAGES if p in sys.modules]
    if len(imported) == 1:
        return imported[0]
    return next((p for p in PACKAGES if _installed(p)), PACKAGES[1])


def _load(package: str) -> dict[str, Any]:
    try:
        io = importlib.import_module(f"{package}.plugins.io")
        strategies = importlib.import_module(f"{package}.strategies")
        states = importlib.import_module(f"{package}.trainer.states")
        callbacks = importlib.import_module(f"{package}.callbacks")
    except ModuleNotFoundError as e:  # the lightning extra (make wheel-check runs without it)
        raise missing_extra(e, "lightning", "bytecp.adapters.lightning",
                            needs=f"PyTorch Lightning ({package}: no module {e.name!r})") from None
    return {"CheckpointIO": io.CheckpointIO, "DDPStrategy": strategies.DDPStrategy,
            "ModelParallelStrategy": strategies.ModelParallelStrategy,
            "SingleDeviceStrategy": strategies.SingleDeviceStrategy, "TrainerFn": states.TrainerFn,
            "ModelCheckpoint": callbacks.ModelCheckpoint}


PACKAGE = choose()
_classes = _load(PACKAGE)
CheckpointIO = _classes["CheckpointIO"]
DDPStrategy = _classes["DDPStrategy"]
ModelParallelStrategy = _classes["ModelParallelStrategy"]
SingleDeviceStrategy = _classes["SingleDeviceStrategy"]
TrainerFn = _classes["TrainerFn"]
ModelCheckpoint = _classes["ModelCheckpoint"]
