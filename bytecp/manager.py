"""Checkpoints of a training run: list, find the latest committed, retention.

``CheckpointManager`` is what training loops use: ``save`` every N steps into
``<run>/step-<N>``, keep the last K committed checkpoints, resume from the
latest *committed* one (a directory without ``metadata.json`` is an
interrupted save and is never picked, nor counted by retention).

With ``async_save=True`` (and optionally ``lazy=True``) each save goes
through :func:`bytecp.async_save`; the same retention rules hold: the
in-flight checkpoint is never counted (it has no ``metadata.json`` yet), the
last committed one is never deleted before a newer one commits (retention
runs only after a commit, and always keeps the newest), and deletion runs on
the save's background thread once it has committed, never on the training
thread. A failed save deletes no checkpoint; a synchronous one raises, an
asynchronous one is logged, sent to the recorders (``save_failed``) and
listed in ``failed``, and the next ``save`` proceeds (``wait`` raises it).

Saves are incremental by default: each references, in the previous
checkpoint this manager saved, the boxes unchanged since then (frozen
parameters: a LoRA fine-tune writes only its adapters and their optimizer
state), and every ``full_every``-th save writes everything, so no
checkpoint keeps an old one alive for long. Retention keeps the files kept
checkpoints reference (:mod:`bytecp.tools.retention`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from bytecp import recorder
from bytecp.catalog import CheckpointInfo, list_checkpoints
from bytecp.errors import ConfigError
from bytecp.format import metadata as fmt
from bytecp.format.references import name_of
from bytecp.storage_api import open_storage
from bytecp.tools.cadence import Cadence, milestones
from bytecp.tools.resume import Decision, decide, decide_together, first_that_loads
from bytecp.tools.retention import retain, sweep_uncommitted
from bytecp.tools.tiers import MemoryTier

if TYPE_CHECKING:  # pragma: no cover
    from bytecp.saving.handles import SaveHandle
    from bytecp.tools.preemption import Preemption

__all__ = ["CheckpointInfo", "list_checkpoints", "CheckpointManager"]

log = logging.getLogger(__name__)


class CheckpointManager:
    """Save every ``every_n_steps`` into ``<run_url>/step-<N>``; keep the last ``keep_last``.

    ``every_n_seconds``: also save when that much wall-clock time has passed
    since the last save (the coordinator's clock, agreed by every rank in one
    vote per call: :mod:`bytecp.tools.cadence`). ``keep_every_n_steps``:
    milestones -- checkpoints whose step is a multiple of it are never deleted
    by retention, and are saved whole (no incremental base).

    Call ``maybe_save(step, state)`` every step (all ranks) and
    ``restore(state)`` at start-up (all ranks); it returns the restored step
    or ``None`` when there is nothing to resume from.

    ``async_save=True``: saves return once staged (``lazy=True``: at once,
    staging before the next ``optimizer.step``) and commit in the
    background; retention runs on that background thread after the commit.
    ``wait()`` blocks until the in-flight save and its retention are done.

    ``incremental=True`` (the default): a save references the unchanged boxes
    of the previous one (see the module's docstring); ``full_every=K``: every
    K-th save is written whole (1: all of them, like ``incremental=False``).

    ``save_on_signal=True`` (SIGTERM; or a signal number, or several):
    pre-emption. The handler only notes the signal; at the next
    ``maybe_save`` every rank learns it (one all-reduce of one integer per
    call, on a gloo group of its own), saves that step synchronously and
    exits with ``SystemExit(0)``. Create the manager on the main thread.

    ``data_reshard="approximate"``: ``restore`` accepts a data loader's
    position that cannot continue exactly under a new world size (see
    :class:`~bytecp.options.LoadOptions`).

    ``memory_url`` (``keeper://<run>``) with ``memory_every_n_steps``:
    checkpoint to the hosts' memory every N steps, replicated to peer hosts,
    and every ``every_n_steps`` drain the memory checkpoint to ``run_url``
    (the keeper copies it); ``restore`` tries the newest committed memory
    checkpoint first when it is at least as new as storage's newest (see
    :mod:`bytecp.tools.tiers`).

    ``serving_dtype=torch.bfloat16``: every save also writes serving deltas
    -- what changed in that dtype since the previous save, for followers
    holding the model in it (``bytecp.follow(..., dtype=torch.bfloat16)``);
    every ``full_every``-th save (the first, and milestones) writes the
    serving copy whole too. ``serving_prefixes``: the names that get them
    (default: the state's modules).
    """

    def __init__(
        self,
        run_url: str,
        *,
        every_n_steps: int = 1000,
        every_n_seconds: float | None = None,
        keep_last: int | None = 3,
        keep_every_n_steps: int | None = None,
        async_save: bool = False,
        lazy: bool = False,
        incremental: bool = True,
        full_every: int = 8,
        storage_options: dict[str, Any] | None = None,
        save_on_signal: bool | int | Iterable[int] = False,
        memory_url: str | None = None,
        memory_every_n_steps: int | None = None,
        memory_keep_last: int | None = 2,
        memory_storage_options: dict[str, Any] | None = None,
        serving_dtype: Any = None,
        serving_prefixes: Iterable[str] | None = None,
        data_reshard: str = "exact",
        **save_kwargs: Any,
    ) -> None:
        if every_n_steps < 1:
            raise ConfigError(f"every_n_steps must be >= 1, got {every_n_steps}")
        if keep_last is not None and keep_last < 1:
            raise ConfigError(f"keep_last must be >= 1 or None, got {keep_last}")
        if keep_every_n_steps is not None and (type(keep_every_n_steps) is not int or keep_every_n_steps < 1):
            raise ConfigError(f"keep_every_n_steps must be an int >= 1 or None, got {keep_every_n_steps!r}")
        if type(full_every) is not int or full_every < 1:
            raise ConfigError(f"full_every must be an int >= 1 (1: every save is full), got {full_every!r}")
        if "base" in save_kwargs:
            raise ConfigError("CheckpointManager chooses each save's base itself; pass incremental=False "
                              "to write every save whole instead of base=")
        if lazy and not async_save:
            raise ConfigError("lazy=True needs async_save=True (a lazy save is an asynchronous one)")
        if "serving_whole" in save_kwargs:
            raise ConfigError("CheckpointManager writes the serving copy whole every full_every-th save itself; "
                              "pass full_every= instead of serving_whole=")
        if serving_dtype is not None:
            from bytecp.format.serving_wire import serving_dtype_name

            save_kwargs["serving_dtype"] = serving_dtype_name(serving_dtype)
            if serving_prefixes is not None:
                save_kwargs["serving_prefixes"] = (serving_prefixes,) if isinstance(serving_prefixes, str) \
                    else tuple(serving_prefixes)
        elif serving_prefixes is not None:
            raise ConfigError("serving_prefixes needs serving_dtype (e.g. torch.bfloat16)")
        if data_reshard not in ("exact", "approximate"):
            raise ConfigError(f"data_reshard must be 'exact' or 'approximate', got {data_reshard!r}")
        self.data_reshard = data_reshard
        self.run_url = run_url.rstrip("/")
        self.every_n_steps = every_n_steps
        self.keep_last, self.keep_every_n_steps = keep_last, keep_every_n_steps
        self.storage_options = dict(storage_options or {})
        self.save_kwargs = save_kwargs
        self.async_save = async_save
        self.lazy = lazy
        self.incremental, self.full_every = incremental, full_every
        #: the last checkpoint this manager saved, and saves since the last full one
        self._last: str | None = None
        self._chain = 0
        #: saves since the serving copy was last written whole (None: never yet)
        self._serving_chain: int | None = None
        #: the in-flight (or last) asynchronous save and the event set once
        #: its retention has run
        self._pending: SaveHandle | None = None
        self._retained = threading.Event()
        self._retained.set()
        self._retain_lock = threading.Lock()
        #: makes "the newest save's retention is done" (``_retained``) one step with "a newer save is
        #: pending": a save's retention may end while the next save starts
        self._pending_lock = threading.Lock()
        #: (url, why) of each checkpoint the last ``restore`` skipped, newest first
        self.skipped: list[tuple[str, str]] = []
        #: (url, error) of the asynchronous saves that failed (the last 100), oldest first
        self.failed: list[tuple[str, str]] = []
        self._reported: SaveHandle | None = None
        self._preemption: Preemption | None = None
        self._prewarmed = False
        self.restored_from: str | None = None  # "memory" or "storage", after restore
        #: the last ``restore``'s answer: what the run folder had to resume (:mod:`bytecp.tools.resume`)
        self.decision: Decision | None = None
        #: the memory tier (``memory_url``, e.g. ``keeper://<run>``), see :mod:`bytecp.tools.tiers`
        self.memory: MemoryTier | None = None
        if memory_url is not None:
            self.memory = MemoryTier(memory_url, memory_every_n_steps or every_n_steps, memory_keep_last,
                                     memory_storage_options)
        elif memory_every_n_steps is not None:
            raise ConfigError("memory_every_n_steps needs memory_url (e.g. keeper://<run>)")
        if save_on_signal is not False:
            from bytecp.tools.preemption import Preemption, signals_from

            self._preemption = Preemption(signals_from(save_on_signal))
        #: when to save (steps, wall-clock time, signals: one vote per call when time or signals count)
        self._cadence = Cadence(every_n_steps, every_n_seconds, vote=self._preemption is not None,
                                process_group=save_kwargs.get("process_group"),
                                coordinator_rank=save_kwargs.get("coordinator_rank", 0))

    def url_for(self, step: int) -> str:
        return f"{self.run_url}/step-{step}"

    def latest(self) -> CheckpointInfo | None:
        """The checkpoint ``restore`` tries first (this process lists: :mod:`bytecp.tools.resume`);
        None when there is nothing to resume; :class:`~bytecp.errors.ResumeDecisionError` when undecided."""
        return decide(self.run_url, self.storage_options).newest

    def maybe_save(self, step: int, state: dict[str, Any], *, force: bool = False) -> bool:
        """Save if ``step`` is due (or ``force``); every rank calls it after
        each step's update. With ``save_on_signal``, once any rank has been
        signalled every rank saves this step synchronously, waits for the
        commit and its retention, and exits (``SystemExit(0)``). With
        ``async_save`` the first call prewarms the staging memory
        (:func:`bytecp.prewarm`), so the first save blocks like the later ones."""
        signalled = self._preemption is not None and self._preemption.received is not None
        decision = self._cadence.decide(step, signalled=signalled, force=force)
        if decision.signalled and self._preemption is not None:
            self._preemption.agreed_elsewhere()
            self._save_and_exit(step, state)
        if self.async_save and not self._prewarmed:
            from bytecp.saving.prewarm import prewarm

            prewarm(state, framework=self.save_kwargs.get("framework"),
                    process_group=self.save_kwargs.get("process_group"),
                    coordinator_rank=self.save_kwargs.get("coordinator_rank", 0),
                    url=self.memory.url if self.memory is not None else None,  # keeper:// lends its arenas
                    storage_options=self.memory.storage_options if self.memory is not None else None,
                    arenas=(self.memory.keep_last or 1) + 1 if self.memory is not None else 1,
                    io_threads=self.save_kwargs.get("io_threads", 4))
            self._prewarmed = True
        to_storage = decision.save
        if to_storage:
            self._cadence.saved()  # (the wall-clock interval counts from this save, whichever tier takes it)
        if self.memory is not None and (to_storage or self.memory.due(step)):
            self._save_to_memory(step, state, drain=to_storage)
            return True
        if not to_storage:
            return False
        self.save(step, state)
        return True

    def _save_to_memory(self, step: int, state: dict[str, Any], *, drain: bool) -> None:
        """(all ranks) Save ``step`` to the memory tier; with ``drain`` the keeper
        then copies it to ``<run_url>/step-<step>`` (or, with a memory backend
        that cannot, a normal save to storage follows)."""
        assert self.memory is not None
        mem = self.memory
        drain_here = drain and mem.can_drain()

        def committed() -> None:  # (all ranks, after the memory commit)
            from bytecp.dist import DistContext

            if DistContext().is_coordinator:
                if drain_here:
                    self._retain()  # storage: make room before the drained copy lands
                    mem.drain(step, self.url_for(step), self.storage_options)
                self._retain(mem.url, mem.keep_last, mem.storage_options)

        self._target(mem.url_for(step), mem.storage_options, state, step, committed)
        if drain and not drain_here:
            self.save(step, state)

    def _save_and_exit(self, step: int, state: dict[str, Any]) -> None:
        """(every rank) The pre-emption save: the in-flight save first, then
        this step unless it is already committed, then exit cleanly."""
        assert self._preemption is not None
        try:
            self.wait()
        except Exception as e:  # the last checkpoint matters more than the failed one
            log.error("bytecp: the save in flight failed (%s); saving step %s before exiting", e, step)
        from bytecp.api import save

        # (the save in flight has ended on every rank: they all read the same answer)
        url = self.url_for(step)
        skipped = any(u == url for u, _ in self.skipped)  # restore skipped what is there: replaced
        if skipped or not open_storage(url, **self.storage_options).exists(fmt.METADATA_FILE):
            save(url, state, step=step, storage_options=self.storage_options,
                 **{**self.save_kwargs, **(self._over_skipped(url) if skipped else {})})
            self._retain()
        log.warning("bytecp: saved %s before exiting on a signal", self.url_for(step))
        self._preemption.restore_handlers()
        raise SystemExit(0)

    def save(self, step: int, state: dict[str, Any]) -> SaveHandle | None:
        """Save ``state`` as ``step-<step>`` (all ranks), then apply retention.

        Synchronous: returns ``None`` once committed and pruned. With
        ``async_save``: returns the :class:`~bytecp.SaveHandle` once staged;
        the previous save must have ended first (its error, if any, is
        reported, not raised), and retention runs when this one commits.
        """
        self._cadence.saved()
        return self._target(self.url_for(step), self.storage_options, state, step, self._retain,
                            base=self._base(step))

    def _target(self, url: str, options: dict[str, Any], state: dict[str, Any], step: int,
                committed: Callable[[], None], base: str | None = None) -> SaveHandle | None:
        """Save to ``url`` (incrementally against ``base`` when given);
        ``committed`` runs once it has committed (at once when synchronous,
        on the save's background thread when asynchronous)."""
        kwargs = dict(self.save_kwargs)
        if "serving_dtype" in kwargs:
            kwargs["serving_whole"] = self._serving_whole(step)
        if any(u == url for u, _ in self.skipped):  # restore skipped it: training goes on past it, replaced
            log.warning("bytecp: saving %s over the checkpoint there that restore skipped (it stays until the "
                        "new one commits)", url)
            kwargs.update(self._over_skipped(url))
            then = committed

            def committed() -> None:  # replaced: no longer one restore skipped (nor a reader others may ignore)
                self.skipped[:] = [(u, why) for u, why in self.skipped if u != url]
                then()

        if not self.async_save:
            from bytecp.api import save

            save(url, state, step=step, storage_options=options, base=base, **kwargs)
            committed()
            return None
        from bytecp.api import async_save

        if self._pending is not None:  # its failure reported before the next save looks at it
            self._pending.wait_done()
            self._report_failed(self._pending)
        handle = async_save(url, state, lazy=self.lazy, step=step, base=base, storage_options=options, **kwargs)
        with self._pending_lock:
            self._pending = handle
            self._retained.clear()
        handle.add_done_callback(lambda h: self._after_async_save(h, committed))
        return handle

    def _over_skipped(self, url: str) -> dict[str, Any]:
        """The save options that replace the checkpoint at ``url`` restore
        skipped: an overwrite, which the other checkpoints restore skipped do
        not refuse by referencing it (an incremental step-4 over a damaged
        step-3: neither loads, and training saves both steps again)."""
        others = tuple(name_of(u) for u, _ in self.skipped if u != url)
        return {"overwrite": True, "overwrite_readers": others}

    def _base(self, step: int) -> str | None:
        """The checkpoint this save may reference: the previous one, unless
        this save is a full one (every ``full_every``-th, or the first)."""
        url, last = self.url_for(step), self._last
        self._last = url
        milestone = bool(milestones([url], [step], self.keep_every_n_steps))  # self-contained: kept for ever
        if not self.incremental or last is None or last == url or self._chain + 1 >= self.full_every or milestone:
            self._chain = 0
            return None
        self._chain += 1
        return last

    def _serving_whole(self, step: int) -> bool:
        """Whether this save writes the serving copy whole: the first, every
        ``full_every``-th and milestones (both tiers count: a follower may read either)."""
        chain = self._serving_chain
        milestone = bool(milestones([self.url_for(step)], [step], self.keep_every_n_steps))
        whole = chain is None or chain + 1 >= self.full_every or milestone
        self._serving_chain = 0 if whole else (chain or 0) + 1
        return whole

    def _after_async_save(self, handle: SaveHandle, committed: Callable[[], None]) -> None:
        """(the save's background thread) Prune (and drain) once the save has
        committed; a failed one is reported here (:meth:`_report_failed`)."""
        try:
            if handle.exception() is None:
                committed()
            else:
                self._report_failed(handle)
        except Exception as e:  # noqa: BLE001 - retention/drain must not lose the committed save
            log.warning("bytecp: after committing %s: %s", handle.url, e)
        finally:
            with self._pending_lock:
                if handle is self._pending:
                    self._retained.set()

    def _report_failed(self, handle: SaveHandle) -> None:
        """(the failed save's background thread) Log the error, count it
        (``save_failed`` event to the recorders, :attr:`failed`) and mark it
        seen, so the next save proceeds instead of raising it: a training
        job keeps training on its last committed checkpoint."""
        error = handle.exception()
        if error is None:  # (before the lock: the next save need not wait for this one's retention)
            return
        with self._retain_lock:
            if handle is self._reported:
                return
            self._reported = handle
        with contextlib.suppress(Exception):
            handle.result()  # marks the error seen: the next async_save does not raise it
        text = f"{type(error).__name__}: {error}"
        self.failed[:] = [*self.failed[-99:], (handle.url, text)]
        recorder.emit_event(recorder.SAVE_FAILED, 1, reason=type(error).__name__)
        log.error("bytecp: the asynchronous save to %s failed, nothing of it is committed; training goes "
                  "on and the next save proceeds: %s", handle.url, text)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the in-flight asynchronous save has committed and its
        retention has run; raise the save's error (no-op when synchronous)."""
        handle = self._pending
        if handle is None:
            return
        handle.wait(timeout)
        if not self._retained.wait(timeout):
            raise TimeoutError(f"retention after the save to {handle.url} not finished after {timeout} s")

    def restore(self, state: dict[str, Any], *, fallback: bool = True, **load_kwargs: Any) -> int | None:
        """Load the newest committed checkpoint that loads into ``state`` (all
        ranks); return its step (the step that was saved, so training resumes
        at the step after it), or ``None`` when the run has nothing to resume.

        Which checkpoints the run holds is the one resume decision
        (:mod:`bytecp.tools.resume`), taken on the coordinator and handed to
        every rank: bytecp's committed checkpoints and, newer than them, those
        of other formats; a run folder whose newest checkpoint cannot be told
        (a step folder no format reads above the newest that loads, ...)
        raises :class:`~bytecp.errors.ResumeDecisionError` naming it, and a
        storage error while listing is raised: neither is ever a fresh start.
        :attr:`decision` keeps the answer.

        ``fallback=True`` (the default): a checkpoint that fails verification
        or loading because its own files are bad (checksum mismatch, a data
        or index file missing or truncated, unreadable ``metadata.json``) is
        skipped with a warning naming it and why, and the previous one is
        tried; nothing is deleted (when training reaches a skipped
        checkpoint's step again, that save replaces it: the old one stays
        until the new one commits). Errors that an older checkpoint would not
        cure stop the restore at once: a newer format, a state that does not
        fit (keys, shapes), pickles not allowed, storage refusing access or
        failing transiently. If no checkpoint loads,
        :class:`~bytecp.errors.CorruptCheckpointError` names each one tried.
        ``fallback=False``: the newest committed checkpoint or its error.
        The other keyword arguments are those of :func:`bytecp.load`.
        """
        from bytecp.api import load

        if self._pending is not None:  # never list while a save or its retention is in flight
            from bytecp.saving.handles import wait_for_pending_save

            wait_for_pending_save()
            self._retained.wait()
        group = {k: load_kwargs.get(k, self.save_kwargs.get(k)) for k in ("process_group", "coordinator_rank")}
        self.decision = decide_together(self.run_url, self.storage_options, process_group=group["process_group"],
                                        coordinator_rank=group["coordinator_rank"] or 0)
        found = self.decision.candidates()  # (raises, on every rank, when undecided)
        self.skipped = []
        if self.memory is not None:  # the newest memory checkpoint first when at least as new as storage's newest
            info = self.memory.restore(found[0] if found else None, self.storage_options, state, self.skipped,
                                       **{"data_reshard": self.data_reshard, **load_kwargs})
            if info is not None:
                self.restored_from = "memory"
                return info.step
        loaded = first_that_loads(found, lambda c: load(c.url, state, storage_options=self.storage_options,
                                                        **{"data_reshard": self.data_reshard, **load_kwargs}),
                                  run_url=self.run_url, fallback=fallback, skipped=self.skipped)
        if loaded is None:  # (when every one tried was skipped, first_that_loads raised naming each)
            return None
        self.restored_from = "storage"
        return loaded.step

    def _retain(self, root_url: str | None = None, keep_last: int | None = -1,
                options: dict[str, Any] | None = None) -> None:
        """(coordinator; the training thread when synchronous, the save's
        background thread when asynchronous) Delete all but the newest
        ``keep_last`` committed checkpoints. Only committed checkpoints are
        listed, so an in-flight save is never counted, and the newest
        committed one is always kept. Then the files of killed saves in
        step directories below the newest committed step are removed (see
        :func:`~bytecp.tools.retention.sweep_uncommitted`; with ``keep_last=None`` nothing is
        listed, and ``bytecp gc RUN`` removes them). ``root_url``,
        ``keep_last`` and ``options``: another tier's (the memory tier's)."""
        from bytecp.dist import DistContext

        storage_tier = root_url is None
        root_url = root_url or self.run_url
        keep = self.keep_last if keep_last == -1 else keep_last
        options = self.storage_options if options is None else options
        if keep is None or not DistContext().is_coordinator:
            return
        with self._retain_lock:
            infos = list_checkpoints(root_url, storage_options=options)
            found = [c.name for c in infos]
            cut = max(0, len(found) - keep)
            # milestones (keep_every_n_steps) stay beside the newest ``keep``
            marked = milestones(found[:cut], [c.step for c in infos[:cut]],
                                self.keep_every_n_steps if storage_tier else None)
            kept = [n for n in found[:cut] if n in marked] + found[cut:]
            root = open_storage(root_url, **options)
            # what kept checkpoints reference stays (their bases are retired, not deleted)
            retain(root, kept, [n for n in found[:cut] if n not in marked], lambda: [
                c.name for c in list_checkpoints(root_url, storage_options=options)])
            if storage_tier and infos and infos[-1].step is not None:
                sweep_uncommitted(root, infos[-1].step, set(kept), self.run_url)
