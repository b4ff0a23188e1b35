"""Free loopback ports that no `bind(port=0)` elsewhere can be handed meanwhile.

A port found by binding port 0 and closing the socket is an *ephemeral* one: until we bind it again,
the kernel may give it to any other process binding port 0 (our workers do). Ports below the
ephemeral range are never handed out that way, so we pick one there and check it is free.
"""

from __future__ import annotations

import random
import socket


def ephemeral_range() -> tuple[int, int]:
    try:
        low, high = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1", tries: int = 200, avoid: frozenset[int] | set[int] = frozenset()) -> int:
    """`avoid`: ports taken already though nobody listens on them yet (a launch's own, bound by a child later)."""
    low = ephemeral_range()[0]
    start = 10000 if low > 11000 else 1024
    for _ in range(tries):
        port = random.randrange(start, low)
        if port in avoid:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # nothing free below the range: fall back to an ephemeral port
        s.bind((host, 0))
        return s.getsockname()[1]
