"""Free TCP ports for tests whose spawned ranks bind a port that the test picked.

A port picked by binding port 0 lies in the kernel's ephemeral range, which every
outgoing connection on the machine also draws its local port from; between the pick and
a spawned rank's bind (seconds: the rank imports torch first) another socket can take it
(seen in CI: rank 0's store failed with EADDRINUSE and its peers timed out connecting).
Ports below that range are handed out only on request, so a free one stays free.
"""

from __future__ import annotations

import random
import socket

__all__ = ["free_port", "free_ports"]

_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_SPAN = 10000  # how far below the ephemeral range to look
_LOWEST = 10000


def _ephemeral_low() -> int:
    try:
        with open(_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports on `host` that were free a moment ago, from below the ephemeral
    range where it leaves room (else the kernel's pick)."""
    low = _ephemeral_low()
    held: list[socket.socket] = []
    try:
        if low - _SPAN >= _LOWEST:
            rng = random.SystemRandom()
            for _ in range(200 * n):
                if len(held) == n:
                    break
                s = socket.socket()
                try:
                    s.bind((host, rng.randrange(low - _SPAN, low)))
                except OSError:
                    s.close()
                    continue
                held.append(s)
        while len(held) < n:
            s = socket.socket()
            s.bind((host, 0))
            held.append(s)
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One port of `free_ports`."""
    return free_ports(1, host)[0]
