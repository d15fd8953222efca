"""Whether a run folder has a checkpoint to resume, and which: the one decision.

Every resume path asks :func:`decide` (or :func:`decide_together`, which
decides on the coordinator and hands every rank the same answer):
:meth:`bytecp.CheckpointManager.restore`, torchtitan's manager
(``load()``, ``load_step``, ``initial_load_path``), Lightning's
``latest_checkpoint`` and ``ckpt_path="last"``, a DeepSpeed or
Megatron-LM run folder given to ``bytecp.load`` (its pointer file),
``bytecp ls`` (which shows the answer) and ``bytecp.follow``. The answer
(:class:`Decision`) is one of three:

- **resume**: the run's checkpoints that may load, newest first -- bytecp's
  committed ones (including one whose ``metadata.json`` does not read: it is
  tried, fails, and the caller falls back past it with a warning) and, newer
  than all of them, those of other formats (:mod:`bytecp.interop.runs`);
- **fresh**: nothing to resume -- the folder is missing or holds nothing
  checkpoint-like (other files, logs and configs are not), or only entries
  that are no checkpoint: bytecp saves that never committed, empty folders,
  another tool's saves newer than its pointer file names (unfinished);
- **undecided**, and why: a step folder no format reads newer than every
  checkpoint that loads, a checkpoint-like folder whose name says no step
  (``step-abc``), a pointer file naming a checkpoint that is not there.
  :meth:`Decision.check` raises :class:`~bytecp.errors.ResumeDecisionError`.

Listing the folder may fail (permission denied, a bucket that does not
exist, throttling or timeouts after the storage layer's retries): that
error is raised as it is. Nothing here reads an error as "nothing there".

:func:`first_that_loads` is the fallback every path shares: the candidates
newest first, past the ones whose own files are bad
(:func:`bytecp.catalog.checkpoint_is_bad`), never past any other error.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from bytecp.catalog import CheckpointInfo, checkpoint_is_bad, one_line, scan
from bytecp.errors import CheckpointNotFoundError, CorruptCheckpointError, ResumeDecisionError
from bytecp.interop import runs
from bytecp.storage_api import Storage, open_storage

__all__ = ["Decision", "decide", "decide_together", "first_that_loads", "check_pointer"]

log = logging.getLogger("bytecp.manager")


@dataclasses.dataclass(frozen=True)
class Decision:
    """What a run folder has to resume (see the module's docstring)."""

    run_url: str
    #: the checkpoints that may load, oldest first (bytecp's, then newer ones of other formats)
    checkpoints: tuple[CheckpointInfo, ...] = ()
    #: (url, why) of the checkpoint-like entries that are no checkpoint to resume
    passed_over: tuple[tuple[str, str], ...] = ()
    #: why no checkpoint can be chosen (None: decided)
    blocker: str | None = None

    @property
    def kind(self) -> str:
        """``"resume"``, ``"fresh"`` or ``"undecided"``."""
        return "undecided" if self.blocker else "resume" if self.checkpoints else "fresh"

    def check(self) -> None:
        """Raise :class:`~bytecp.errors.ResumeDecisionError` when undecided."""
        if self.blocker is not None:
            raise ResumeDecisionError(self.blocker)

    def candidates(self) -> list[CheckpointInfo]:
        """The checkpoints to try, newest first; raises when undecided."""
        self.check()
        return list(reversed(self.checkpoints))

    @property
    def newest(self) -> CheckpointInfo | None:
        """The checkpoint a resume tries first (None: a fresh start); raises when undecided."""
        self.check()
        return self.checkpoints[-1] if self.checkpoints else None

    def describe(self) -> str:
        """The answer in one line (``bytecp ls``, logs)."""
        if self.blocker is not None:
            return f"cannot decide: {self.blocker}"
        if self.checkpoints:
            c = self.checkpoints[-1]
            return f"resume from {c.url} ({c.format}, step {c.step})"
        extra = f"; no checkpoint among {', '.join(u for u, _ in self.passed_over[:3])}" if self.passed_over else ""
        return f"nothing to resume: {self.run_url} holds no checkpoint{extra} (a fresh start)"


def decide(run_url: str, storage_options: dict[str, Any] | None = None) -> Decision:
    """(one process: the coordinator) The run folder's answer; a storage error
    while listing it is raised (see the module's docstring)."""
    root = open_storage(run_url, **(storage_options or {}))
    names = root.list_children("")  # a missing folder lists nothing; a refused or failing one raises
    committed, unreadable = scan(root, run_url, names)
    newest_bytecp = max((c.step for c in committed if c.step is not None), default=-1)
    taken = {c.name for c in committed} | {u.name for u in unreadable}
    ptrs = runs.pointers(root, names)
    foreign: list[CheckpointInfo] = []
    strays: list[runs.Entry] = []
    unnamed: list[str] = []
    passed: list[tuple[str, str]] = []
    for name in names:
        if name in taken or not runs.checkpoint_like(name):
            continue
        step = runs.step_of(name)
        if step is not None and step <= newest_bytecp:
            continue  # a run that moved onto bytecp reads no older folder of another tool
        entry = runs.classify(root, run_url, name)
        unfinished = next((p for p in ptrs if p.step is not None and p.governs.fullmatch(name)
                           and step is not None and step > p.step), None)
        if entry.kind in ("retired", "gone"):
            continue
        if entry.kind == "interrupted":
            passed.append((entry.url, "a bytecp save that never committed (killed, or still running)"))
        elif entry.kind == "empty":
            passed.append((entry.url, "empty"))
        elif unfinished is not None:
            passed.append((entry.url, f"newer than {unfinished.folder}, which {unfinished.tool}'s "
                                      f"{unfinished.file} names: a {unfinished.tool} save that never finished"))
        elif step is None:
            unnamed.append(entry.url)
        elif entry.kind == "foreign":
            foreign.append(CheckpointInfo(name, entry.url, step, "", (), entry.format))
        else:
            strays.append(entry)
    for u in unreadable:  # tried (and failing to load, with a warning), unless it cannot be ordered
        step = runs.step_of(u.name)
        if step is None:
            unnamed.append(f"{u.url} (its metadata.json does not read: {u.why})")
        else:
            committed.append(CheckpointInfo(u.name, u.url, step, ""))
    named = {p.folder for p in ptrs}  # at one step, the checkpoint a tool's pointer names is its own (not a conversion)
    candidates = sorted([*committed, *foreign], key=lambda c: (c.step is None, c.step or 0, c.name in named, c.created))
    blockers = _blockers(run_url, ptrs, newest_bytecp, foreign, strays, unnamed, candidates)
    if passed:
        log.debug("bytecp: %s: no checkpoint in %s", run_url, "; ".join(f"{u} ({why})" for u, why in passed))
    return Decision(run_url.rstrip("/"), tuple(candidates), tuple(passed), "; ".join(blockers) or None)


def _blockers(run_url: str, ptrs: list[runs.Pointer], newest_bytecp: int, foreign: list[CheckpointInfo],
              strays: list[runs.Entry], unnamed: list[str], candidates: list[CheckpointInfo]) -> list[str]:
    """Why no checkpoint of the run can be chosen (none: decided)."""
    out = []
    loadable = max((c.step for c in candidates if c.step is not None), default=-1)
    newest = candidates[-1].url if candidates else None
    lost = [s.url for s in strays if s.step is not None and s.step > loadable]
    if lost:
        out.append(f"{run_url} holds step folders no format bytecp reads ({', '.join(lost[:3])}"
                   f"{', ...' if len(lost) > 3 else ''}), newer than any checkpoint that loads "
                   f"({f'the newest: {newest}' if newest else 'there is none'}); resuming "
                   "would lose their steps: load them with the tool that wrote them, or move them out of the run folder")
    if unnamed:
        out.append(f"{', '.join(unnamed[:3])}{', ...' if len(unnamed) > 3 else ''} look(s) like checkpoints but "
                   f"name no step, so bytecp cannot tell whether they are newer than {newest or 'the others'}: rename them "
                   "step-<N> (or as the tool that wrote them names steps), or move them out of the run folder")
    names = {c.name for c in foreign}
    for p in ptrs:
        if p.folder is not None and p.step is not None and p.step > newest_bytecp and p.folder not in names:
            out.append(f"{run_url}/{p.file} names {p.folder}, which holds no {p.tool} checkpoint bytecp reads: "
                       f"the save it records is gone or damaged; restore {run_url}/{p.folder}, or point "
                       f"{p.file} at the checkpoint to resume")
    return out


def decide_together(run_url: str, storage_options: dict[str, Any] | None = None, *,
                    process_group: Any = None, coordinator_rank: int = 0) -> Decision:
    """(every rank of ``process_group``, or one process) :func:`decide` on the
    coordinator, its answer -- or its error -- on every rank (one broadcast)."""
    from bytecp.dist import DistContext

    ctx = DistContext(process_group, coordinator_rank)
    return ctx.broadcast("resume/decide", lambda: decide(run_url, storage_options))


def first_that_loads(candidates: Sequence[CheckpointInfo], load: Callable[[CheckpointInfo], Any], *,
                     run_url: str, fallback: bool = True,
                     skipped: list[tuple[str, str]] | None = None) -> CheckpointInfo | None:
    """(every rank) Load the first of ``candidates`` (newest first) that loads;
    return it, or None when there is none. With ``fallback`` a checkpoint whose
    own files are bad is skipped with a warning (appended to ``skipped``) and
    the next one tried; any other error is raised at once. If every candidate
    was skipped, :class:`~bytecp.errors.CorruptCheckpointError` names each."""
    skipped = [] if skipped is None else skipped
    for info in candidates:
        try:
            load(info)
        except Exception as e:
            if not fallback or not checkpoint_is_bad(e):
                raise
            why = one_line(e)
            skipped.append((info.url, why))
            log.warning("bytecp: resume skips %s, which does not load (%s); trying the previous checkpoint "
                        "(it is kept: inspect it with `bytecp verify %s`)", info.url, why, info.url)
            continue
        return info
    if skipped:
        tried = "; ".join(f"{url}: {why}" for url, why in skipped)
        raise CorruptCheckpointError(f"no committed checkpoint of {run_url} loads: {tried}")
    return None


def check_pointer(storage: Storage, folder: str, pointer: str) -> None:
    """(the coordinator of a load given a run folder, as a source resolves its
    pointer file: DeepSpeed's ``latest``, Megatron-LM's tracker) Refuse unless
    ``folder``, which ``pointer`` names, is (a checkpoint of the same step as)
    the one the resume decision takes for the run folder ``storage``: a run
    that moved onto bytecp (or a newer step folder no format reads) must not
    load the pointer's older checkpoint. A folder whose name says no step is
    the pointer's alone."""
    step = runs.step_of(folder)
    if step is None:
        return
    newest = decide(storage.url, storage.options()).newest  # (raises when undecided)
    if newest is not None and newest.name != folder and (newest.step is None or newest.step > step):
        raise CheckpointNotFoundError(
            f"{storage.url} is a run folder whose {pointer} names {folder}, but its newest checkpoint is "
            f"{newest.url} ({newest.format}, step {newest.step}): load that, or resume with "
            f"CheckpointManager({storage.url!r}).restore, which picks it")
