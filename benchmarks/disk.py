"""What the disk itself does, measured with ``dd`` in the same run.

- ``write fdatasync``: one stream of zeros, ``bs=16M conv=fdatasync`` (after
  an unreported warm-up write: the first large write of a series is slow).
- ``write random fdatasync``: the same with random bytes (read from tmpfs).
- ``write direct``: ``oflag=direct``.
- ``write parallel``: one ``conv=fdatasync`` stream per rank at once, each
  ``size / W`` bytes; bandwidth = all bytes / wall time.
- ``read cold`` / ``read cold parallel``: the files read back with the page
  cache dropped (root only), one stream or one per rank.
- ``read warm``: one stream from the page cache.

Bandwidths are bytes over the wall time of the ``dd`` processes, in GB/s
(10^9 bytes).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from .harness import can_drop_caches, drop_caches

__all__ = ["measure"]

_BS = 16 << 20


def _dd(*args: str) -> None:
    subprocess.run(["dd", *args, "status=none"], check=True)


def _timed(cmds: list[list[str]]) -> float:
    t0 = time.perf_counter()
    procs = [subprocess.Popen(["dd", *c, "status=none"]) for c in cmds]
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError(f"dd {' '.join(p.args[1:])} failed with {p.returncode}")  # type: ignore[index]
    return time.perf_counter() - t0


def measure(folder: str, total_bytes: int, world: int) -> dict[str, Any]:
    """dd figures for ``total_bytes`` (rounded to 16 MiB blocks) under ``folder``."""
    d = Path(folder) / "dd"
    d.mkdir(parents=True, exist_ok=True)
    count = max(1, round(total_bytes / _BS))
    per = max(1, round(count / world))
    size = count * _BS
    out: dict[str, Any] = {"bytes": size, "block": "16M", "streams": world}
    f = str(d / "one")
    try:
        _dd("if=/dev/zero", f"of={f}", "bs=16M", f"count={min(count, 32)}", "conv=fdatasync")  # warm-up
        os.unlink(f)
        s = _timed([["if=/dev/zero", f"of={f}", "bs=16M", f"count={count}", "conv=fdatasync"]])
        out["write_fdatasync_gbps"] = size / s / 1e9
        os.unlink(f)
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else d
        src = shm / f"bytecp-bench-random-{os.getpid()}"
        try:
            with open(src, "wb") as fh:
                for _ in range(count):
                    fh.write(os.urandom(_BS))
            s = _timed([[f"if={src}", f"of={f}", "bs=16M", "conv=fdatasync"]])
            out["write_random_fdatasync_gbps"] = size / s / 1e9
        finally:
            src.unlink(missing_ok=True)
        os.unlink(f)
        try:
            s = _timed([["if=/dev/zero", f"of={f}", "bs=16M", f"count={count}", "oflag=direct"]])
            out["write_direct_gbps"] = size / s / 1e9
        except RuntimeError as e:  # a filesystem without O_DIRECT
            out["write_direct_gbps"] = None
            out["write_direct_error"] = str(e)
        parts = [str(d / f"part{r}") for r in range(world)]
        s = _timed([["if=/dev/zero", f"of={p}", "bs=16M", f"count={per}", "conv=fdatasync"]
                    for p in parts])
        out["write_parallel_gbps"] = per * world * _BS / s / 1e9
        if can_drop_caches():
            drop_caches()
            s = _timed([[f"if={f}", "of=/dev/null", "bs=16M"]])
            out["read_cold_gbps"] = size / s / 1e9
            drop_caches()
            s = _timed([[f"if={p}", "of=/dev/null", "bs=16M"] for p in parts])
            out["read_cold_parallel_gbps"] = per * world * _BS / s / 1e9
        else:
            out["read_cold_gbps"] = out["read_cold_parallel_gbps"] = None
            out["read_cold_error"] = "dropping the page cache needs root"
        _timed([[f"if={f}", "of=/dev/null", "bs=16M"]])  # bring it into the page cache
        s = _timed([[f"if={f}", "of=/dev/null", "bs=16M"]])
        out["read_warm_gbps"] = size / s / 1e9
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return out
