"""Knowing at once that a rank is gone, whatever MLX is doing.

When a rank dies, MLX's ring backend fails the collectives in progress, and usually
the engine thread's next evaluation raises. Not always: an evaluation already
waiting when the ring fails can wait forever (MLX 0.32, about one kill in six here),
and a server whose engine thread hangs would hang its clients with it. So every
follower also holds one plain TCP connection to rank 0, on which nothing is ever
sent: the kernel closes it the moment the follower's process ends, and a watcher
thread on rank 0 sees that, independently of MLX.

Rank 0 listens on an ephemeral port and tells the followers which one in a one-time
broadcast after loading (0: no watch). A follower connects to rank 0's address as
the launcher gave it (the ring backend's hostfile, or JACCL's coordinator); where it
cannot tell that address, it says so and runs unwatched.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import threading
from collections.abc import Callable

import mlx.core as mx

log = logging.getLogger(__name__)

ACCEPT_TIMEOUT_S = 60.0


def _broadcast_port(port: int, group: mx.distributed.Group) -> int:
    summed = mx.distributed.all_sum(mx.array([port], dtype=mx.int32), group=group)
    return int(summed.item())


def rank0_host() -> str | None:
    """Rank 0's address as `mlx.launch` wired it, if it can be told."""
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile:
        try:
            hosts = json.loads(open(hostfile).read())
            return str(hosts[0][0]).rsplit(":", 1)[0]
        except (OSError, ValueError, IndexError, TypeError):
            return None
    coordinator = os.environ.get("MLX_JACCL_COORDINATOR")
    return coordinator.rsplit(":", 1)[0] if coordinator else None


class RankWatch:
    """Rank 0's side: accepts one connection per follower, then calls `on_lost` (once,
    from its own thread) when any of them closes."""

    def __init__(self, group: mx.distributed.Group) -> None:
        self._listener = socket.create_server(("", 0))
        self._followers = group.size() - 1
        _broadcast_port(self._listener.getsockname()[1], group)

    def start(self, on_lost: Callable[[str], None]) -> None:
        threading.Thread(
            target=self._watch, args=(on_lost,), name="rank-watch", daemon=True
        ).start()

    def _watch(self, on_lost: Callable[[str], None]) -> None:
        self._listener.settimeout(ACCEPT_TIMEOUT_S)
        connections = []
        try:
            for _ in range(self._followers):
                connection, _ = self._listener.accept()
                connections.append(connection)
        except OSError:
            log.warning(
                "not every rank connected to rank 0's watch: a lost rank is then "
                "noticed only by MLX"
            )
        finally:
            self._listener.close()
        while connections:
            readable, _, _ = select.select(connections, [], [])
            for connection in readable:
                if not connection.recv(1):  # closed: that rank's process has ended
                    on_lost("a rank was lost (its process ended)")
                    return


def join_watch(group: mx.distributed.Group) -> socket.socket | None:
    """A follower's side: connect to rank 0's watch; keep the socket open for life."""
    port = _broadcast_port(0, group)
    host = rank0_host()
    if not port or host is None:
        log.warning("rank %d: rank 0's address is unknown; running unwatched", group.rank())
        return None
    try:
        return socket.create_connection((host, port), timeout=ACCEPT_TIMEOUT_S)
    except OSError as exc:
        log.warning("rank %d: could not join rank 0's watch (%s)", group.rank(), exc)
        return None
