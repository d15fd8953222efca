"""The worked examples of docs/extending.md ("Data loaders"), as the tests run them.

- :class:`BlockLoader`: a loader of one's own that reshards itself
  (``reshard`` and ``data_position`` methods);
- :class:`LegacyBlockLoader` and :class:`BlockResharder`: the same loader
  from a library one cannot change, taught to bytecp by a registered resharder;
- :class:`StridedSampler`: a sampler of one's own inside torchdata's
  ``StatefulDataLoader``, resharding only its own state;
- :class:`Tokens`: a map-style dataset whose state (a vocabulary version)
  is handed to every new worker, resharded by its own method.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from bytecp.data import DataReshardError, Resharder, SavedData

__all__ = ["BlockLoader", "LegacyBlockLoader", "BlockResharder", "StridedSampler", "Tokens"]


class BlockLoader:
    """Rank ``rank`` of ``world`` reads blocks ``rank, rank + world, ...`` of ``n`` blocks."""

    def __init__(self, n: int, rank: int, world: int) -> None:
        self.n, self.rank, self.world, self.read = n, rank, world, 0

    def __iter__(self) -> Iterator[int]:
        while self.rank + self.read * self.world < self.n:
            block = self.rank + self.read * self.world
            self.read += 1
            yield block

    def state_dict(self) -> dict[str, Any]:
        return {"read": self.read}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.read = sd["read"]

    def data_position(self) -> dict[str, Any]:  # saved beside the state, merged over the ranks
        return {"samples": self.read, "dp_size": self.world}

    def reshard(self, saved: SavedData, rank: int, world_size: int) -> dict[str, Any]:
        """Blocks ``[0, consumed)`` were read; continue at ``consumed`` on ``world_size`` ranks."""
        consumed = saved.value("samples") * saved.value("dp_size")  # alike on every saved rank: O(1)
        if consumed % world_size:
            raise DataReshardError(f"{consumed} blocks read by {saved.value('dp_size')} ranks do not divide "
                                   f"among {world_size}", repeat=consumed % world_size,
                                   approximate={"read": consumed // world_size})
        return {"read": consumed // world_size}


class LegacyBlockLoader(BlockLoader):
    """The same loader as a library ships it: no ``reshard``, no ``data_position``."""

    reshard = None  # type: ignore[assignment]
    data_position = None  # type: ignore[assignment]


class BlockResharder(Resharder):
    """``register_resharder("blocks", BlockResharder(), needs="tests.data.examples")``."""

    def detect(self, obj: Any) -> bool:
        return isinstance(obj, LegacyBlockLoader)

    def position(self, obj: Any, state: Any) -> dict[str, Any]:
        return {"samples": state["read"], "dp_size": obj.world}

    def same_layout(self, obj: Any, position: dict[str, Any]) -> bool:
        return position["dp_size"] == obj.world

    def reshard(self, obj: Any, saved: SavedData, rank: int, world_size: int) -> Any:
        return BlockLoader.reshard(obj, saved, rank, world_size)


class StridedSampler(torch.utils.data.Sampler[int]):
    """Every ``world``-th index from ``rank``, a position of its own (Stateful)."""

    def __init__(self, n: int, rank: int, world: int) -> None:
        self.n, self.rank, self.world, self.done, self.next_done = n, rank, world, 0, 0

    def __iter__(self) -> Iterator[int]:
        self.done, self.next_done = self.next_done, 0
        for i in range(self.rank + self.done * self.world, self.n, self.world):
            self.done += 1
            yield i

    def __len__(self) -> int:
        return len(range(self.rank, self.n, self.world))

    def state_dict(self) -> dict[str, Any]:
        return {"done": self.done}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.next_done = sd["done"]

    def data_position(self) -> dict[str, Any]:
        return {"samples": self.done, "dp_size": self.world}

    def reshard(self, saved: SavedData, rank: int, world_size: int) -> dict[str, Any]:
        consumed = saved.value("samples") * saved.value("dp_size")
        if consumed % world_size:
            raise DataReshardError(f"{consumed} indices do not divide among {world_size} ranks",
                                   repeat=consumed % world_size)
        return {"done": consumed // world_size}


class Tokens(torch.utils.data.Dataset[int]):
    """Items ``i * scale``; its state (``scale``) is restored into every worker."""

    def __init__(self, n: int) -> None:
        self.n, self.scale = n, 1

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i * self.scale

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.scale = sd["scale"]

    def reshard(self, saved: SavedData, rank: int, world_size: int) -> dict[str, Any]:
        """``saved.state(r)``: saved rank r's dataset state, one per worker;
        they agree, so any one serves every new worker."""
        per_worker = saved.state(saved.template_rank(rank))
        return per_worker[0]
