"""Loopback TCP ports for the servers the tests start (gloo rendezvous stores,
S3 servers, keepers, collectors), picked where no outgoing connection can take
them first.

Who calls it: every test helper that must name a port before the process that
listens on it starts (``dist.pool``, the launchers of real jobs, the S3 and
keeper fixtures). Such a port is found free, closed, and bound again by the
server moments later; in between, any ``connect()`` on the machine may be
handed the same number as its local port if it lies in the kernel's ephemeral
range (``/proc/sys/net/ipv4/ip_local_port_range``), and the server then fails
with EADDRINUSE. A suite of three workers opens tens of thousands of
connections (every rank's store and gloo pairs), so a port from ``bind(0)``
-- which is inside that range -- lost that race about once a day. The ports
returned here lie below the ephemeral range, at random, so only another
explicit ``bind`` of the same number (one chance in ~20,000 per pick, and the
bind check below catches one already taken) can collide.
"""

from __future__ import annotations

import random
import socket

__all__ = ["free_port", "free_ports"]

#: the lowest port picked: above the well-known and registered services a host runs
_LOWEST = 10000
_RANDOM = random.SystemRandom()


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free right now, below the ephemeral range
    (where the range starts too low to leave room, ports from ``bind(0)``)."""
    top = _ephemeral_start()
    socks: list[socket.socket] = []
    try:
        if top - _LOWEST < 1000:
            for _ in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", 0))
        else:
            for _ in range(200 * n):
                if len(socks) == n:
                    break
                s = socket.socket()
                try:
                    s.bind(("127.0.0.1", _RANDOM.randrange(_LOWEST, top)))
                except OSError:
                    s.close()
                    continue
                socks.append(s)
            if len(socks) < n:
                raise OSError(f"no {n} free loopback ports found in {_LOWEST}-{top - 1}")
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """One loopback port free right now (see :func:`free_ports`)."""
    return free_ports(1)[0]
