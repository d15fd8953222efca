"""The ``reshard`` hook on a loader, a sampler and a dataset, the resharder
registry, what is refused (a loader no resharder knows, different kinds on
different ranks), and the position through ``bytecp.save``/``load``,
``metadata.json`` and ``bytecp inspect`` in one process."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import bytecp
from bytecp.data import DataReshardError, position_of, register_resharder, resharder_for
from bytecp.data import registry as reg
from bytecp.data.positions import merge_positions
from bytecp.data.restore import restore_data

from .examples import BlockLoader, BlockResharder, LegacyBlockLoader, StridedSampler, Tokens


def save_ranks(objs: list[Any]) -> tuple[dict[str, Any], list[Any]]:
    """Each simulated rank's state and position, merged as the commit merges them."""
    states = [o.state_dict() for o in objs]
    texts = {r: json.dumps(position_of(o, st), sort_keys=True) for r, (o, st) in enumerate(zip(objs, states, strict=True))}
    return merge_positions(texts, len(objs)), states


def load_ranks(record: dict[str, Any], states: list[Any], objs: list[Any], mode: str = "exact") -> list[Any]:
    out = []
    for r, o in enumerate(objs):
        got = restore_data("loader", o, record, len(states), r, len(objs), lambda i: states[i], mode)
        value = states[r] if got is None else states[r % len(states)] if got.as_saved else got.value
        o.load_state_dict(value)
        if got is not None and got.after is not None:
            got.after()
        out.append(got)
    return out


def blocks(loaders: list[Any], steps: int | None = None) -> list[int]:
    return [b for dl in loaders for b in itertools.islice(iter(dl), steps)]


def test_a_loader_that_reshards_itself() -> None:
    old = [BlockLoader(60, r, 2) for r in range(2)]
    first = blocks(old, 9)
    record, states = save_ranks(old)
    assert record["common"] == {"kind": f"hook:{BlockLoader.__module__}.BlockLoader", "samples": 9,
                                "dp_size": 2}
    new = [BlockLoader(60, r, 3) for r in range(3)]
    load_ranks(record, states, new)
    assert sorted(first + blocks(new)) == list(range(60))
    with pytest.raises(DataReshardError, match=r"18 blocks read by 2 ranks do not divide among 4.*approximate"):
        load_ranks(record, states, [BlockLoader(60, r, 4) for r in range(4)])
    new = [BlockLoader(60, r, 4) for r in range(4)]
    with warnings.catch_warnings():
        got = load_ranks(record, states, new, mode="approximate")
    assert all("2 sample(s) seen twice" in (g.warning or "") for g in got)
    seen = first + blocks(new)
    assert len(seen) - len(set(seen)) == 2 and set(seen) == set(range(60))


def test_a_registered_resharder_teaches_a_library_loader() -> None:
    old = [LegacyBlockLoader(60, r, 3) for r in range(3)]
    assert resharder_for(old[0]) is None and position_of(old[0], {}) is None  # unknown, and not named a loader
    register_resharder("blocks", BlockResharder, needs=BlockResharder.__module__)
    try:
        assert resharder_for(old[0]).kind == "blocks"
        first = blocks(old, 4)
        record, states = save_ranks(old)
        assert record["common"]["kind"] == "blocks"
        new = [LegacyBlockLoader(60, r, 2) for r in range(2)]
        load_ranks(record, states, new)
        assert sorted(first + blocks(new)) == list(range(60))
    finally:
        del reg._RESHARDERS["blocks"]


def test_a_sampler_with_reshard_inside_a_stateful_dataloader() -> None:
    def make(r: int, w: int) -> StatefulDataLoader:
        return StatefulDataLoader(list(range(48)), batch_size=2, sampler=StridedSampler(48, r, w))

    old = [make(r, 2) for r in range(2)]
    its = [iter(dl) for dl in old]
    first = [int(x) for it in its for _ in range(3) for x in next(it)]
    record, states = save_ranks(old)
    c = record["common"]
    assert c["kind"] == "torchdata" and c["sampler"] == f"hook:{StridedSampler.__module__}.StridedSampler"
    assert c["samples"] == 6 and c["sampler_position"] == {"samples": 6, "dp_size": 2}
    new = [make(r, 3) for r in range(3)]
    load_ranks(record, states, new)
    rest = [int(x) for dl in new for b in dl for x in b]
    assert sorted(first + rest) == list(range(48))


