"""Knowing at once that a rank is gone, whatever MLX is doing.

When a rank dies, MLX's ring backend fails the collectives in progress, and usually
the engine thread's next evaluation raises. Not always: an evaluation already
waiting when the ring fails can wait forever (MLX 0.32, about one kill in six here),
and a server whose engine thread hangs would hang its clients with it. So every
follower also holds one plain TCP connection to rank 0, on which nothing is ever
sent: the kernel closes it the moment the follower's process ends, and a watcher
thread on rank 0 sees that, independently of MLX.

Rank 0 listens on an ephemeral port and tells the followers which one, with a
random token, in a one-time broadcast after loading. A follower connects to rank 0's
address as the launcher gave it (the ring backend's hostfile, or JACCL's
coordinator) and sends the token; a connection without it is dropped, so another
host on the LAN cannot take a follower's place and then fail the server by leaving.
Where a follower cannot tell rank 0's address, it says so and runs unwatched.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import select
import socket
import threading
from collections.abc import Callable

import mlx.core as mx

log = logging.getLogger(__name__)

ACCEPT_TIMEOUT_S = 60.0
TOKEN_TIMEOUT_S = 5.0


def _broadcast(port: int, token: int, group: mx.distributed.Group) -> tuple[int, int]:
    summed = mx.distributed.all_sum(mx.array([port, token], dtype=mx.int32), group=group)
    port, token = summed.tolist()
    return port, token


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
        self._token = secrets.randbits(31)
        _broadcast(self._listener.getsockname()[1], self._token, group)

    def start(self, on_lost: Callable[[str], None]) -> None:
        threading.Thread(
            target=self._watch, args=(on_lost,), name="rank-watch", daemon=True
        ).start()

    def _watch(self, on_lost: Callable[[str], None]) -> None:
        self._listener.settimeout(ACCEPT_TIMEOUT_S)
        connections = []
        try:
            while len(connections) < self._followers:
                connection, _ = self._listener.accept()
                if self._has_token(connection):
                    connections.append(connection)
                else:
                    connection.close()
        except OSError:
            log.warning(
                "not every rank connected to rank 0's watch: a lost rank is then "
                "noticed only by MLX"
            )
        finally:
            self._listener.close()
        for connection in connections:
            connection.settimeout(None)
        while connections:
            readable, _, _ = select.select(connections, [], [])
            for connection in readable:
                try:
                    data = connection.recv(1)
                except OSError:  # reset: gone all the same
                    data = b""
                if not data:  # closed: that rank's process has ended
                    on_lost("a rank was lost (its process ended)")
                    return

    def _has_token(self, connection: socket.socket) -> bool:
        connection.settimeout(TOKEN_TIMEOUT_S)
        try:
            return connection.recv(4, socket.MSG_WAITALL) == self._token.to_bytes(4, "big")
        except OSError:
            return False


def join_watch(group: mx.distributed.Group) -> socket.socket | None:
    """A follower's side: connect to rank 0's watch with its token; keep the socket
    open for life."""
    port, token = _broadcast(0, 0, group)
    host = rank0_host()
    if host is None:
        log.warning("rank %d: rank 0's address is unknown; running unwatched", group.rank())
        return None
    try:
        connection = socket.create_connection((host, port), timeout=ACCEPT_TIMEOUT_S)
        connection.sendall(token.to_bytes(4, "big"))
        return connection
    except OSError as exc:
        log.warning("rank %d: could not join rank 0's watch (%s)", group.rank(), exc)
        return None
