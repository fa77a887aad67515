"""Data-parallel engine cores across hosts (vLLM's headless engines and their handshake).

The head (`jvllm serve M -dp N --data-parallel-size-local L --data-parallel-address IP
--data-parallel-rpc-port P`) runs the API server(s) and ranks 0 .. L-1, and listens on
tcp://IP:P (`RemoteCores`). A headless process (`--headless --data-parallel-start-rank
R`, `run_headless`) runs ranks R .. R+L'-1 and no API server: it registers with the head
(`Register` -> `Welcome`, within `handshake_timeout()` seconds or it exits with an
error), starts its cores, each serving on a TCP port of the address this host reaches
the head from, and tells the head their addresses (`Ready`). The head's front ends then
connect to them as to local cores. The headless process stays connected, stops its cores
and exits 0 when the head says `Stop` (the head's drain) or it gets SIGTERM, and exits 1
if the head goes away or one of its cores dies. A remote core's death is seen by the
front end as its connection closing (`ConnectionWatch`; zmq heartbeats every
`HEARTBEAT_IVL_MS` close a connection silent for `HEARTBEAT_TIMEOUT_MS`, so a host that
vanished counts too). Not owned: the flags (`server/process_args.py`), local processes
(`launcher.py`), the messages between front end and core (`messages.py`).
"""

from __future__ import annotations

import logging
import os
import signal
import socket as pysocket
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from jvllm.engine.core import messages as m
from jvllm.engine.core.client import process_exit_status

logger = logging.getLogger("jvllm.engine_core")

# A DEALER pings its peer this often, and drops a connection silent this long.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
# Milliseconds between checks while waiting on a socket.
POLL_MS = 100
# Seconds the head waits for a headless process to stop its cores.
STOP_WAIT_S = 10.0
# Seconds between the head's log lines while it waits for remote ranks.
WAITING_LOG_S = 30.0


class Register(msgspec.Struct, tag="register"):
    start_rank: int
    size_local: int
    size: int
    hostname: str


class Welcome(msgspec.Struct, tag="welcome"):
    error: str | None = None
    loads_address: str | None = None  # the DP coordinator's, if the head runs one


class Ready(msgspec.Struct, tag="ready"):
    addresses: list[str]
    pids: list[int]


class Failed(msgspec.Struct, tag="failed"):
    reason: str


class Stop(msgspec.Struct, tag="stop"):
    pass


class Stopped(msgspec.Struct, tag="stopped"):
    pass


Handshake = Register | Welcome | Ready | Failed | Stop | Stopped
_decoder = msgspec.msgpack.Decoder(Handshake)


def handshake_timeout() -> float:
    """Seconds a headless process waits for the head's answer (JVLLM_DP_HANDSHAKE_TIMEOUT_S,
    default 30)."""
    return float(os.environ.get("JVLLM_DP_HANDSHAKE_TIMEOUT_S", "30"))


def with_heartbeat(socket: Any) -> Any:
    """Pings the peer; a connection silent for HEARTBEAT_TIMEOUT_MS is closed."""
    socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    socket.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
    return socket


class ConnectionWatch:
    """Whether a connected socket's peer went away (its connection closed or went silent).
    Made before the socket connects; `lost()` may be called from any thread."""

    def __init__(self, socket: Any) -> None:
        self._socket = socket
        self._monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._lock = threading.Lock()
        self._lost: str | None = None

    def lost(self) -> str | None:
        with self._lock:
            if self._lost is None and self._monitor is not None and self._monitor.poll(0):
                self._lost = "its connection closed"
            return self._lost

    def close(self) -> None:
        with self._lock:
            if self._monitor is not None:
                self._socket.disable_monitor()
                self._monitor.close()
                self._monitor = None


