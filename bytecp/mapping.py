"""Declarative state-dict mappings between model families (pure functions, torch only).

A *mapping spec* is JSON-able data, not code per model: a list of rules, each
taking one source tensor to one or more target tensors, plus ``ignore``
patterns for source entries that have no target. Applied by
:func:`convert_state_dict` to a full state dict (``bytecp.load_state_dict(url)
["model"]``), e.g. a Megatron GPT checkpoint to a plain PyTorch / Hugging Face
GPT-style model. Every source key must be used or ignored, every rule's
source must exist (or its ``fallback``): nothing is dropped silently.

Rule fields:

- ``from``: source key; ``to``: target name, or a list of names for ``split``;
  ``{layer}`` in a target name unstacks a layer-stacked source (dim 0 is the
  layer) into one tensor per layer;
- ``split``: ``"qkv"`` splits a fused QKV weight/bias in Megatron's
  interleaved order: per query group, ``heads/groups`` query heads then one
  key and one value head, each ``head_dim`` rows -> separate q, k, v tensors
  in plain head order;
- ``rows``: a parameter name whose value is the number of rows to keep (drops
  vocabulary padding);
- ``fallback``: a source key used when ``from`` is absent (a tied output layer
  takes the embedding: untying).

Parameters (``heads``, ``groups``, ``vocab_size``, ...) are given at
conversion time, so one spec serves every size of the model family.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

import torch

from bytecp.errors import ConfigError, StateMismatchError

__all__ = ["convert_state_dict", "split_interleaved_qkv"]


def split_interleaved_qkv(t: torch.Tensor, heads: int, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's fused QKV (rows grouped per query group as [q heads, k, v])
    as separate q, k, v in plain head order. Works for weights and biases."""
    if heads % groups:
        raise ConfigError(f"{heads} attention heads do not divide into {groups} query groups")
    per = heads // groups
    rows = t.shape[0]
    if rows % (groups * (per + 2)):
        raise ConfigError(
            f"a fused QKV of {rows} rows does not split into {groups} groups of {per} query heads "
            "plus a key and a value head; check heads/groups"
        )
    hd = rows // (groups * (per + 2))
    g = t.reshape(groups, (per + 2) * hd, *t.shape[1:])
    q = g[:, : per * hd].reshape(groups * per * hd, *t.shape[1:])
    k = g[:, per * hd : (per + 1) * hd].reshape(groups * hd, *t.shape[1:])
    v = g[:, (per + 1) * hd :].reshape(groups * hd, *t.shape[1:])
    return q.clone(), k.clone(), v.clone()


def _param(params: Mapping[str, Any], name: str, rule: Mapping[str, Any]) -> Any:
    if name not in params:
        raise ConfigError(f"mapping rule {dict(rule)} needs the parameter {name!r}; pass {name}=...")
    return params[name]


def _apply(rule: Mapping[str, Any], t: torch.Tensor, params: Mapping[str, Any]) -> list[torch.Tensor]:
    if "rows" in rule:
        n = int(_param(params, rule["rows"], rule))
        if not 0 < n <= t.shape[0]:
            raise StateMismatchError(f"{rule['from']}: {n} rows asked for, the tensor has {list(t.shape)}")
        t = t[:n]
    if rule.get("split") == "qkv":
        heads = int(_param(params, "heads", rule))
        groups = int(params.get("groups") or heads)
        return list(split_interleaved_qkv(t, heads, groups))
    if rule.get("split") is not None:
        raise ConfigError(f"mapping rule {dict(rule)}: unknown split {rule['split']!r} (known: 'qkv')")
    return [t]


def convert_state_dict(
    sd: Mapping[str, Any], spec: Mapping[str, Any], **params: Any
) -> dict[str, torch.Tensor]:
    """``sd`` (full tensors by source name) as the target model's state dict.

    ``spec`` is ``{"rules": [...], "ignore": [glob, ...]}``. Raises
    :class:`StateMismatchError` for a missing source and for source entries
    no rule uses and no ``ignore`` pattern names.
    """
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for rule in spec["rules"]:
        src = rule["from"]
        if src not in sd and rule.get("fallback") in sd:
            src = rule["fallback"]
        if src not in sd:
            raise StateMismatchError(f"the checkpoint has no {rule['from']!r} (rule {dict(rule)})")
        used.add(src)
        t = sd[src]
        if not isinstance(t, torch.Tensor):
            raise StateMismatchError(f"{src!r} is a {type(t).__name__}, not a tensor")
        names = rule["to"] if isinstance(rule["to"], list) else [rule["to"]]
        layered = any("{layer}" in n for n in names)
        slices = [(i, t[i]) for i in range(t.shape[0])] if layered else [(None, t)]
        for layer, piece in slices:
            parts = _apply(rule, piece, params)
            if len(parts) != len(names):
                raise ConfigError(f"mapping rule {dict(rule)} makes {len(parts)} tensors for {len(names)} names")
            for name, part in zip(names, parts, strict=True):
                key = name.format(layer=layer) if layer is not None else name
                if key in out:
                    raise ConfigError(f"mapping spec writes {key!r} twice")
                out[key] = part.contiguous()
    ignore = list(spec.get("ignore", []))
    rest = sorted(k for k in sd if k not in used and not any(fnmatch.fnmatchcase(k, p) for p in ignore))
    if rest:
        raise StateMismatchError(
            f"the mapping spec uses no rule for {len(rest)} entries of the checkpoint: {rest[:8]}; "
            "add rules for them or 'ignore' patterns"
        )
    return out
