"""`engine/core/hosts.py`'s ConnectionWatch on a bound socket (the head's API server's
socket for a core on another host): the core's connection closing counts as its death;
another connection to the port that comes and goes (a port scan) does not."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import zmq

from jvllm.engine.core.connection import ConnectionWatch, with_heartbeat


def _next_event(watch: ConnectionWatch, deadline: float) -> bool:
    """Blocks until the watch's monitor has an event queued (False: the deadline came)."""
    left = deadline - time.monotonic()
    return left > 0 and bool(watch._monitor.poll(int(left * 1000) + 1))


def lost_within(watch: ConnectionWatch, seconds: float) -> str | None:
    deadline = time.monotonic() + seconds
    while watch.lost() is None and _next_event(watch, deadline):
        pass  # the loop's lost() takes the event
    return watch.lost()


def events_within(watch: ConnectionWatch, count: int, seconds: float) -> bool:
    """Whether the watch took `count` monitor events (accepts and closes) in time."""
    deadline = time.monotonic() + seconds
    while watch.lost() is None and watch._events < count and _next_event(watch, deadline):
        pass
    return watch._events >= count


def stray_connection(port: int) -> None:
    """A TCP connection from another process that sends no zmq greeting, closed (a port
    scan): the bound socket's descriptor for it is free for the next connection."""
    scan = f"import socket; socket.create_connection(('127.0.0.1', {port})).sendall(b'GET /')"
    subprocess.run([sys.executable, "-S", "-c", scan], check=True, timeout=30)


CORE = """
import sys, zmq
core = zmq.Context().socket(zmq.DEALER)
core.connect(sys.argv[1])
core.send(b"info")
sys.stdin.read()  # until the test closes its stdin or kills it
"""


def test_a_stray_connection_is_not_the_cores_death_its_own_closing_is():
    """Strays come and go before and after the core's connection, from other processes,
    so the core's connection may reuse a stray's descriptor (whose close is queued)."""
    context = zmq.Context()
    bound = with_heartbeat(context.socket(zmq.DEALER))
    watch = ConnectionWatch(bound, bound=True)
    port = bound.bind_to_random_port("tcp://127.0.0.1")
    core = None
    try:
        stray_connection(port)
        # The stray's accept and close taken before the core connects (its descriptor
        # then free for the core's connection).
        assert events_within(watch, 2, 10)
        address = f"tcp://127.0.0.1:{port}"
        core = subprocess.Popen([sys.executable, "-c", CORE, address], stdin=subprocess.PIPE)
        assert bound.poll(30_000)
        watch.follow(bound.recv(copy=False))
        stray_connection(port)
        assert lost_within(watch, 0.5) is None
        core.kill()
        assert lost_within(watch, 10) == "its connection closed"
    finally:
        if core is not None:
            core.kill()
            core.wait()
        watch.close()
        bound.close(linger=0)
        context.term()


def test_a_client_whose_core_never_connects_closes_its_ports(monkeypatch):
    """EngineCoreClient's start failing (here: the core's info never comes) closes the
    sockets it bound: the port is free again."""
    from jvllm.engine.core.client import EngineCoreClient, EngineCoreDeadError

    monkeypatch.setenv("JVLLM_DP_HANDSHAKE_TIMEOUT_S", "0.2")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    # The traceback kept (as a server's error handling would) holds the half-made client.
    with pytest.raises(EngineCoreDeadError, match="did not connect") as failure:
        EngineCoreClient([address], [os.getpid()], tokenizer=None)
    assert failure.traceback
    context = zmq.Context()
    again = context.socket(zmq.DEALER)
    try:
        again.bind(address)  # EADDRINUSE while the failed client's socket stayed open
    finally:
        again.close(linger=0)
        context.term()


def test_a_peer_socket_talks_with_its_core_alone():
    """Another zmq peer on a core's port (connected first, sending first) is not read once
    the core's message is accepted, and gets none of the messages meant for the core."""
    from jvllm.engine.core.connection import PeerSocket

    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    bound = PeerSocket(router)
    stray, core = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
    try:
        stray.connect(f"tcp://127.0.0.1:{port}")
        stray.send(b"not a core's")
        assert bound.poll(10_000) and bound.recv() == b"not a core's"  # not accepted
        core.connect(f"tcp://127.0.0.1:{port}")
        core.send(b"info")
        assert bound.poll(10_000) and bound.recv() == b"info"
        bound.accept()
        stray.send(b"again")
        for i in range(4):
            bound.send(b"step %d" % i)
            assert core.recv() == b"step %d" % i
            core.send(b"reply %d" % i)
            assert bound.poll(10_000) and bound.recv() == b"reply %d" % i
        assert not stray.poll(100) and not bound.poll(100)
    finally:
        for sock in (stray, core, bound):
            sock.close(linger=0)
        context.term()