class RemoteCores:
    """The head's side: takes the registrations of headless processes for ranks
    `local .. size-1`, and stops them on shutdown."""

    def __init__(self, dp: Any, loads_address: str | None) -> None:
        self._dp, self._loads_address = dp, loads_address
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a peer gone: an error, not a drop
        try:
            self._socket.bind(dp.handshake_address)
        except zmq.ZMQError as e:
            self.close()
            raise ValueError(
                f"cannot listen for headless engine cores on {dp.handshake_address} ({e}); "
                "--data-parallel-address must be this host's IP and the port free"
            ) from None
        self._pending = set(range(dp.local_size, dp.data_parallel_size))
        self._claims: dict[bytes, list[int]] = {}  # headless process -> its ranks
        self.addresses: dict[int, str] = {}
        self.pids: dict[int, int] = {}
        logger.info(
            "waiting for DP ranks %s to register at %s", sorted(self._pending), dp.handshake_address
        )

    def wait(self, local_dead: Callable[[], list[str]]) -> None:
        """Until every remote rank is serving; RuntimeError if a headless process reports a
        failure or a local core dies meanwhile."""
        logged = time.monotonic()
        while len(self.addresses) < self._dp.data_parallel_size - self._dp.local_size:
            if self._socket.poll(POLL_MS):
                identity, payload = self._socket.recv_multipart()
                self._on_message(identity, _decoder.decode(payload))
            dead = local_dead()
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited while starting")
            if time.monotonic() - logged > WAITING_LOG_S:
                waiting = sorted(set(range(self._dp.local_size, self._dp.data_parallel_size)))
                logger.info(
                    "still waiting for DP ranks %s", sorted(set(waiting) - set(self.addresses))
                )
                logged = time.monotonic()
        logger.info("remote engine cores ready: %s", self.addresses)

    def _on_message(self, identity: bytes, message: Any) -> None:
        dp = self._dp
        if isinstance(message, Register):
            ranks = list(range(message.start_rank, message.start_rank + message.size_local))
            error = None
            if message.size != dp.data_parallel_size:
                error = (
                    f"data_parallel_size={message.size} differs from the head's "
                    f"{dp.data_parallel_size}"
                )
            elif not set(ranks) <= self._pending:
                error = (
                    f"DP ranks {ranks} are not free: the head waits for ranks "
                    f"{sorted(self._pending)}"
                )
            if error is None:
                self._pending -= set(ranks)
                self._claims[identity] = ranks
                logger.info(
                    "headless engine cores on %s registered: ranks %s", message.hostname, ranks
                )
            self._send(identity, Welcome(error, None if error else self._loads_address))
        elif isinstance(message, Ready) and identity in self._claims:
            for rank, address, pid in zip(
                self._claims[identity], message.addresses, message.pids, strict=True
            ):
                self.addresses[rank], self.pids[rank] = address, pid
        elif isinstance(message, Failed):
            raise RuntimeError(f"headless engine cores failed: {message.reason}")

    def _send(self, identity: bytes, message: msgspec.Struct) -> bool:
        try:
            self._socket.send_multipart([identity, m.encode(message)])
        except zmq.ZMQError:  # that process is gone
            return False
        return True

    def stop(self) -> None:
        """Tells every headless process to stop its cores; waits (STOP_WAIT_S) for them."""
        waiting = {identity for identity in self._claims if self._send(identity, Stop())}
        deadline = time.monotonic() + STOP_WAIT_S
        while waiting and time.monotonic() < deadline:
            if self._socket.poll(POLL_MS):
                identity, payload = self._socket.recv_multipart()
                if isinstance(_decoder.decode(payload), Stopped):
                    waiting.discard(identity)
        if waiting:
            logger.warning("%d headless process(es) did not confirm their stop", len(waiting))
        self.close()

    def close(self) -> None:
        self._socket.close()
        self._context.term()


def run_headless(engine_args: Any, dp: Any) -> int:
    """A `--headless` process: registers with the head, runs its cores until told to stop;
    its exit status (0: stopped by the head or SIGTERM)."""
    from jvllm.engine.core.launcher import EngineCoreProcs

    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    context = zmq.Context()
    head = with_heartbeat(context.socket(zmq.DEALER))
    head.setsockopt(zmq.LINGER, 0)
    watch = ConnectionWatch(head)
    procs = None
    try:
        welcome = _register(head, dp)
        host = _local_ip(dp.data_parallel_address, dp.rpc_port)
        procs = EngineCoreProcs(
            engine_args, dp.local_size, welcome.loads_address, dp.start_rank, host
        )
        for address, pid in zip(procs.addresses, procs.pids, strict=True):
            failure = _wait_serving(context, address, pid, watch, stopping)
            if failure is not None:
                head.send(m.encode(Failed(failure)))
                logger.error("%s", failure)
                return 0 if stopping.is_set() else 1
        head.send(m.encode(Ready(procs.addresses, procs.pids)))
        logger.info(
            "engine cores %s (pids %s) serving the head at %s",
            procs.addresses,
            procs.pids,
            dp.handshake_address,
        )
        return _serve(head, watch, procs, stopping, dp.handshake_address)
    finally:
        if procs is not None:
            procs.stop()
        watch.close()
        head.close()
        context.term()


