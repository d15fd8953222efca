"""A DeepSpeed engine's own state: what ``engine.save_checkpoint`` writes
beside the module and the optimizer, so that ``{"model": engine}`` means the
whole engine.

Used by :func:`.adapter.expand_engines` (every rank, save
and load), which adds an :class:`EngineState` under ``"engine"`` beside the
engine's module and optimizer. It is a ``Stateful``: the core stores its
``state_dict()`` as values (JSON where they are JSON: counters, the
scheduler's and the loss scaler's numbers; the same on every rank, stored
once) and hands ``load_state_dict`` what the checkpoint holds of it, less
what ``exclude=`` left out (``exclude=["engine.lr_scheduler"]`` keeps the
engine's scheduler as it is, ``exclude=["engine"]`` all of it).

The parts, as DeepSpeed 0.19's ``_common_checkpoint_state`` and its load
name them: ``global_steps``, ``global_samples``, ``skipped_steps``,
``lr_scheduler`` (the engine's scheduler's ``state_dict``), ``data_sampler``
(the training data loader's sampler, where it has a state: curriculum
learning), ``data_sampler_rng`` (the state of the generator that sampler
draws its global batches with, ``np_rng``, which DeepSpeed 0.19's own
``state_dict`` leaves out: it saves numpy's global generator instead, so
its resumed draws differ from the uninterrupted run's; JSON),
``random_ltd`` (its scheduler, when enabled) and ``loss_scaler``
(the numbers a dynamic loss scaler moves as it trains: ``cur_scale``,
``cur_iter``, ``last_overflow_iter``, ``cur_hysteresis``; DeepSpeed pickles
the whole object into its optimizer file instead). A part the engine has no
object for is None.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["EngineState", "SCALER_FIELDS"]

log = logging.getLogger("bytecp")

#: what a dynamic loss scaler changes while it trains (its settings come from the config)
SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def _sampler(engine: Any) -> Any:
    loader = getattr(engine, "training_dataloader", None)
    sampler = getattr(loader, "data_sampler", None)
    return sampler if callable(getattr(sampler, "state_dict", None)) else None


def _sampler_rng(sampler: Any) -> Any:
    """The numpy ``Generator`` a curriculum sampler draws with (rank 0 draws every global batch)."""
    rng = getattr(sampler, "np_rng", None)
    return rng if rng is not None and hasattr(getattr(rng, "bit_generator", None), "state") else None


def _random_ltd(engine: Any) -> Any:
    enabled = getattr(engine, "random_ltd_enabled", None)
    return getattr(engine, "random_ltd_scheduler", None) if callable(enabled) and enabled() else None


def _scaler(engine: Any) -> Any:
    opt = getattr(engine, "optimizer", None)
    scaler = getattr(opt, "loss_scaler", None)
    return scaler if scaler is not None and all(hasattr(scaler, f) for f in SCALER_FIELDS[:2]) else None


def _jsonable(v: Any) -> Any:
    """A sampler state as JSON values: the curriculum sampler's holds numpy
    integers (cluster positions) and numpy's generator state (a tuple with an
    array), which would otherwise need an arbitrary pickle."""
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    tolist = getattr(v, "tolist", None)  # numpy scalars and arrays
    return tolist() if callable(tolist) and type(v).__module__ == "numpy" else v


def _sampler_state(saved: dict[str, Any]) -> dict[str, Any]:
    """The curriculum sampler's state as its ``load_state_dict`` takes it:
    numpy's generator state a tuple again (``np.random.set_state``)."""
    rng = saved.get("np_rng_state")
    if isinstance(rng, list) and len(rng) == 5:
        import numpy as np

        saved = {**saved, "np_rng_state": (rng[0], np.asarray(rng[1], dtype=np.uint32), *rng[2:])}
    return saved


def _plain(v: Any) -> Any:
    """A scaler's number as a JSON value (DeepSpeed keeps some as 0-dim tensors)."""
    item = getattr(v, "item", None)
    return item() if callable(item) else v


class EngineState:
    """The counters, scheduler, sampler and loss scaler of one DeepSpeed engine (a ``Stateful``)."""

    def __init__(self, engine: Any, name: str = "model") -> None:
        self.engine = engine
        #: the engine's key in the state (named in warnings)
        self.name = name

    def state_dict(self) -> dict[str, Any]:
        e = self.engine
        scaler = _scaler(e)
        sampler, ltd = _sampler(e), _random_ltd(e)
        return {
            "global_steps": int(e.global_steps),
            "global_samples": int(getattr(e, "global_samples", 0)),
            "skipped_steps": int(e.skipped_steps),
            "lr_scheduler": e.lr_scheduler.state_dict() if e.lr_scheduler is not None else None,
            "data_sampler": _jsonable(sampler.state_dict()) if sampler is not None else None,
            "data_sampler_rng": _sampler_rng(sampler).bit_generator.state if _sampler_rng(sampler) is not None
            else None,
            "random_ltd": ltd.state_dict() if ltd is not None else None,
            "loss_scaler": {f: _plain(getattr(scaler, f)) for f in SCALER_FIELDS if hasattr(scaler, f)}
            if scaler is not None else None,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore the parts ``sd`` holds (those ``exclude=`` left out are absent: kept as they are)."""
        e = self.engine
        for counter in ("global_steps", "global_samples", "skipped_steps"):
            if sd.get(counter) is not None:
                setattr(e, counter, int(sd[counter]))
        for part, obj in (("lr_scheduler", e.lr_scheduler), ("data_sampler", _sampler(e)),
                          ("random_ltd", _random_ltd(e))):
            saved = sd.get(part)
            if saved is None:
                continue
            if obj is None:
                log.warning("bytecp: the checkpoint holds the %s state of engine %r, which has no %s now: "
                            "not restored", part, self.name, part)
                continue
            obj.load_state_dict(_sampler_state(saved) if part == "data_sampler" else saved)
        rng, saved = _sampler_rng(_sampler(e)), sd.get("data_sampler_rng")
        if rng is not None and saved is not None:
            rng.bit_generator.state = saved
        saved = sd.get("loss_scaler")
        scaler = _scaler(e)
        if saved is not None and scaler is not None:
            for f, v in saved.items():
                if f in SCALER_FIELDS and hasattr(scaler, f):
                    setattr(scaler, f, v)
