"""``bytecp follow RUN [--json]``: one line per newly committed checkpoint of
a run, for schedulers and evaluation launchers; nothing is loaded.

Reached through the CLI's subcommand registry (``bytecp.cli._EXTERNAL``:
``main(argv)``), in one process. :func:`watch` lists the run every
``--poll-s`` seconds (:func:`bytecp.catalog.list_checkpoints`); for each
checkpoint newer than the last one printed (the newest at start first; when
several committed meanwhile, only the newest) it compares index rows with
the last one printed (:func:`bytecp.serving.changes.changed_tensors`: no
data read) and prints ``{"step", "url", "tier", "bytes_changed",
"tensors_changed", "tensors", "skipped"}`` (``skipped``: the checkpoints
committed between the one printed before and this one, not printed; 0 for
the first); a checkpoint whose own files are bad
(an unreadable ``metadata.json`` or index) is printed once as ``{"step",
"url", "tier", "error"}`` and passed over, as :func:`bytecp.follow` reports a
failed update and waits for a newer one. ``--memory-url keeper://<job>/<run>`` (the
keepers, host and token from ``BYTECP_KEEPERS``, ``BYTECP_KEEPER_HOST``,
``BYTECP_KEEPER_TOKEN``) lists the run's memory tier too, as
:func:`bytecp.follow` does (:mod:`bytecp.serving.sources`: the newer step of
either tier, ``tier`` says which; the drained copy of a save printed is not
printed again). ``--storage-options`` (JSON) are the run's storage
options, as for the other commands. SIGTERM (and SIGINT) end it with exit
code 0 after the line being printed -- also while it starts: the handlers
are installed before the readers (and torch) are imported; storage errors
are the CLI's exit codes.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from bytecp.errors import BytecpError, CheckpointNotFoundError, CorruptCheckpointError

__all__ = ["main", "watch"]


def watch(run_url: str, *, poll_s: float = 5.0, stop: threading.Event | None = None,
          idle_timeout_s: float | None = None, memory_url: str | None = None,
          memory_storage_options: dict[str, Any] | None = None,
          storage_options: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Each newly committed checkpoint of ``run_url`` (and of its memory tier
    ``memory_url``, when given) as a JSON-able record (see the module's
    docstring); ends when ``stop`` is set or after ``idle_timeout_s``
    seconds with nothing new."""
    stop = stop or threading.Event()
    if stop.is_set():  # (a SIGTERM while it started: nothing to import)
        return
    from bytecp.format import metadata as fmt  # (here: main() installs its signal handlers first)
    from bytecp.loading.opened import open_checkpoint
    from bytecp.serving.changes import changed_tensors, rows_by_tensor
    from bytecp.serving.sources import Held, Sources
    from bytecp.storage_api import open_storage

    sources = Sources(run_url, dict(storage_options or {}), memory_url, memory_storage_options)
    held = Held()
    last_rows: dict[str, list[fmt.ChunkRecord]] = {}
    failed: set[str] = set()  # checkpoints whose own files are bad: reported once, passed over after
    idle = 0.0
    while not stop.is_set():
        found = sources.newest(held, failed)
        if found is not None:
            new = found.info
            try:
                opened = open_checkpoint(open_storage(new.url, **sources.options_for(found.tier)))
                rows = rows_by_tensor(opened.all_rows())
            except (CorruptCheckpointError, CheckpointNotFoundError) as e:  # as bytecp.follow: a failed update
                failed.add(new.url)
                yield {"step": new.step, "url": new.url, "tier": found.tier, "error": str(e)}
                continue
            first = held.url is None
            if held.url is None:
                changed = list(rows)
            else:
                changed = list(changed_tensors(list(rows), rows, new.url, last_rows, held.url).changed)
            held, last_rows, idle = Held(new.url, new.step, found.save_id), rows, 0.0
            yield {"step": new.step, "url": new.url, "tier": found.tier,
                   "bytes_changed": sum(r.nbytes for f in changed for r in rows[f]),
                   "tensors_changed": len(changed), "tensors": len(rows), "skipped": 0 if first else found.skipped}
            continue
        if idle_timeout_s is not None and idle >= idle_timeout_s:
            return
        stop.wait(poll_s)
        idle += poll_s


def main(argv: Sequence[str]) -> int:
    """``bytecp follow``: returns its exit code (0 on SIGTERM/SIGINT)."""
    from bytecp.cli import EXIT_OK, _json_options

    p = argparse.ArgumentParser(prog="bytecp follow", description="print each newly committed checkpoint of a run")
    p.add_argument("run", help="the run directory (the CheckpointManager's run_url)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--poll-s", type=float, default=5.0, help="seconds between listings of the run (default 5)")
    p.add_argument("--idle-timeout-s", type=float, default=None, help="exit 0 after this long with nothing new")
    p.add_argument("--memory-url", default=None,
                   help="the run's memory tier (keeper://<job>/<run>; keepers from BYTECP_KEEPERS, "
                        "BYTECP_KEEPER_HOST, BYTECP_KEEPER_TOKEN): list it too, take the newer step")
    p.add_argument("--storage-options", default=None, help="the run's storage options as a JSON object")
    args = p.parse_args(list(argv))
    if args.poll_s <= 0:
        p.error("--poll-s must be > 0")
    try:
        options = _json_options(args.storage_options, "--storage-options")
    except BytecpError as e:
        return _failed(e, args.json)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        for rec in watch(args.run, poll_s=args.poll_s, stop=stop, idle_timeout_s=args.idle_timeout_s,
                         memory_url=args.memory_url, storage_options=options):
            if args.json:
                print(json.dumps(rec, sort_keys=True), flush=True)
            elif "error" in rec:
                print(f"step {rec['step']}  {rec['url']}  {rec['tier']}  not taken: {rec['error']}", flush=True)
            else:
                passed = f", {rec['skipped']} checkpoint(s) since the last line not printed" if rec["skipped"] else ""
                print(f"step {rec['step']}  {rec['url']}  {rec['tier']}  {rec['bytes_changed']} bytes changed "
                      f"({rec['tensors_changed']}/{rec['tensors']} tensors{passed})", flush=True)
    except BytecpError as e:
        return _failed(e, args.json)
    return EXIT_OK


def _failed(e: BytecpError, as_json: bool) -> int:
    """The error on stderr (and as a JSON record with ``--json``); -> its exit code."""
    from bytecp.cli import EXIT_USAGE, exit_code

    print(f"bytecp follow: {e}", file=sys.stderr)
    if as_json:
        print(json.dumps({"error": str(e), "exit_code": exit_code(e)}), flush=True)
    return exit_code(e) or EXIT_USAGE
