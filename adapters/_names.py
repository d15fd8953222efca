"""Checkpoint names of a module's tensors: wrapper prefixes removed, ties found.

Wrappers put their own attribute into every name below them: ``module.``
(DDP, DataParallel), ``_orig_mod.`` (``torch.compile``'s ``OptimizedModule``),
``_checkpoint_wrapped_module.`` (activation checkpointing's
``checkpoint_wrapper``/``offload_wrapper``), ``_fsdp_wrapped_module.``
(FSDP1). None of them reaches a checkpoint: a model saved wrapped loads
unwrapped and the other way round, optimizer state included.

A name is cleaned by walking it through the module objects, so a hop is
dropped only where the module really is such a wrapper (a user's own
submodule called ``module`` keeps its name), at any depth (a block compiled
or checkpointed on its own), and also when the raw name already lacks the
hop (``checkpoint_wrapper``'s state-dict hook removes it from
``state_dict()`` keys but not from ``named_parameters()``). Modules that
declare hidden hops the way ``torch.distributed.checkpoint`` understands
(``_fqn_modifiers()``) are handled alike.

Called by the module adapters (plain, DDP, FSDP2, FSDP1) on every rank, for
every save and load, through :class:`ModuleNames`.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from bytecp.errors import ConfigError

__all__ = ["ModuleNames", "wrapper_hops"]

#: (module that defines the wrapper, class name, the attribute holding the wrapped module);
#: a module not yet imported cannot have made any wrapper, so none is imported here
_WRAPPERS = (
    ("torch.nn.parallel.distributed", "DistributedDataParallel", "module"),
    ("torch.nn.parallel.data_parallel", "DataParallel", "module"),
    ("torch._dynamo.eval_frame", "OptimizedModule", "_orig_mod"),
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "ActivationWrapper", "_checkpoint_wrapped_module"),
    ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel", "_fsdp_wrapped_module"),
)


#: module class -> the wrapper hops its instances have, for classes without
#: ``_fqn_modifiers`` (theirs depend on the class alone: a wrapper class not yet
#: imported when the class was made cannot be among its bases)
_CLASS_HOPS: dict[type, tuple[str, ...]] = {}


def wrapper_hops(m: nn.Module) -> tuple[str, ...]:
    """The attributes of ``m`` that checkpoint names skip (empty: not a wrapper)."""
    cls_of = type(m)
    known = _CLASS_HOPS.get(cls_of)
    if known is not None:
        return known
    hops: list[str] = []
    for mod, cls, attr in _WRAPPERS:
        t = getattr(sys.modules.get(mod), cls, None)
        if t is not None and isinstance(m, t):
            hops.append(attr)
    modifiers = getattr(m, "_fqn_modifiers", None)
    if callable(modifiers):
        hops.extend(str(v) for v in modifiers().values())
    elif modifiers is None and len(_CLASS_HOPS) < 4096:
        _CLASS_HOPS[cls_of] = tuple(hops)
    return tuple(hops)


class ModuleNames:
    """The clean names of one root module's parameters, buffers and state-dict keys.

    Built once per save/load call for each module of the state. A module
    tree without any wrapper (the usual case) keeps every name as it is, so
    :meth:`clean` returns it at once; otherwise each name is walked once.
    """

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self._hops: dict[int, tuple[str, ...]] = {}
        self._cleaned: dict[str, str] = {}
        self._unwrapped = not any(self._hops_of(m) for m in root.modules())

    def _hops_of(self, m: nn.Module) -> tuple[str, ...]:
        h = self._hops.get(id(m))
        if h is None:
            h = self._hops[id(m)] = wrapper_hops(m)
        return h

    def clean(self, raw: str) -> str:
        """``raw`` (a state-dict key, a parameter or module name) without wrapper hops."""
        if self._unwrapped:
            return raw
        done = self._cleaned.get(raw)
        if done is None:
            done = self._cleaned[raw] = self._walk(raw)
        return done

    def _walk(self, raw: str) -> str:
        parts = raw.split(".") if raw else []
        out: list[str] = []
        cur: nn.Module | None = self.root
        i = 0
        while i < len(parts):
            p = parts[i]
            if cur is None:
                out.append(p)
                i += 1
                continue
            hops = self._hops_of(cur)
            child = cur._modules.get(p)
            if p in hops:  # the wrapper's own hop
                cur, i = child, i + 1
            elif child is not None:
                out.append(p)
                cur, i = child, i + 1
            else:  # a tensor's name, or a key that skipped a wrapper's hop: look inside it
                inner = next((cur._modules[h] for h in hops if cur._modules.get(h) is not None), None)
                if inner is None:
                    out.append(p)
                    i += 1
                cur = inner
        return ".".join(out)

    def state_dict(self) -> tuple[dict[str, Any], dict[str, str]]:
        """``(state dict by clean name, clean name -> raw key)``: the module's
        ``state_dict()`` (views of the live tensors) under names without wrappers."""
        sd = self.root.state_dict()
        out: dict[str, Any] = {}
        raw: dict[str, str] = {}
        for k, v in sd.items():
            name = self.clean(k)
            if name in raw:
                raise ConfigError(
                    f"state-dict keys {raw[name]!r} and {k!r} of {type(self.root).__name__} both become "
                    f"{name!r} once wrapper prefixes are removed; rename one of them"
                )
            out[name] = v
            raw[name] = k
        return out, raw

    def params(self) -> dict[int, str]:
        """``id(param) -> clean name`` (the first name of a tied parameter)."""
        return {id(p): self.clean(n) for n, p in self.root.named_parameters()}

    def ties(self) -> dict[str, str]:
        """Clean name -> the clean name seen first, for every parameter or
        buffer registered under several names (tied embeddings, a layer used
        twice): the model's structure, the same on every rank."""
        first: dict[int, str] = {}
        out: dict[str, str] = {}
        named = [*self.root.named_parameters(remove_duplicate=False), *self.root.named_buffers(remove_duplicate=False)]
        for n, t in named:
            if not isinstance(t, torch.Tensor):
                continue
            name = self.clean(n)
            seen = first.setdefault(id(t), name)
            if seen != name:
                out[name] = seen
        return out

    def tie(self, leaves: dict[str, Any]) -> dict[str, Any]:
        """``leaves`` (by clean name) with each tied name holding the very
        object of the name it is tied to, so the core stores it once."""
        for name, first in self.ties().items():
            if name in leaves and first in leaves:
                leaves[name] = leaves[first]
        return leaves