@pytest.mark.spawn  # loader worker processes
def test_a_dataset_with_reshard_hands_its_state_to_every_new_worker() -> None:
    def make(r: int, w: int, workers: int) -> StatefulDataLoader:
        ds = Tokens(24)
        return StatefulDataLoader(ds, batch_size=3, sampler=DistributedSampler(ds, num_replicas=w, rank=r,
                                                                               shuffle=False),
                                  num_workers=workers, **({"multiprocessing_context": "fork"} if workers else {}))

    old = [make(r, 2, 0) for r in range(2)]
    for dl in old:
        dl.dataset.scale = 10
    its = [iter(dl) for dl in old]
    first = [int(x) for it in its for _ in range(2) for x in next(it)]
    record, states = save_ranks(old)
    new = [make(r, 3, 2) for r in range(3)]
    load_ranks(record, states, new)
    rest = [int(x) for dl in new for b in dl for x in b]
    assert sorted(first + rest) == [10 * i for i in range(24)]


class MyDataLoader:  # a loader by its name, of no known kind
    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.pos = sd["pos"]


def test_a_loader_of_no_known_kind_is_refused_then_restored_as_before_when_asked() -> None:
    record, states = save_ranks([MyDataLoader() for _ in range(2)])
    assert record["common"] == {"kind": None, "type": f"{__name__}.MyDataLoader"}
    with pytest.raises(DataReshardError, match=r"'loader' \(MyDataLoader\): no resharder knows this kind of loader "
                                               r"\(saved by 2 ranks, loaded by 3\).*an unknown number"):
        load_ranks(record, states, [MyDataLoader() for _ in range(3)])
    got = load_ranks(record, states, [MyDataLoader() for _ in range(3)], mode="approximate")
    assert all(g.as_saved and "restores the position saved by rank" in g.warning for g in got)
    # the same world size: as saved, nothing said
    assert load_ranks(record, states, [MyDataLoader() for _ in range(2)]) == [None, None]


def test_different_kinds_on_different_ranks_are_refused() -> None:
    ds = list(range(24))
    td = StatefulDataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, num_replicas=2, rank=0))
    record, states = save_ranks([td, MyDataLoader()])
    assert record["varying"]["kind"] == ["torchdata", None]
    with pytest.raises(DataReshardError, match=r"different loader kinds on different saved ranks"):
        load_ranks(record, states, [MyDataLoader() for _ in range(3)])


def test_fsdp_style_reshard_methods_are_not_hooks() -> None:
    class Module(torch.nn.Module):
        def reshard(self) -> None: ...

    class NoArgs:
        def reshard(self) -> None: ...

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, sd: Any) -> None: ...

    assert resharder_for(Module()) is None and resharder_for(NoArgs()) is None


def _loader(world: int, rank: int) -> StatefulDataLoader:
    ds = list(range(60))
    s = DistributedSampler(ds, num_replicas=world, rank=rank, seed=1)
    s.set_epoch(1)
    return StatefulDataLoader(ds, batch_size=5, sampler=s)


@pytest.mark.spawn  # the inspect CLI
def test_save_load_and_inspect_in_one_process(tmp_path: Path) -> None:
    dl = _loader(1, 0)
    it = iter(dl)
    first = [int(x) for _ in range(3) for x in next(it)]
    url = str(tmp_path / "ck")
    bytecp.save(url, {"extra": {"dataloader": dl}, "rng": bytecp.RNGState(), "w": torch.ones(2)})
    md = json.loads((tmp_path / "ck" / "metadata.json").read_text())
    assert md["data"]["extra.dataloader"]["common"]["samples"] == 15
    assert "rng" not in md["data"]
    again = _loader(1, 0)
    state = {"extra": {"dataloader": again}, "rng": bytecp.RNGState(), "w": torch.zeros(2)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same world size: as before, nothing said
        bytecp.load(url, state)
    assert sorted(first + [int(x) for b in again for x in b]) == list(range(60))
    out = subprocess.run([sys.executable, "-m", "bytecp.cli", "inspect", url], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert ("data         extra.dataloader: torchdata (DistributedSampler), epoch 1, 15 of 60 samples consumed "
            "(15 on each of 1 data-parallel ranks), batch 5 per rank, 0 workers; recorded by 1 rank(s)") in out
    js = json.loads(subprocess.run([sys.executable, "-m", "bytecp.cli", "inspect", url, "--json"],
                                   capture_output=True, text=True, check=True, timeout=120).stdout)
    d = js["data"]["extra.dataloader"]
    assert (d["kind"], d["epoch"], d["samples"]) == ("torchdata", 1, 15)


def test_data_reshard_is_validated() -> None:
    with pytest.raises(bytecp.ConfigError, match="data_reshard must be 'exact' or 'approximate'"):
        bytecp.load("/nowhere", {}, data_reshard="loose")
    with pytest.raises(bytecp.ConfigError, match="data_reshard"):
        bytecp.CheckpointManager("/nowhere", data_reshard="loose")
