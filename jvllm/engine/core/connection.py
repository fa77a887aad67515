"""Liveness of a zmq connection to a peer on another host: heartbeats (`with_heartbeat`)
and `ConnectionWatch`, which tells whether the peer's connection closed. Not owned: the
sockets themselves and what goes over them (`client.py`, `hosts.py`, `core.py`).
"""

from __future__ import annotations

import threading
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

# A socket pings its peer this often, and drops a connection silent this long.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000


def with_heartbeat(socket: Any) -> Any:
    """Pings the peer; a connection silent for HEARTBEAT_TIMEOUT_MS is closed."""
    socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    socket.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
    return socket


class ConnectionWatch:
    """Whether a socket's peer went away: its connection closed, or went silent and the
    heartbeat closed it. On a connecting socket, its connection; on a bound one, the
    connection its peer's first message came on (`follow`), so that another connection
    to the port (a port scan) that comes and goes does not count. Made before the socket
    binds or connects; `lost()` may be called from any thread.

    A bound socket's connections are told apart by their file descriptor, which the
    system reuses once a connection closed: the monitor's events are taken in order, and
    a close of the followed descriptor counts only if it comes after the descriptor's
    last accept (the followed connection's: its message came on it, so it was accepted,
    and its descriptor cannot be reused before it closes)."""

    def __init__(self, socket: Any, bound: bool = False) -> None:
        self._socket, self._bound = socket, bound
        events = zmq.EVENT_DISCONNECTED | (zmq.EVENT_ACCEPTED if bound else 0)
        self._monitor = socket.get_monitor_socket(events)
        self._lock = threading.Lock()
        self._fd: int | None = None  # a bound socket's followed connection
        self._lost: str | None = None
        self._events = 0  # taken from the monitor so far
        # Per descriptor: the number of the event of its last accept, and of its last close.
        self._accepted: dict[int, int] = {}
        self._closed: dict[int, int] = {}

    def follow(self, frame: Any) -> None:
        """Watches the connection that `frame`, received on the bound socket, came on."""
        with self._lock:
            self._take_events()
            self._fd = frame.get(zmq.SRCFD)

    def lost(self) -> str | None:
        with self._lock:
            self._take_events()
            if self._lost is None and self._bound and self._fd is not None:
                accepted = self._accepted.get(self._fd)
                if accepted is not None and self._closed.get(self._fd, -1) > accepted:
                    self._lost = "its connection closed"
            return self._lost

    def _take_events(self) -> None:
        """Reads the monitor's queued events in order (under the lock)."""
        while self._monitor is not None and self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            fd = int(event["value"])  # the accepted or closed connection's descriptor
            self._events += 1
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._accepted[fd] = self._events
            elif not self._bound:
                self._lost = "its connection closed"
            else:
                self._closed[fd] = self._events

    def close(self) -> None:
        with self._lock:
            if self._monitor is not None:
                self._socket.disable_monitor()
                self._monitor.close()
                self._monitor = None
