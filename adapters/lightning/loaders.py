"""The fit loop's train loaders, per rank: saved beside Lightning's trainer
state and resharded to another world size when the fit loop builds them.

Lightning keeps a stateful train loader's state (torchdata's
``StatefulDataLoader``) in the fit loop's state (``combined_loader``) of the
trainer state, which bytecp's plugin saves once, from rank 0; and it builds
the loaders only after the checkpoint is loaded (``setup_data``). So:

- save (every rank, :func:`loader_state`): each rank's live stateful train
  loaders go into the bytecp state under ``lightning_loaders`` (per rank,
  with their data positions: :mod:`bytecp.data`), and ``combined_loader``
  leaves the trainer state;
- load (every rank, :func:`defer_load`): once the fit loop has built its
  loaders, a second ``bytecp.load`` of ``lightning_loaders`` alone hands
  each rank's loader its own saved state, or, at another world size or
  layout, the state that continues the saved ranks' data stream; Lightning
  then has no ``combined_loader`` states of its own to load.

Called by :class:`~bytecp.adapters.lightning.BytecpStrategyMixin` (save and
load) and :class:`~bytecp.adapters.lightning.BytecpCheckpointIO`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

__all__ = ["LOADERS_KEY", "train_loaders", "loader_state", "defer_load"]

#: the bytecp state key of the fit loop's stateful train loaders, one value per rank each
LOADERS_KEY = "lightning_loaders"


def _stateful(x: Any) -> bool:
    return callable(getattr(x, "state_dict", None)) and callable(getattr(x, "load_state_dict", None))


def train_loaders(trainer: Any) -> list[Any]:
    """(every rank) The fit loop's stateful train loaders, in the order Lightning saves their states."""
    combined = getattr(getattr(trainer, "fit_loop", None), "_combined_loader", None)
    return [dl for dl in combined.flattened if _stateful(dl)] if combined is not None else []


def loader_state(rest: dict[str, Any], loaders: list[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(save) -> (the trainer state without ``combined_loader``, the loaders by index for the bytecp state)."""
    fit = ((rest.get("loops") or {}).get("fit_loop") or {}).get("state_dict")
    if not loaders or not isinstance(fit, dict) or "combined_loader" not in fit:
        return rest, {}
    out = copy.copy(rest)
    out["loops"] = copy.copy(rest["loops"])
    out["loops"]["fit_loop"] = copy.copy(rest["loops"]["fit_loop"])
    out["loops"]["fit_loop"]["state_dict"] = {k: v for k, v in fit.items() if k != "combined_loader"}
    return out, {str(i): dl for i, dl in enumerate(loaders)}


def defer_load(trainer: Any, load: Callable[[dict[str, Any]], None]) -> None:
    """(load, every rank) Load the saved train loaders once the fit loop has
    built them: ``load({LOADERS_KEY: {index: loader}})`` runs as the fit loop
    would restore ``combined_loader`` states, once."""
    fit_loop = getattr(trainer, "fit_loop", None)
    if fit_loop is None:
        return
    original = fit_loop._load_combined_loader_states

    def load_loaders() -> None:
        try:
            live = train_loaders(trainer)
            if live:
                load({LOADERS_KEY: {str(i): dl for i, dl in enumerate(live)}})
                fit_loop._combined_loader_states_to_load = []
        finally:
            del fit_loop._load_combined_loader_states  # the loop's own method again
        original()

    fit_loop._load_combined_loader_states = load_loaders
