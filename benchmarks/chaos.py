"""The chaos run's long version: seeded random faults over many episodes of a
2-rank training job (some of them with the memory tier's two keepers) that checkpoints every step (see
``tests/reliability/chaos.py`` for the faults and the invariants checked).

    sudo python -m benchmarks.chaos [--episodes 200] [--seed 0] [--minutes M] [--kinds stop,none]

Needs root (a 32 MiB tmpfs for the run, remounted read-only by one fault)
and moto (the S3 episodes). Prints one line per episode, then the figures:
episodes, restarts, saves (and failed ones), faults by kind, checkpoint
verifications, the time from a rank's stall to its peer's error, problems,
and the wall time. Exits 1 if any invariant failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    """(one process, as root) Mount the disk, start moto, run the episodes, print the figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default="", help="comma-separated fault kinds to draw from (default: all)")
    ap.add_argument("--minutes", type=float, default=None, help="stop after this long, whatever --episodes says")
    args = ap.parse_args(argv)
    sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "storage")]
    import s3_servers

    from tests.reliability.chaos import Chaos

    disk = Path(tempfile.mkdtemp(prefix="bytecp-chaos-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(disk)], check=True)
    server = s3_servers.start_moto()
    chaos = None
    try:
        chaos = Chaos(disk, seed=args.seed, s3=(server, server.new_bucket("chaos")))
        kinds = [k for k in args.kinds.split(",") if k]
        t0 = time.monotonic()
        for _ in range(args.episodes):
            if args.minutes is not None and time.monotonic() - t0 > args.minutes * 60:
                break
            chaos.episode(chaos.rng.choice(kinds) if kinds else None)
        fig = chaos.fig
        print(fig.line())
        for p in fig.problems:
            print("PROBLEM:", p)
        if fig.stalls:
            print(f"stall -> peer's error: {', '.join(f'{s:.2f}' for s in fig.stalls)} s "
                  f"(save deadline {chaos.deadline:g} s + roll call)")
        return 1 if fig.problems else 0
    finally:
        if chaos is not None:
            chaos.close()
        server.stop()
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


if __name__ == "__main__":
    raise SystemExit(main())
