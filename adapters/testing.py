"""The adapter contract (``bytecp.adapters.testing``): pytest mixin classes
every framework adapter runs -- bytecp's own and third-party ones.

A third-party adapter's test module::

    import pytest
    from bytecp.adapters.testing import AdapterCase, AdapterContract, AdapterFixtures

    def build(seed: int) -> dict:             # module level: ranks import it by name
        model, opt = make_my_model(seed)      # wrapped by the framework, trained a step
        return {"model": model, "optimizer": opt, "extra": {"step": seed}}

    class MyFixtures(AdapterFixtures):
        @pytest.fixture
        def case(self) -> AdapterCase:
            return AdapterCase(framework="myframework", build="my_tests.cases:build")

        @pytest.fixture
        def run_on_ranks(self):               # omit for a one-process adapter
            return lambda fn, *args: my_launcher.run(fn, *args)   # fn(*args) on every rank

    class TestMyAdapter(MyFixtures, AdapterContract):
        pass

Needs pytest (bytecp's ``test`` extra). The checks are module-level
functions (``check_*``) that run on every rank of the job under test and
return what they found; the test methods run them through the
``run_on_ranks`` fixture (default: this process alone, no
``torch.distributed``) and assert in the test process. A real gap of an
adapter is declared in ``xfail`` (test name -> reason) and becomes a strict
xfail, never a silent skip.

What is checked (bitwise: ``torch.equal`` on every model and optimizer tensor):

- :class:`RoundTripTests`: save, load into a state built with another
  seed under the same layout; every local tensor equals the saved one.
  The adapter registered as ``framework`` must also detect its own state.
- :class:`ReshardTests`: what the job saved loads in one process
  (:func:`bytecp.load_state_dict`) as the full tensors ``case.full_state``
  reports (default: torch's own full state dicts).
- :class:`ReplicaHintTests`: each tensor leaf's :class:`~bytecp.tree.state.ReplicaSet`
  names exactly the ranks holding the same boxes with the same bytes, and
  the boxes of all ranks tile every tensor.
- :class:`RefusalTests`: a state the adapter cannot describe is refused
  on every rank with a :class:`~bytecp.errors.BytecpError` whose message
  matches ``case.refusal``, and nothing is committed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import math
import os
import re
from collections.abc import Callable
from typing import Any

from bytecp.plugins import missing_extra

try:
    import pytest
    import torch
except ModuleNotFoundError as e:  # the contract extra
    raise missing_extra(e, "contract", __name__) from None
import torch.distributed as dist
from torch import nn

import bytecp
from bytecp.adapter_api import detect_adapter, get_adapter
from bytecp.contract import DeclaredGaps
from bytecp.dist import DistContext
from bytecp.tree.state import flatten_tree

__all__ = [
    "AdapterCase",
    "AdapterFixtures",
    "AdapterContract",
    "RoundTripTests",
    "ReshardTests",
    "ReplicaHintTests",
    "RefusalTests",
    "run_here",
    "torch_full_state",
    "tensor_subclass_state",
    "check_round_trip",
    "check_detects",
    "check_reshard_to_plain",
    "check_replica_hints",
    "check_refusal",
]


@dataclasses.dataclass(frozen=True)
class AdapterCase:
    """What an adapter's test supplies; picklable, sent to every rank.

    Functions are named as ``"module:function"`` so spawned ranks import them.
    """

    #: the name the adapter is registered under (``framework=``)
    framework: str
    #: ``build(seed) -> state``: the state to save on this rank (modules wrapped by
    #: the framework, optimizers trained a step so they hold state); other seeds
    #: give other values, the same layout
    build: str
    #: ``full_state(state) -> {state key: {name: full tensor}}`` (every rank
    #: calls it; collectives allowed): the oracle for loads in one process
    full_state: str = "bytecp.adapters.testing:torch_full_state"
    #: ``unsupported() -> state``: a state the adapter must refuse
    unsupported: str = "bytecp.adapters.testing:tensor_subclass_state"
    #: a regular expression the refusal's message matches
    refusal: str = r"tensor subclass"
    #: whether every tensor leaf must carry a replica hint (see docs/extending.md)
    hints_required: bool = True


def _call(target: str, *args: Any) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)(*args)


def run_here(fn: Callable[..., Any], *args: Any) -> list[Any]:
    """The default ``run_on_ranks``: ``fn`` in this process, a world of one."""
    return [fn(*args)]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier() -> None:
    if _world() > 1:
        dist.barrier()


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # DTensor
    return (to_local() if callable(to_local) else t).detach().clone()


def _flat(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flat(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(value, (list, tuple)) and any(isinstance(v, (dict, torch.Tensor)) for v in value):
        for i, v in enumerate(value):
            _flat(v, f"{prefix}.{i}" if prefix else str(i), out)
    else:
        out[prefix] = _local(value) if isinstance(value, torch.Tensor) else value


def _snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """This rank's view of ``state``: every local tensor (cloned) and value by path."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        sd = v.state_dict() if callable(getattr(v, "state_dict", None)) else v
        _flat(sd, str(k), out)
    return out


