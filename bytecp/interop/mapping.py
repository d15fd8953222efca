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
  in plain head order; ``"gate_up"`` splits a gated MLP's fc1 (``[gate; up]``
  on dim 0, as Megatron's SwiGLU holds it) into gate and up;
- ``concat``: after a split, join the parts again on dim 0 into one target
  (GPT-2's ``c_attn`` is ``[q; k; v]`` in plain order);
- ``transpose``: the target is the transpose of the (2-D) tensor (GPT-2's
  ``Conv1D`` weights are ``[in, out]``);
- ``rows``: a parameter name whose value is the number of rows to keep (drops
  vocabulary padding);
- ``fallback``: a source key used when ``from`` is absent (a tied output layer
  takes the embedding: untying).

A spec's ``source_framework`` (the framework recorded in the checkpoints it
converts, e.g. ``"megatron"``) lets ``bytecp export`` apply it unasked to
such a checkpoint whose Hugging Face config's ``model_type`` names it.

Parameters (``heads``, ``groups``, ``vocab_size``, ...) are given at
conversion time, so one spec serves every size of the model family.

Every operation has an inverse, so :func:`invert_state_dict` reads the same
spec backwards (target names -> source names: q/k/v fused in Megatron's
interleaved order, gate and up joined, per-layer tensors stacked again);
``reverse_ignore`` lists target entries with no source (buffers).

Specs are found by name through :func:`get_spec` (``register_spec`` adds
one; the built-in Megatron <-> transformers specs live in
``bytecp.adapters.megatron.hf`` and are imported only when named).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from bytecp.errors import ConfigError, StateMismatchError

__all__ = [
    "convert_state_dict", "invert_state_dict", "plan_conversion", "convert_planned", "Produced", "split_interleaved_qkv", "fuse_interleaved_qkv", "get_spec",
    "register_spec", "spec_names",
]  # fmt: skip

#: built-in specs by name, as lazy ``"module:attr"`` strings (see :func:`get_spec`)
_SPECS: dict[str, Any] = {
    name: f"bytecp.adapters.megatron.hf:{name.upper()}" for name in ("gpt2", "llama", "qwen2", "mixtral")
}


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


def fuse_interleaved_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """The inverse of :func:`split_interleaved_qkv`: separate q, k, v (plain
    head order) as Megatron's fused QKV, per query group [q heads, k, v]."""
    if heads % groups:
        raise ConfigError(f"{heads} attention heads do not divide into {groups} query groups")
    per = heads // groups
    if q.shape[0] % heads or k.shape[0] * heads != q.shape[0] * groups or k.shape != v.shape:
        raise StateMismatchError(
            f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} are not {heads} query heads and "
            f"{groups} key/value heads of one size; check heads/groups"
        )
    hd = q.shape[0] // heads
    rest = tuple(q.shape[1:])
    fused = torch.cat([q.reshape(groups, per * hd, *rest), k.reshape(groups, hd, *rest),
                       v.reshape(groups, hd, *rest)], dim=1)
    return fused.reshape(groups * (per + 2) * hd, *rest).contiguous()


def register_spec(name: str, spec: Mapping[str, Any] | str) -> None:
    """Name a spec for :func:`get_spec` (and ``bytecp export --spec NAME``):
    the spec itself, or a lazy ``"module:attr"`` string."""
    _SPECS[name] = spec


def spec_names() -> list[str]:
    return sorted(_SPECS)


