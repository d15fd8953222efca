"""Stateful helpers users put into ``state``: per-rank RNG and per-rank wrappers.

``state["rng"] = bytecp.RNGState()`` saves every rank's torch, numpy, python
(and CUDA, where present) generator states and restores them on the same rank;
``bytecp.PerRankState(obj)`` does the same for any ``Stateful`` object (a
dataloader, a sampler). ``bytecp.trainable(model)`` is the trainable part of
a model (a PEFT model's adapters), to save on its own. Adapters recognise both and store them per rank.
When a checkpoint is loaded by a different number of ranks, rank ``r``
restores the state saved by rank ``r % saved_world_size`` and a warning says
so -- except data loaders (a ``PerRankState`` is looked through): their
position reshards to the new ranks (:mod:`bytecp.data`).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from bytecp.errors import CorruptCheckpointError, one_line

__all__ = ["RNGState", "PerRankState", "trainable"]


def trainable(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters of ``module`` that require grad, by name (views, no copy).

    For PEFT fine-tunes: ``{"adapter": bytecp.trainable(model), "optimizer":
    opt}`` saves only the adapters (LoRA matrices) and their optimizer state,
    DTensors (FSDP2) included; ``bytecp.load`` of the same dict fills them in
    place, so an adapter checkpoint loads onto a base model built from its
    Hugging Face weights. Names are ``module.named_parameters()``'s.
    """
    return {n: p for n, p in module.named_parameters() if p.requires_grad}


class RNGState:
    """The calling process's random generator states, as a ``Stateful``."""

    def state_dict(self) -> dict[str, Any]:
        np_state: Any = np.random.get_state()
        py_state = random.getstate()
        out: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "numpy": {
                "kind": str(np_state[0]),
                "keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.uint32).view(np.int32).copy()),
                "pos": int(np_state[2]),
                "has_gauss": int(np_state[3]),
                "cached_gaussian": float(np_state[4]),
            },
            "python": [py_state[0], list(py_state[1]), py_state[2]],
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = torch.cuda.get_rng_state_all()
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` gave; a value of another shape (a damaged or
        crafted checkpoint) is refused whole, naming what it lacks, before any generator changes."""
        try:
            n = sd["numpy"]
            cpu, keys = sd["torch"], n["keys"].numpy().view(np.uint32)
            np_state = (n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"])
            v, internal, gauss = sd["python"]
            py_state = (v, tuple(internal), gauss)
            if not isinstance(cpu, torch.Tensor):
                raise TypeError(f"its 'torch' entry is a {type(cpu).__name__}, not a tensor")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CorruptCheckpointError(
                f"RNGState: the checkpoint's value is not an RNGState's state ({type(e).__name__}: "
                f"{one_line(e, 120)}); it is damaged, or was saved from another object under this key") from e
        torch.set_rng_state(cpu)
        np.random.set_state(np_state)
        random.setstate(py_state)
        if "cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(sd["cuda"])


class PerRankState:
    """Wrap a ``Stateful`` so each rank saves and restores its own state."""

    def __init__(self, obj: Any) -> None:
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"PerRankState needs an object with state_dict/load_state_dict, got {type(obj)}")
        self.obj = obj

    def state_dict(self) -> Any:
        return self.obj.state_dict()

    def load_state_dict(self, sd: Any) -> None:
        self.obj.load_state_dict(sd)
