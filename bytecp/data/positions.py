"""The checkpoint's compact data position: every rank's position merged at the
commit (``metadata.json`` member ``data``, FORMAT.md §6.8), and what a load
hands a resharder.

Called by the commit (coordinator: :func:`merge_positions` over the JSON
text every rank sent), by ``Metadata.from_bytes`` (:func:`check_data`), by
the load's match phase (every rank: :class:`SavedData`) and by ``bytecp
inspect`` (:func:`summary`).

A rank's position is a flat JSON object. Values alike on every rank that
recorded one are stored once (``common``); the others as columns
(``varying``), one value per recording rank. Ranks at the same point of a
synchronous run record the same position, so the merged form does not grow
with the number of ranks, and a rank's load reads O(1) of it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from bytecp.errors import CorruptCheckpointError

__all__ = ["merge_positions", "SavedData", "check_data", "summary", "uniform"]

_ABSENT = object()


def merge_positions(texts: Mapping[int, str], world_size: int) -> dict[str, Any]:
    """(coordinator, at commit) One fqn's merged position from each
    recording rank's position as JSON text (rank -> text): ranks sending the
    same text are grouped first, so W alike positions cost W dictionary
    look-ups and one parse."""
    groups: dict[str, list[int]] = {}
    for r, text in texts.items():
        groups.setdefault(text, []).append(r)
    ranks = sorted(texts)
    out: dict[str, Any] = {"ranks": None if ranks == list(range(world_size)) else ranks}
    parsed = [(json.loads(t), rs) for t, rs in groups.items()]
    if len(parsed) == 1:
        out["common"], out["varying"] = parsed[0][0], {}
        return out
    keys = sorted({k for p, _ in parsed for k in p})
    common: dict[str, Any] = {}
    varying: dict[str, list[Any]] = {}
    where = {r: i for i, r in enumerate(ranks)}
    for k in keys:
        values = [p.get(k, _ABSENT) for p, _ in parsed]
        first = values[0]
        if first is not _ABSENT and all(v is not _ABSENT and v == first and type(v) is type(first) for v in values):
            common[k] = first
            continue
        col: list[Any] = [None] * len(ranks)
        for v, (_, rs) in zip(values, parsed, strict=True):
            for r in rs:
                col[where[r]] = None if v is _ABSENT else v
        varying[k] = col
    out["common"], out["varying"] = common, varying
    return out


def check_data(d: Any, where: str, world_size: int) -> dict[str, dict[str, Any]]:
    """(every reader of ``metadata.json``) The ``data`` member, checked."""
    if d is None:
        return {}
    bad = f"{where}: metadata.json's data member is malformed"
    if not isinstance(d, dict):
        raise CorruptCheckpointError(bad)
    for fqn, rec in d.items():
        if not isinstance(rec, dict) or not isinstance(rec.get("common"), dict) \
                or not isinstance(rec.get("varying"), dict):
            raise CorruptCheckpointError(f"{bad} at {fqn!r}")
        ranks = rec.get("ranks")
        n = world_size if ranks is None else len(ranks) if isinstance(ranks, list) else -1
        if n < 0 or (ranks is not None and (any(type(r) is not int or not 0 <= r < world_size for r in ranks)
                                            or ranks != sorted(set(ranks)))):
            raise CorruptCheckpointError(f"{bad} at {fqn!r}: ranks must be sorted ranks of the saving job")
        if any(not isinstance(c, list) or len(c) != n for c in rec["varying"].values()):
            raise CorruptCheckpointError(f"{bad} at {fqn!r}: a varying column does not hold one value per rank")
    return d


def uniform(common: Mapping[str, Any], varying: Mapping[str, Sequence[Any]], key: str, default: Any = None) -> Any:
    """A key's value when every rank recorded it alike; ``default`` when no
    rank did; :class:`ValueError` when ranks differ."""
    if key in common:
        return common[key]
    if key in varying:
        raise ValueError(key)
    return default


@dataclasses.dataclass(frozen=True)
class SavedData:
    """One data loader's saved position, as a resharder receives it.

    ``common``: position values every recording rank had alike (O(1)
    however many ranks saved); ``varying``: the others, one value per
    recording rank (``ranks``, every rank of the saving job when None).
    :meth:`state` reads one saved rank's whole per-rank state (one object
    read each): read only the ranks this rank needs.
    """

    fqn: str
    world_size: int
    common: Mapping[str, Any]
    varying: Mapping[str, Sequence[Any]]
    ranks: Sequence[int] | None
    _read: Callable[[int], Any] = dataclasses.field(repr=False, compare=False)

    @classmethod
    def of(cls, fqn: str, record: Mapping[str, Any], world_size: int, read: Callable[[int], Any]) -> SavedData:
        return cls(fqn, world_size, record["common"], record["varying"], record.get("ranks"), read)

    @property
    def recorded(self) -> Sequence[int]:
        """The saved ranks that recorded a position (every rank, usually)."""
        return range(self.world_size) if self.ranks is None else self.ranks

    @property
    def kind(self) -> str | None:
        """The loader kind, when every rank recorded the same."""
        try:
            return uniform(self.common, self.varying, "kind")
        except ValueError:
            return None

    def value(self, key: str, default: Any = None) -> Any:
        """``key``'s value when alike on every saved rank (``default`` when
        absent); :class:`ValueError` naming the key when ranks differ."""
        return uniform(self.common, self.varying, key, default)

    def column(self, key: str) -> list[Any]:
        """``key``'s value on every recording rank, in :attr:`recorded` order (O(ranks))."""
        if key in self.common:
            return [self.common[key]] * len(self.recorded)
        return list(self.varying.get(key, [None] * len(self.recorded)))

    def position(self, rank: int) -> dict[str, Any]:
        """Saved rank ``rank``'s whole position."""
        recorded = list(self.recorded) if self.ranks is not None else None
        i = rank if recorded is None else recorded.index(rank)
        out = dict(self.common)
        out.update({k: col[i] for k, col in self.varying.items() if col[i] is not None})
        return out

    def state(self, rank: int) -> Any:
        """Saved rank ``rank``'s per-rank state as its ``state_dict()`` returned it."""
        return self._read(rank)

    def template_rank(self, rank: int) -> int:
        """The saved rank whose state a loading ``rank`` starts from for what
        does not reshard (worker seeds): ``rank % saved ranks``."""
        recorded = self.recorded
        return recorded[rank % len(recorded)]