def _compare(want: dict[str, Any], got: dict[str, Any], what: str) -> list[str]:
    bad = [f"{what}: {k} missing" for k in sorted(set(want) - set(got))]
    for k, v in want.items():
        if k not in got:
            continue
        g = got[k]
        if isinstance(v, torch.Tensor):
            if not isinstance(g, torch.Tensor) or g.dtype != v.dtype or not torch.equal(v, g):
                bad.append(f"{what}: tensor {k} differs")
        elif g != v:
            bad.append(f"{what}: {k} is {g!r}, saved {v!r}")
    return bad


# -------------------------------------------------------- checks (every rank)
def check_round_trip(case: AdapterCase, url: str) -> list[str]:
    """Save, load into a state of another seed, compare every local tensor."""
    state = _call(case.build, 0)
    saved = _snapshot(state)
    bytecp.save(url, state, framework=case.framework)
    target = _call(case.build, 1)
    tensors = {k: v for k, v in saved.items() if isinstance(v, torch.Tensor)}
    if not _compare(tensors, _snapshot(target), "seed"):
        return [f"{case.build}: seeds 0 and 1 build equal tensors; the round trip would prove nothing"]
    bytecp.load(url, target, framework=case.framework)
    return _compare(saved, _snapshot(target), f"rank {_rank()}")


def check_detects(case: AdapterCase) -> str:
    """The adapter detection picks for the built state (its ``name``)."""
    return detect_adapter(_call(case.build, 0)).name


