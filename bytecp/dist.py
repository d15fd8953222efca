"""Every cross-rank operation bytecp performs lives here.

The pipelines never call ``torch.distributed`` directly: they ask a
:class:`DistContext` to run a step on every rank and combine the results.
Each step is *fail-together*: a rank whose local work raised still takes part
in the collective, carrying its error, so every rank learns of the failure
and raises one :class:`DistributedCheckpointError` naming each failed rank
and its message -- no rank is left waiting in a collective. A rank that dies
outright breaks the process group; the collectives then fail (gloo notices a
closed connection at once, and every call is bounded by the group's timeout);
the survivors then answer a roll call in the group's store and every one of
them raises an error naming the ranks that did not answer (died or hung).

The coordinator role (the rank that plans and commits) is passed in once.
Without an initialized process group (one process, evaluation jobs) every
step runs locally and exceptions propagate unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from bytecp.dist_raw import (
    DEADLINE,
    KEEP_BYTES,
    all_gather_bytes,
    broadcast_bytes,
    default_store,
    finish,
)
from bytecp.dist_raw import StoreSilent as _StoreSilent
from bytecp.dist_raw import from_bytes as _from_bytes
from bytecp.dist_raw import roll_call as _roll_call
from bytecp.dist_raw import to_bytes as _to_bytes
from bytecp.errors import DistributedCheckpointError

__all__ = ["DistContext", "CollectiveStats"]

T = TypeVar("T")
R = TypeVar("R")


@dataclasses.dataclass
class _Failed:
    """What a failed rank sends instead of its result."""

    failures: dict[int, str]
    #: the phase that failed, when it is not the step's own label (the
    #: coordinator's reduce of a gather-then-reduce step)
    op: str | None = None


@dataclasses.dataclass
class CollectiveStats:
    """Counts of collectives issued and payload bytes sent by this rank."""

    calls: int = 0
    bytes_sent: int = 0


def _describe(e: BaseException) -> str:
    """One rank's failure as text: the phase it failed in (when the pipeline
    kept it for this step), the exception type and message."""
    phase = getattr(e, "bytecp_phase", None)
    text = f"{phase + ': ' if phase else ''}{type(e).__name__}: {e}"
    return text if len(text) < 4000 else text[:4000] + " ..."


class DistContext:
    """Rank, world size, coordinator and process group of one checkpoint operation.

    Created once per ``save``/``load`` by the API (all ranks), passed to the
    pipelines. ``group`` defaults to the default process group; saves pass
    bytecp's own gloo group (:func:`bytecp.saving.handles.checkpoint_group`)
    so their collectives never interleave with training's, and a ``deadline``
    (monotonic seconds) past which each collective gives up.
    """

    def __init__(self, group: Any = None, coordinator: int = 0, *, local: bool = False) -> None:
        self.enabled = not local and dist.is_available() and dist.is_initialized()
        self.group = group
        if self.enabled:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            self.global_coordinator = dist.get_global_rank(group, coordinator) if group is not None else coordinator
        else:
            self.rank, self.world_size, self.global_coordinator = 0, 1, 0
        if not 0 <= coordinator < self.world_size:
            raise ValueError(f"coordinator rank {coordinator} outside a world of {self.world_size}")
        self.coordinator = coordinator
        self.stats = CollectiveStats()
        #: also count payload bytes in ``stats`` (costs a second pickling)
        self.count_bytes = False
        self.device = self._collective_device()
        self._store = default_store() if self.enabled else None
        #: the monotonic time by which this operation's collectives must end (None: the group's timeout)
        self.deadline: float | None = None
        #: the option that set ``deadline``, named in errors
        self.deadline_option = "save_timeout_s"
        if self.enabled:  # every rank creates its distributed contexts in the same order
            DistContext._instances += 1
        #: this context's number (alike on every rank: the store keys of its roll calls carry it)
        self.uid = DistContext._instances
        self._seq = 0
        self._members: dict[int, int] | None = None
        self._identity = False

    _instances = 0

    def adopt(self, uid: int, collectives: int) -> None:
        """(a save whose ranks were a save apart, realigned: :mod:`bytecp.saving.resync`)
        Number this context ``uid``, as if ``collectives`` had run in it: roll calls meet again."""
        self.uid, self._seq = uid, collectives
        DistContext._instances = max(DistContext._instances, uid)

    @classmethod
    def local(cls) -> DistContext:
        """A one-process context, even inside a distributed job."""
        return cls(local=True)

    def _collective_device(self) -> torch.device:
        if not self.enabled:
            return torch.device("cpu")
        backend = dist.get_backend(self.group)
        if backend == "nccl" and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def is_coordinator(self) -> bool:
        return self.rank == self.coordinator

    def group_ranks(self, global_ranks: tuple[int, ...]) -> tuple[int, ...] | None:
        """These global ranks as ranks of this context's group (adapters name
        replicas by global rank); None when one of them is not in the group."""
        if not self.enabled or self.group is None:
            return global_ranks
        if self._members is None:
            self._members = {g: i for i, g in enumerate(dist.get_process_group_ranks(self.group))}
            self._identity = all(g == i for g, i in self._members.items())
        if self._identity:
            return global_ranks if all(r < self.world_size for r in global_ranks[-1:]) else None
        out = tuple(self._members.get(r, -1) for r in global_ranks)
        return None if -1 in out else tuple(sorted(out))

    # -- failure diagnosis ---------------------------------------------
    #: how long survivors of a broken collective wait for each other's answer
    ROLL_CALL_SECONDS = 3.0

    def _next_step(self) -> str:
        """The store prefix of this rank's next collective (alike on every rank:
        contexts and collectives are created in the same order everywhere)."""
        self._seq += 1
        return f"bytecp/{self.global_coordinator}x{self.world_size}/{self.uid}/{self._seq}/"

    def _collective_failed(self, op: str, prefix: str, e: BaseException) -> DistributedCheckpointError:
        """A collective broke (a rank died or hung, or the timeout passed).

        The survivors answer a roll call in the group's store -- each one
        append, one add, one bounded wait and one get, O(1) per rank and
        nothing at all while collectives succeed -- and the ranks that do not
        answer within :attr:`ROLL_CALL_SECONDS` are named on every survivor.
        """
        store = self._store
        if store is None:
            err = DistributedCheckpointError(op, {self.rank: f"collective failed: {_describe(e)}"})
            err.broken_group = True  # type: ignore[attr-defined]
            return err
        try:
            alive = _roll_call(store, prefix, self.rank, self.world_size, self.ROLL_CALL_SECONDS)
        except _StoreSilent as se:  # its host is stuck (a dead one refuses connections: below)
            host = (self.group_ranks((0,)) or (0,))[0]
            err = DistributedCheckpointError(op, {host: (
                f"did not answer: the rendezvous store this rank hosts (global rank 0 under env:// or tcp://) "
                f"is silent ({se}): stuck or stopped (seen by rank {self.rank}; {self.deadline_option} "
                f"{'passed' if self.deadline is not None and time.monotonic() >= self.deadline else 'not passed'})")})
            err.broken_group = True  # type: ignore[attr-defined]  # as below: a new group for the next save
            return err
        except Exception as se:
            return DistributedCheckpointError(op, {self.rank: (
                f"collective failed: {_describe(e)}; the group's rendezvous store is unreachable too "
                f"({type(se).__name__}): the process hosting it (rank 0 when the job was initialised "
                "with env:// or tcp://) has probably died"
            )})
        missing = sorted(set(range(self.world_size)) - alive)
        late = self.deadline is not None and time.monotonic() >= self.deadline
        if not missing and late:
            err = DistributedCheckpointError(op, {self.rank: (
                f"reached this step after the deadline ({self.deadline_option}): the other ranks had given up"
                f"{', nothing is committed' if self.deadline_option == 'save_timeout_s' else ''} ({_describe(e)})")})
        elif not missing:
            err = DistributedCheckpointError(op, {self.rank: f"collective failed: {_describe(e)}"})
        elif late:
            err = DistributedCheckpointError(op, {
                r: f"did not reach this step before the deadline ({self.deadline_option}): stuck or stopped, not dead "
                   f"(seen by rank {self.rank})" for r in missing
            })
        else:
            err = DistributedCheckpointError(op, {
                r: f"did not answer after this step broke (the process died or hung; seen by rank {self.rank})"
                for r in missing
            })
        err.broken_group = True  # type: ignore[attr-defined]  # its collectives may pair up wrongly from now on
        return err

    # -- raw collectives (every rank must call them in the same order) ----
    def _count(self, obj: Any) -> None:
        self.stats.calls += 1
        if self.count_bytes:  # pickles the payload a second time: tests and diagnostics only
            try:
                self.stats.bytes_sent += len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
            except Exception:
                pass

    @contextlib.contextmanager
    def _collective(self, op: str) -> Iterator[None]:
        """Bracket raw collectives: turn a broken group into a
        :class:`DistributedCheckpointError` naming the ranks that are gone."""
        prefix = self._next_step()
        token = DEADLINE.set(self.deadline)
        try:
            yield
        except DistributedCheckpointError:
            raise
        except Exception as e:
            raise self._collective_failed(op, prefix, e) from e
        finally:
            DEADLINE.reset(token)

    def all_gather_object(self, obj: T) -> list[T]:
        if not self.enabled:
            return [obj]
        self._count(obj)
        return [_from_bytes(b) for b in all_gather_bytes(_to_bytes(obj), self.group, self.world_size, self.device)]

    def gather_object(self, obj: T) -> list[T] | None:
        """Every rank's ``obj`` to the coordinator, unpadded: the sizes travel
        in one fixed-size gather, then each payload point to point (a padded
        gather would cost the coordinator W times the largest payload)."""
        if not self.enabled:
            return [obj]
        self._count(obj)
        data = _to_bytes(obj)
        sizes = self._gather_sizes(len(data))
        if not self.is_coordinator:
            if len(data):
                self._p2p([dist.P2POp(dist.isend, data.to(self.device), self.global_coordinator, self.group)])
            return None
        assert sizes is not None
        bufs: list[torch.Tensor | None] = []
        ops = []
        for r, n in enumerate(sizes):
            if r == self.rank or n == 0:
                bufs.append(None)
                continue
            buf = torch.empty(n, dtype=torch.uint8, device=self.device)
            ops.append(dist.P2POp(dist.irecv, buf, self._global(r), self.group))
            bufs.append(buf)
        self._p2p(ops)
        return [obj if r == self.rank else _from_bytes(b) for r, b in enumerate(bufs)]

    def _p2p(self, ops: list[Any]) -> None:
        """Run point-to-point operations as one batch: on NCCL they share the
        group's communicator instead of opening one per pair of ranks."""
        if ops:
            finish(self.group, dist.batch_isend_irecv(ops), keep=self.device.type == "cpu")

    def _gather_sizes(self, n: int) -> list[int] | None:
        mine = torch.tensor([n], dtype=torch.int64, device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.world_size)] if self.is_coordinator else None
        finish(self.group, [dist.gather(mine, out, dst=self.global_coordinator, group=self.group, async_op=True)],
               keep=self.device.type == "cpu")
        return [int(t.item()) for t in out] if out is not None else None

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    def broadcast_object(self, obj: T | None) -> T:
        if not self.enabled:
            return obj  # type: ignore[return-value]
        self._count(obj if self.is_coordinator else None)
        data = _to_bytes(obj) if self.is_coordinator else None
        buf = broadcast_bytes(data, self.global_coordinator, self.group, self.device)
        return obj if self.is_coordinator else _from_bytes(buf)  # type: ignore[return-value]

    def scatter_object(self, objs: Sequence[T] | None) -> T:
        """The coordinator's ``objs[r]`` to rank ``r``, unpadded (sizes in one
        fixed-size scatter, then each payload point to point)."""
        if not self.enabled:
            assert objs is not None
            return objs[0]
        self._count(objs if self.is_coordinator else None)
        datas: list[torch.Tensor] = []
        sizes_in: list[torch.Tensor] | None = None
        if self.is_coordinator:
            assert objs is not None and len(objs) == self.world_size
            datas = [_to_bytes(o) for o in objs]
            sizes_in = [torch.tensor([len(d)], dtype=torch.int64, device=self.device) for d in datas]
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        finish(self.group, [dist.scatter(size, sizes_in, src=self.global_coordinator, group=self.group, async_op=True)],
               keep=self.device.type == "cpu")
        if self.is_coordinator:
            assert objs is not None
            self._p2p([dist.P2POp(dist.isend, d.to(self.device), self._global(r), self.group)
                       for r, d in enumerate(datas) if r != self.rank and len(d)])
            return objs[self.rank]
        n = int(size.item())
        buf = torch.empty(n, dtype=torch.uint8, device=self.device)
        if n:
            self._p2p([dist.P2POp(dist.irecv, buf, self.global_coordinator, self.group)])
        return _from_bytes(buf)

    def broadcast_tensor(self, op: str, tensor: torch.Tensor, src: int) -> None:
        """Broadcast ``tensor`` (CPU bytes) from group rank ``src`` in place."""
        if not self.enabled:
            return
        self.stats.calls += 1
        if self.rank == src:
            self.stats.bytes_sent += tensor.numel() * tensor.element_size()
        with self._collective(op):
            global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
            if self.device.type != "cpu":
                moved = tensor.to(self.device)
                finish(self.group, [dist.broadcast(moved, src=global_src, group=self.group, async_op=True)], keep=False)
                if self.rank != src:
                    tensor.copy_(moved.cpu())
            else:
                finish(self.group, [dist.broadcast(tensor, src=global_src, group=self.group, async_op=True)],
                       keep=tensor.numel() * tensor.element_size() <= KEEP_BYTES)

    def barrier(self) -> None:
        if self.enabled:
            self.all_gather_object(None)

    # -- fail-together steps ---------------------------------------------
    def _local(self, fn: Callable[[], T]) -> tuple[Any, BaseException | None]:
        try:
            return fn(), None
        except Exception as e:  # carried to every rank
            if not self.enabled:
                raise
            return _Failed({self.rank: _describe(e)}), e

    def _raise_if_failed(self, op: str, value: Any, local: BaseException | None) -> None:
        if isinstance(value, _Failed):
            raise DistributedCheckpointError(value.op or op, value.failures) from local

    def all_gather(self, op: str, fn: Callable[[], T]) -> list[T]:
        """Run ``fn`` on every rank; every rank gets every result, or every rank raises."""
        value, err = self._local(fn)
        if not self.enabled:
            return [value]
        return self._gather_checked(op, value, err)

    def run(self, op: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on every rank and keep the local result; only success or
        the error travels, so every rank raises if any rank failed."""
        value, err = self._local(fn)
        if not self.enabled:
            return value
        status = value if isinstance(value, _Failed) else None
        self._gather_checked(op, status, err)
        return value

    def _gather_checked(self, op: str, value: Any, err: BaseException | None) -> list[Any]:
        with self._collective(op):
            results = self.all_gather_object(value)
        failures: dict[int, str] = {}
        for r in results:
            if isinstance(r, _Failed):
                failures.update(r.failures)
        if failures:
            raise DistributedCheckpointError(op, failures) from err
        return results

    def reduce_scatter(
        self, op: str, local_fn: Callable[[], T], reduce_fn: Callable[[list[T]], Sequence[R]],
        *, reduce_op: str | None = None,
    ) -> R:
        """``local_fn`` on every rank, ``reduce_fn`` on the coordinator over all
        results (in rank order), its i-th output back to rank i. A failure of
        ``reduce_fn`` is reported as ``reduce_op`` (default ``op``)."""
        value, err = self._local(local_fn)
        if not self.enabled:
            return reduce_fn([value])[0]
        with self._collective(op):
            gathered = self.gather_object(value)
            out: list[Any] | None = None
            if self.is_coordinator:
                assert gathered is not None
                out = self._coordinator_reduce(gathered, reduce_fn, reduce_op)
            result = self.scatter_object(out)
        self._raise_if_failed(op, result, err)
        return result

    def all_reduce(
        self, op: str, local_fn: Callable[[], T], reduce_fn: Callable[[list[T]], R],
        *, reduce_op: str | None = None,
    ) -> R:
        """``local_fn`` everywhere, ``reduce_fn`` on the coordinator, its result
        to all. A failure of ``reduce_fn`` is reported as ``reduce_op`` (default ``op``)."""
        value, err = self._local(local_fn)
        if not self.enabled:
            return reduce_fn([value])
        with self._collective(op):
            gathered = self.gather_object(value)
            out: Any = None
            if self.is_coordinator:
                assert gathered is not None
                out = self._coordinator_reduce(gathered, lambda vs: [reduce_fn(vs)], reduce_op)[0]
            result = self.broadcast_object(out)
        self._raise_if_failed(op, result, err)
        return result

    def broadcast(self, op: str, fn: Callable[[], T]) -> T:
        """``fn`` on the coordinator only; its result (or error) to every rank."""
        if not self.enabled:
            return fn()
        value: Any = None
        err = None
        if self.is_coordinator:
            value, err = self._local(fn)
        with self._collective(op):
            result = self.broadcast_object(value)
        self._raise_if_failed(op, result, err)
        return result

    def _coordinator_reduce(
        self, gathered: list[Any], reduce_fn: Callable[[list[Any]], Sequence[Any]], reduce_op: str | None
    ) -> list[Any]:
        failures: dict[int, str] = {}
        for v in gathered:
            if isinstance(v, _Failed):
                failures.update(v.failures)
        if failures:
            return [_Failed(failures)] * self.world_size
        try:
            out = list(reduce_fn(gathered))
        except Exception as e:
            return [_Failed({self.rank: _describe(e)}, reduce_op)] * self.world_size
        return out