def get_spec(name: str) -> dict[str, Any]:
    """The spec registered under ``name``."""
    if name not in _SPECS:
        raise ConfigError(f"no mapping spec named {name!r}; known: {', '.join(spec_names())}")
    spec = _SPECS[name]
    if isinstance(spec, str):
        module, _, attr = spec.partition(":")
        spec = getattr(importlib.import_module(module), attr)
        _SPECS[name] = spec
    return dict(spec)


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
    split = rule.get("split")
    if split == "qkv":
        heads = int(_param(params, "heads", rule))
        groups = int(params.get("groups") or heads)
        parts = list(split_interleaved_qkv(t, heads, groups))
    elif split == "gate_up":
        if t.shape[0] % 2:
            raise StateMismatchError(f"{rule['from']}: a gated fc1 of {t.shape[0]} rows does not split in two halves")
        parts = [p.clone() for p in t.chunk(2, dim=0)]
    elif split is not None:
        raise ConfigError(f"mapping rule {dict(rule)}: unknown split {split!r} (known: 'qkv', 'gate_up')")
    else:
        parts = [t]
    if rule.get("concat"):
        parts = [torch.cat(parts, dim=0)]
    if rule.get("transpose"):
        parts = [p.t() for p in parts]
    return parts


def _unapply(rule: Mapping[str, Any], parts: list[torch.Tensor], params: Mapping[str, Any]) -> torch.Tensor:
    """The inverse of :func:`_apply` (``rows`` keeps the rows given)."""
    if rule.get("transpose"):
        parts = [p.t() for p in parts]
    split = rule.get("split")
    heads = int(_param(params, "heads", rule)) if split == "qkv" else 0
    groups = int(params.get("groups") or heads) if split == "qkv" else 0
    if rule.get("concat"):
        (t,) = parts
        if split == "qkv":
            hd = t.shape[0] // (heads + 2 * groups)
            parts = list(t.split([heads * hd, groups * hd, groups * hd], dim=0))
        else:
            parts = list(t.chunk(2, dim=0))
    if split == "qkv":
        q, k, v = parts
        return fuse_interleaved_qkv(q, k, v, heads, groups)
    return torch.cat(parts, dim=0) if split == "gate_up" else parts[0]


@dataclasses.dataclass(frozen=True, eq=False)
class Produced:
    """One target tensor of a conversion (:func:`plan_conversion`): part
    ``part`` of what ``rule`` makes of ``source`` (of its ``layer`` slice
    when the source is layer-stacked), with its shape and dtype."""

    name: str
    source: str
    layer: int | None
    part: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    rule: Mapping[str, Any]


def _all_used(sd: Mapping[str, Any], used: set[str], ignore: Sequence[str], what: str, key: str) -> None:
    """Nothing dropped silently: every entry of ``sd`` a rule used or a ``key`` pattern names."""
    rest = sorted(k for k in sd if k not in used and not any(fnmatch.fnmatchcase(k, p) for p in ignore))
    if rest:
        raise StateMismatchError(f"the mapping spec uses no rule for {len(rest)} entries of {what}: {rest[:8]}; "
                                 f"add rules for them or {key!r} patterns")


def plan_conversion(sd: Mapping[str, Any], spec: Mapping[str, Any], **params: Any) -> list[Produced]:
    """What :func:`convert_state_dict` makes of ``sd``, worked out on shapes
    alone: ``sd``'s tensors may be ``meta`` tensors (an exporter plans from a
    checkpoint's metadata, then reads one source at a time). The targets come
    in the spec's order, every check of the conversion made here."""
    plan: list[Produced] = []
    used: set[str] = set()
    seen: set[str] = set()
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
        meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
        names = rule["to"] if isinstance(rule["to"], list) else [rule["to"]]
        layers: list[int | None] = (list(range(t.shape[0])) if any("{layer}" in n for n in names) else [None])
        for layer in layers:
            parts = _apply(rule, meta[layer] if layer is not None else meta, params)
            if len(parts) != len(names):
                raise ConfigError(f"mapping rule {dict(rule)} makes {len(parts)} tensors for {len(names)} names")
            for i, (name, part) in enumerate(zip(names, parts, strict=True)):
                key = name.format(layer=layer) if layer is not None else name
                if key in seen:
                    raise ConfigError(f"mapping spec writes {key!r} twice")
                seen.add(key)
                plan.append(Produced(key, src, layer, i, tuple(part.shape), part.dtype, rule))
    _all_used(sd, used, spec.get("ignore", []), "the checkpoint", "ignore")
    return plan