def torch_full_state(state: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """The default oracle: torch's full state dicts (``get_model_state_dict`` /
    ``get_optimizer_state_dict``, ``full_state_dict=True``) of the state's
    modules and optimizers; optimizer tensors as ``state.<param fqn>.<name>``."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    modules = [v for v in state.values() if isinstance(v, nn.Module)]
    out: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in state.items():
        if isinstance(v, nn.Module):
            msd: dict[str, Any] = dict(get_model_state_dict(v, options=opts))
            out[str(k)] = {n: t.detach().clone() for n, t in msd.items() if isinstance(t, torch.Tensor)}
        elif isinstance(v, torch.optim.Optimizer) and len(modules) == 1:
            osd: dict[str, Any] = dict(get_optimizer_state_dict(modules[0], v, options=opts))
            out[str(k)] = {f"state.{p}.{n}": t.detach().clone()
                           for p, st in osd["state"].items() for n, t in st.items()
                           if isinstance(t, torch.Tensor)}
    return out


def check_reshard_to_plain(case: AdapterCase, url: str) -> list[str]:
    """Save on every rank; one process loads the full tensors the oracle reports."""
    state = _call(case.build, 0)
    full = _call(case.full_state, state)
    bytecp.save(url, state, framework=case.framework)
    if _rank() != 0:
        return []
    sd = bytecp.load_state_dict(url)
    bad = []
    for key, tensors in full.items():
        if not tensors:
            bad.append(f"the oracle reports no tensors of {key!r}")
        got: dict[str, Any] = {}
        _flat(sd.get(key, {}), "", got)
        bad += _compare(tensors, got, f"load_state_dict()[{key!r}]")
    if not full:
        bad.append(f"{case.full_state} reports nothing: the check would prove nothing")
    return bad


def _box_digest(t: torch.Tensor) -> str:
    b = t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(b, digest_size=16).hexdigest()


def check_replica_hints(case: AdapterCase) -> list[str]:
    """Every rank describes its boxes and hints; rank 0 checks them all."""
    state = _call(case.build, 0)
    tree = get_adapter(case.framework).save_tree(state, DistContext())
    world = _world()
    mine: dict[str, Any] = {}
    for fqn, leaf in flatten_tree(tree).tensors.items():
        boxes = tuple(sorted((s.region.offsets, s.region.lengths, _box_digest(s.tensor))
                             for s in leaf.shards if s.tensor.numel()))
        hint = None if leaf.replicas is None else (leaf.replicas.ranks or tuple(range(world)))
        mine[fqn] = (tuple(leaf.global_shape), hint, boxes)
    every: list[Any] = [mine]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, mine)
    return _hint_problems(every, case.hints_required) if _rank() == 0 else []


def _intersects(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return all(ao < bo + bl and bo < ao + al for ao, al, bo, bl in zip(a[0], a[1], b[0], b[1], strict=True))


def _hint_problems(every: list[Any], hints_required: bool) -> list[str]:
    bad: list[str] = []
    for fqn in sorted({f for m in every for f in m}):
        held = {r: m[fqn] for r, m in enumerate(every) if fqn in m}
        holders: dict[tuple[Any, ...], set[int]] = {}
        for r, (_, _, boxes) in held.items():
            for box in boxes:
                holders.setdefault(box[:2], set()).add(r)
        for r, (_shape, hint, boxes) in held.items():
            if not boxes:
                continue
            if hint is None:
                if hints_required:
                    bad.append(f"{fqn}: rank {r} gives no replica hint (at scale the coordinator "
                               "then gathers its boxes from every rank)")
                continue
            if r not in hint:
                bad.append(f"{fqn}: rank {r}'s replica set {hint} does not contain rank {r}")
            for q in hint:
                if q not in held or held[q][2] != boxes:
                    bad.append(f"{fqn}: rank {r} names rank {q} a replica, but rank {q} holds other "
                               "boxes or other bytes")
                    break
            for box in boxes:
                if holders[box[:2]] != set(hint):
                    bad.append(f"{fqn}: box {box[:2]} is held by ranks {sorted(holders[box[:2]])}, "
                               f"rank {r}'s replica set is {hint}")
                    break
        shapes = {s for s, _, _ in held.values()}
        if len(shapes) != 1:
            bad.append(f"{fqn}: ranks disagree on the global shape: {sorted(shapes)}")
            continue
        distinct = sorted(holders)
        volume = sum(math.prod(b[1]) for b in distinct)
        if volume != math.prod(shapes.pop()) or any(
                _intersects(a, b) for i, a in enumerate(distinct) for b in distinct[i + 1:]):
            bad.append(f"{fqn}: the ranks' boxes do not tile the tensor (gaps or overlaps)")
    return bad


class _Subclass(torch.Tensor):
    """A tensor subclass no adapter knows how to describe."""


def tensor_subclass_state() -> dict[str, Any]:
    """The default unsupported state: a module whose weight is an unknown tensor subclass."""
    m = nn.Linear(4, 3)
    m.weight = nn.Parameter(torch.zeros(3, 4).as_subclass(_Subclass))
    return {"model": m}


def check_refusal(case: AdapterCase, url: str) -> tuple[str, str, bool]:
    """Save the unsupported state: (error type, message, whether a checkpoint appeared)."""
    state = _call(case.unsupported)
    try:
        bytecp.save(url, state, framework=case.framework)
        kind, msg = "", "saved"
    except Exception as e:
        kind, msg = type(e).__name__ if isinstance(e, bytecp.BytecpError) else f"not a BytecpError: {e!r}", str(e)
    _barrier()
    return kind, msg, os.path.exists(os.path.join(url, "metadata.json"))


# -------------------------------------------------------------- test mixins
class AdapterFixtures(DeclaredGaps):
    """Base: subclasses provide ``case`` and, for more than one rank, ``run_on_ranks``. ``xfail`` names known gaps."""


    @pytest.fixture
    def case(self) -> AdapterCase:
        raise NotImplementedError("an adapter's fixtures base provides `case`")

    @pytest.fixture
    def run_on_ranks(self) -> Callable[..., list[Any]]:
        """``run_on_ranks(fn, *args)``: ``fn(*args)`` on every rank, the results by rank."""
        return run_here


def _ok(problems: list[list[str]]) -> None:
    flat = [p for rank in problems for p in rank]
    assert not flat, "\n".join(flat[:20])


class RoundTripTests:
    def test_same_layout_round_trip_is_bitwise(self, case: AdapterCase, run_on_ranks: Any, tmp_path: Any) -> None:
        _ok(run_on_ranks(check_round_trip, case, str(tmp_path / "ckpt")))

    def test_detects_its_own_state(self, case: AdapterCase, run_on_ranks: Any) -> None:
        assert set(run_on_ranks(check_detects, case)) == {get_adapter(case.framework).name}


class ReshardTests:
    def test_loads_as_full_tensors_in_one_process(self, case: AdapterCase, run_on_ranks: Any, tmp_path: Any) -> None:
        _ok(run_on_ranks(check_reshard_to_plain, case, str(tmp_path / "ckpt")))


class ReplicaHintTests:
    def test_replica_hints_match_what_ranks_hold(self, case: AdapterCase, run_on_ranks: Any) -> None:
        _ok(run_on_ranks(check_replica_hints, case))


class RefusalTests:
    def test_unsupported_state_is_refused_on_every_rank(self, case: AdapterCase, run_on_ranks: Any, tmp_path: Any) -> None:
        results = run_on_ranks(check_refusal, case, str(tmp_path / "ckpt"))
        for rank, (kind, msg, committed) in enumerate(results):
            assert kind and not kind.startswith("not a"), f"rank {rank}: {kind or msg}"
            assert re.search(case.refusal, msg), f"rank {rank}: {msg!r} does not match {case.refusal!r}"
            assert not committed, f"rank {rank}: a checkpoint was committed"


class AdapterContract(RoundTripTests, ReshardTests, ReplicaHintTests, RefusalTests):
    """Every check of the adapter contract."""