def summary(record: Mapping[str, Any], world_size: int) -> dict[str, Any]:
    """(``bytecp inspect``) A data position in a few fields: loader kind,
    epoch, samples consumed (in all, and per data-parallel rank)."""
    common, varying = record.get("common", {}), record.get("varying", {})
    out: dict[str, Any] = {}
    for key in ("kind", "sampler", "epoch", "dp_size", "batch_size", "num_workers", "dataset_len", "finished"):
        if key in common:
            out[key] = common[key]
        elif key in varying:
            out[key] = sorted({json.dumps(v) for v in varying[key]})
    n = world_size if record.get("ranks") is None else len(record["ranks"])
    if "samples" in common:
        dp = common.get("dp_size", n) if isinstance(common.get("dp_size", n), int) else n
        out["samples_per_rank"], out["samples"], out["dp_size"] = common["samples"], common["samples"] * dp, dp
    elif "samples" in varying:
        col = [v for v in varying["samples"] if isinstance(v, int)]
        if col:
            out["samples_per_rank"] = [min(col), max(col)]
    out["ranks"] = n
    out["text"] = _text(out)
    return out


def _text(s: Mapping[str, Any]) -> str:
    """One line: ``torchdata (DistributedSampler), epoch 3, 60 samples consumed (30 on each of 2
    data-parallel ranks), batch 6 per rank, 2 workers``."""
    def say(v: Any) -> str:
        return " or ".join(v) if isinstance(v, list) and all(isinstance(x, str) for x in v) else str(v)

    kind = say(s.get("kind", "unknown kind")) if s.get("kind") is not None else "a loader of no known kind"
    parts = [kind + (f" ({say(s['sampler'])})" if "sampler" in s else "")]
    if "epoch" in s:
        parts.append(f"epoch {say(s['epoch'])}" + (", finished" if s.get("finished") is True else ""))
    if isinstance(s.get("samples"), int):
        of = f" of {s['dataset_len']}" if isinstance(s.get("dataset_len"), int) else ""
        parts.append(f"{s['samples']}{of} samples consumed ({s['samples_per_rank']} on each of {s['dp_size']} "
                     "data-parallel ranks)")
    elif "samples_per_rank" in s:
        lo, hi = s["samples_per_rank"]
        parts.append(f"{lo} to {hi} samples consumed per rank (ranks at different positions)")
    if "batch_size" in s:
        parts.append(f"batch {say(s['batch_size'])} per rank")
    if "num_workers" in s:
        parts.append(f"{say(s['num_workers'])} workers")
    return ", ".join(parts) + f"; recorded by {s['ranks']} rank(s)"