def convert_planned(
    plan: Iterable[Produced], fetch: Callable[[str], torch.Tensor], **params: Any
) -> Iterator[tuple[Produced, torch.Tensor]]:
    """The planned targets, computed in order; ``fetch(source)`` gives a
    source's full tensor, asked again only when the source changes (a plan's
    targets of one source are consecutive), so at most one source tensor and
    one rule's parts are held at a time."""
    source: tuple[str, torch.Tensor] | None = None
    made: tuple[Mapping[str, Any], int | None, list[torch.Tensor]] | None = None
    for p in plan:
        if source is None or source[0] != p.source:
            source = made = None  # drop the previous source before reading the next
            source = (p.source, fetch(p.source))
        if made is None or made[0] is not p.rule or made[1] != p.layer:
            made = None
            t = source[1]
            made = (p.rule, p.layer, _apply(p.rule, t[p.layer] if p.layer is not None else t, params))
        yield p, made[2][p.part].contiguous()


def convert_state_dict(
    sd: Mapping[str, Any], spec: Mapping[str, Any], **params: Any
) -> dict[str, torch.Tensor]:
    """``sd`` (full tensors by source name) as the target model's state dict.

    ``spec`` is ``{"rules": [...], "ignore": [glob, ...]}``. Raises
    :class:`StateMismatchError` for a missing source and for source entries
    no rule uses and no ``ignore`` pattern names.
    """
    plan = plan_conversion(sd, spec, **params)
    return {p.name: t for p, t in convert_planned(plan, sd.__getitem__, **params)}


def _layers_of(names: list[str], sd: Mapping[str, Any]) -> list[int]:
    pattern = re.compile(re.escape(names[0]).replace(re.escape("{layer}"), r"(\d+)"))
    found = sorted({int(m.group(1)) for k in sd if (m := pattern.fullmatch(k))})
    if found != list(range(len(found))):
        raise StateMismatchError(f"{names[0]}: layers {found} are not 0..{len(found) - 1}")
    return found


def invert_state_dict(
    sd: Mapping[str, Any], spec: Mapping[str, Any], **params: Any
) -> dict[str, torch.Tensor]:
    """``sd`` (full tensors by *target* name, e.g. a Hugging Face model's) as
    the spec's *source* state dict (e.g. Megatron's checkpoint keys, layers
    stacked): the spec read backwards.

    A rule whose targets are absent but whose ``fallback`` source another rule
    fills (a tied output layer) takes that tensor. Raises
    :class:`StateMismatchError` for a missing target and for target entries no
    rule uses and no ``reverse_ignore`` pattern names.
    """
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    deferred: list[Mapping[str, Any]] = []
    for rule in spec["rules"]:
        names = rule["to"] if isinstance(rule["to"], list) else [rule["to"]]
        layered = any("{layer}" in n for n in names)
        layers = _layers_of(names, sd) if layered else [None]
        keys = [[n.format(layer=i) if i is not None else n for n in names] for i in layers]
        if not layers or any(k not in sd for ks in keys for k in ks):
            if rule.get("fallback"):
                deferred.append(rule)
                continue
            missing = next((k for ks in keys for k in ks if k not in sd), names[0])
            raise StateMismatchError(f"the state dict has no {missing!r} (rule {dict(rule)})")
        pieces = []
        for ks in keys:
            used.update(ks)
            pieces.append(_unapply(rule, [sd[k] for k in ks], params))
        if rule["from"] in out:
            raise ConfigError(f"mapping spec writes {rule['from']!r} twice")
        out[rule["from"]] = (torch.stack(pieces) if layered else pieces[0]).contiguous()
    for rule in deferred:
        if rule["fallback"] not in out:
            raise StateMismatchError(f"the state dict has neither {rule['to']!r} nor a tensor for {rule['fallback']!r}")
        out[rule["from"]] = out[rule["fallback"]].clone()
    _all_used(sd, used, spec.get("reverse_ignore", []), "the state dict", "reverse_ignore")
    return out
