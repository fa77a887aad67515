"""Liveness of a zmq connection to a peer on another host: heartbeats (`with_heartbeat`)
and `ConnectionWatch`, which tells whether the peer's connection closed. Not owned: the
sockets themselves and what goes over them (`client.py`, `hosts.py`, `core.py`).
"""

from __future__ import annotations

import threading
import time
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


class PeerSocket:
    """A bound ROUTER that talks with one peer: the sender of the message `accept`ed
    (a core's first); other connections to the port (another deployment's core on the
    wrong port) are neither read from nor sent to, where a bound DEALER would deal its
    messages to every peer in turn. Before `accept`, every one-frame message is read.
    Offers the calls the front end makes of a DEALER: send, poll, recv, close."""

    def __init__(self, socket: Any) -> None:
        self._socket = socket  # a ROUTER
        self._peer: bytes | None = None
        self._last: bytes | None = None  # the sender of the message `recv` returned last
        self._pending: list[tuple[bytes, Any]] = []  # read by `poll`, not yet by `recv`

    def accept(self) -> None:
        """Talks with the sender of the message `recv` returned last, from now on."""
        self._peer = self._last

    def send(self, data: bytes) -> None:
        if self._peer is not None:  # a peer gone: dropped (its watch tells)
            self._socket.send_multipart([self._peer, data])

    def poll(self, timeout_ms: int) -> bool:
        """Whether a message of the peer's waits, within `timeout_ms` (< 0: no limit)."""
        deadline = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000
        while not self._pending:
            left = -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if not self._socket.poll(left):
                return False
            identity, *frames = self._socket.recv_multipart(copy=False)
            if len(frames) == 1 and self._peer in (None, identity.bytes):
                self._pending.append((identity.bytes, frames[0]))
        return True

    def recv(self, copy: bool = True) -> Any:
        self.poll(-1)
        self._last, frame = self._pending.pop(0)
        return frame.bytes if copy else frame

    def close(self, linger: int | None = None) -> None:
        self._socket.close(linger)