def _register(head: Any, dp: Any) -> Welcome:
    timeout = handshake_timeout()
    try:
        head.connect(dp.handshake_address)
    except zmq.ZMQError as e:
        raise ValueError(
            f"--data-parallel-address: cannot connect to {dp.handshake_address}: {e}"
        ) from None
    hello = Register(dp.start_rank, dp.local_size, dp.data_parallel_size, pysocket.gethostname())
    head.send(m.encode(hello))
    if not head.poll(int(timeout * 1000)):
        raise RuntimeError(
            f"no data-parallel head answered at {dp.handshake_address} within {timeout:g} s "
            "(JVLLM_DP_HANDSHAKE_TIMEOUT_S): start the head (`jvllm serve` with the same "
            "--data-parallel-address and --data-parallel-rpc-port) and check the address; a "
            "head serving already (every rank registered) takes no more"
        )
    welcome = _decoder.decode(head.recv())
    if not isinstance(welcome, Welcome):
        raise RuntimeError(f"the head answered {welcome!r} to a registration")
    if welcome.error is not None:
        raise ValueError(f"the head at {dp.handshake_address} refused these ranks: {welcome.error}")
    return welcome


def _local_ip(head_ip: str, port: int) -> str:
    """This host's address on the route to the head (what the head connects back to)."""
    with pysocket.socket(pysocket.AF_INET, pysocket.SOCK_DGRAM) as probe:
        probe.connect((head_ip, port))  # UDP: no packet is sent
        return probe.getsockname()[0]


def _wait_serving(
    context: Any, address: str, pid: int, watch: ConnectionWatch, stopping: threading.Event
) -> str | None:
    """Until the core at `address` answers; else why not."""
    probe = context.socket(zmq.DEALER)
    probe.setsockopt(zmq.LINGER, 0)
    probe.connect(address)
    probe.send(m.encode(m.Hello()))
    try:
        while not probe.poll(POLL_MS):
            if process_exit_status(pid) is not None:
                return f"engine core at {address} (pid {pid}) exited while starting"
            if watch.lost() or stopping.is_set():
                return "stopped while the engine cores started (the head went away, or a signal)"
        return None
    finally:
        probe.close()


def _serve(
    head: Any, watch: ConnectionWatch, procs: Any, stopping: threading.Event, address: str
) -> int:
    while not stopping.is_set():
        if head.poll(POLL_MS * 5) and isinstance(_decoder.decode(head.recv()), Stop):
            logger.info("the head said stop: stopping the engine cores")
            procs.stop()
            head.send(m.encode(Stopped()))
            return 0
        if watch.lost():
            logger.error("the head at %s went away (%s): stopping", address, watch.lost())
            return 1
        dead = procs.dead()
        if dead:
            head.send(m.encode(Failed(f"{', '.join(dead)} died")))
            logger.error("%s died: stopping", ", ".join(dead))
            return 1
    logger.info("signalled: stopping the engine cores")
    return 0


class AllCores:
    """The head's cores in DP-rank order: this host's (`EngineCoreProcs`), then those of
    other hosts (`RemoteCores`); the shape `EngineCoreProcs` gives `server/split.py`."""

    def __init__(self, local: Any, remote: RemoteCores) -> None:
        self._local, self._remote = local, remote
        ranks = sorted(remote.addresses)
        self.addresses = local.addresses + [remote.addresses[r] for r in ranks]
        self.pids = local.pids + [remote.pids[r] for r in ranks]

    def dead(self) -> list[str]:
        """This host's cores that exited (a remote core's death is its front ends' to see)."""
        return self._local.dead()

    def stop(self) -> None:
        self._remote.stop()
        self._local.stop()
