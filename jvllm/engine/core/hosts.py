"""Data-parallel engine cores across hosts (vLLM's headless engines and their handshake).

The head (`jvllm serve M -dp N --data-parallel-size-local L --data-parallel-address IP
--data-parallel-rpc-port P`) runs the API server(s) and ranks 0 .. L-1, and listens on
tcp://IP:P (`RemoteCores`). A headless process (`--headless --data-parallel-start-rank
R`, `run_headless`) runs ranks R .. R+L'-1 and no API server: it registers with the head
(`Register` -> `Welcome`, within `handshake_timeout()` seconds or it exits with an
error), learns from the `Welcome` the head's ports its cores connect out to (as vLLM:
the head binds, so only the head's ports need to be reachable; `head_port`), starts its
cores and tells the head once they built their engines (`Ready`: each core connects
out and its `EngineCoreInfo` is queued, to go once the head's front end binds its port;
a core that dies after `Ready` and before that is seen by the front end, which waits
`handshake_timeout()` seconds for its info and then fails to start, naming the core).
The head probes a registered process until its `Ready` (`Ping`), so one that dies first is an
error naming its host. The headless process stays connected, stops its cores and exits
0 when the head says `Stop` (the head's drain) or it gets SIGTERM, and exits 1 if the
head goes away or one of its cores dies. A remote core's death is seen by the front end
as its connection closing (`connection.py`: zmq heartbeats close a silent connection,
so a host that vanished counts too). Not owned: the flags (`server/process_args.py`),
local processes (`launcher.py`), the messages between front end and core (`messages.py`).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket as pysocket
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec
import zmq

from jvllm.engine.core import messages as m
from jvllm.engine.core.connection import ConnectionWatch, with_heartbeat

logger = logging.getLogger("jvllm.engine_core")

# Milliseconds between checks while waiting on a socket.
POLL_MS = 100
# Seconds the head waits for a headless process to stop its cores.
STOP_WAIT_S = 10.0
# Seconds between the head's log lines while it waits for remote ranks.
WAITING_LOG_S = 30.0
# Seconds between the head's probes of a registered headless process whose cores start.
PROBE_S = 1.0


class Register(msgspec.Struct, tag="register"):
    start_rank: int
    size_local: int
    size: int
    hostname: str


class Welcome(msgspec.Struct, tag="welcome"):
    error: str | None = None
    loads_address: str | None = None  # the DP coordinator's, if the head runs one
    # Per registered rank: the head's addresses its core connects to, one per API server.
    frontends: list[list[str]] = []


class Ready(msgspec.Struct, tag="ready"):
    pids: list[int]


class Ping(msgspec.Struct, tag="ping"):
    """The head's probe of a registered process (sending fails once it is gone)."""


class Failed(msgspec.Struct, tag="failed"):
    reason: str


class Stop(msgspec.Struct, tag="stop"):
    pass


class Stopped(msgspec.Struct, tag="stopped"):
    pass


Handshake = Register | Welcome | Ready | Ping | Failed | Stop | Stopped
_decoder = msgspec.msgpack.Decoder(Handshake)


def decode_from(payload: bytes, sender: str) -> Any:
    """The handshake message in `payload`, or None (logged, naming `sender`) if it is not
    one: another program on the port must not stop the head."""
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as e:  # ValidationError too
        logger.warning("ignoring an undecodable message on the DP handshake from %s: %s", sender, e)
        return None


def _peer(frame: Any) -> str:
    """The address a received frame came from, as far as zmq tells."""
    try:
        return str(frame.get("Peer-Address"))
    except (zmq.ZMQError, ValueError, TypeError):
        return "an unknown peer"


def handshake_timeout() -> float:
    """Seconds a headless process waits for the head's answer (JVLLM_DP_HANDSHAKE_TIMEOUT_S,
    default 30)."""
    return float(os.environ.get("JVLLM_DP_HANDSHAKE_TIMEOUT_S", "30"))


def head_port(dp: Any, api_server_count: int, frontend: int | None, rank: int = 0) -> int:
    """The head's TCP port for remote rank `rank`'s core and API server `frontend` (None:
    the DP coordinator's, which takes the remote cores' loads). After the handshake's
    port P come API server 0's ports for the remote ranks in order, then API server 1's,
    ..., then the coordinator's: P+1 .. P+A*R+1 for A API servers and R remote ranks."""
    remote = dp.data_parallel_size - dp.local_size
    if frontend is None:
        return dp.rpc_port + 1 + api_server_count * remote
    return dp.rpc_port + 1 + frontend * remote + rank - dp.local_size


def check_head_ports(dp: Any, api_server_count: int, free: bool, coordinator: bool) -> None:
    """ValueError unless the head's ports P .. P+A*R+1 (`head_port`) are <= 65535 and,
    with `free`, those it will bind (the coordinator's with `coordinator`) are not in use
    on --data-parallel-address: checked before any core starts."""
    last = head_port(dp, api_server_count, None)
    if last > 65535:
        raise ValueError(
            f"--data-parallel-rpc-port {dp.rpc_port} is too high: the head listens on "
            f"ports {dp.rpc_port} .. {last} (the handshake, one per API server and remote "
            "rank, the DP coordinator), which must be <= 65535"
        )
    bound = range(dp.rpc_port, last + 1 if coordinator else last)
    taken = [port for port in bound if free and _in_use(dp, port)]
    if taken:
        raise ValueError(
            f"the head's ports {taken} on {dp.data_parallel_address} are in use: it listens "
            f"on {dp.rpc_port} .. {last} (--data-parallel-rpc-port and the ports after it)"
        )


def _in_use(dp: Any, port: int) -> bool:
    with pysocket.socket() as probe:
        probe.setsockopt(pysocket.SOL_SOCKET, pysocket.SO_REUSEADDR, 1)
        try:
            probe.bind((dp.data_parallel_address, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
            raise ValueError(
                f"cannot listen on --data-parallel-address {dp.data_parallel_address} ({e}): "
                "it must be this host's IP"
            ) from None
    return False


class _Claim(NamedTuple):
    """A registered headless process: its DP ranks and host."""

    ranks: list[int]
    hostname: str


class RemoteCores:
    """The head's side: takes the registrations of headless processes for ranks
    `local .. size-1`, tells each the head's ports its cores connect to, probes it until
    they are ready, and stops them on shutdown."""

    def __init__(self, dp: Any, api_server_count: int, loads_address: str | None) -> None:
        self._dp, self._api_servers, self._loads_address = dp, api_server_count, loads_address
        check_head_ports(dp, api_server_count, free=False, coordinator=True)
        self._context = zmq.Context()
        self._socket = with_heartbeat(self._context.socket(zmq.ROUTER))
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
        self._claims: dict[bytes, _Claim] = {}  # headless process -> its ranks and host
        self.pids: dict[int, int] = {}  # remote rank -> its core's pid, once ready
        logger.info(
            "waiting for DP ranks %s to register at %s", sorted(self._pending), dp.handshake_address
        )

    def address(self, frontend: int, rank: int) -> str:
        """Where API server `frontend` listens for remote rank `rank`'s core."""
        port = head_port(self._dp, self._api_servers, frontend, rank)
        return f"tcp://{self._dp.data_parallel_address}:{port}"

    def wait(self, local_dead: Callable[[], list[str]]) -> None:
        """Until every remote rank's core is ready; RuntimeError if a headless process
        reports a failure or goes away first (seen within PROBE_S, or the heartbeat's
        HEARTBEAT_TIMEOUT_MS for a host that vanished), or a local core dies meanwhile."""
        logged = probed = time.monotonic()
        remote = set(range(self._dp.local_size, self._dp.data_parallel_size))
        while len(self.pids) < len(remote):
            if self._socket.poll(POLL_MS):
                identity, message = self._receive()
                if message is not None:
                    self._on_message(identity, message)
            dead = local_dead()
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited while starting")
            if time.monotonic() - probed > PROBE_S:
                self._probe()
                probed = time.monotonic()
            if time.monotonic() - logged > WAITING_LOG_S:
                logger.info("still waiting for DP ranks %s", sorted(remote - set(self.pids)))
                logged = time.monotonic()
        logger.info("remote engine cores ready: pids %s", self.pids)

    def _probe(self) -> None:
        """RuntimeError naming the host of a registered process that went away before its
        cores were ready (a send to it fails once its connection closed)."""
        for identity, claim in self._claims.items():
            if claim.ranks[0] not in self.pids and not self._send(identity, Ping()):
                raise RuntimeError(
                    f"the headless process on {claim.hostname} (DP ranks {claim.ranks}) went "
                    "away before its engine cores were ready"
                )

    def _on_message(self, identity: bytes, message: Any) -> None:
        if isinstance(message, Register):
            self._register(identity, message)
        elif isinstance(message, Ready) and identity in self._claims:
            for rank, pid in zip(self._claims[identity].ranks, message.pids, strict=True):
                self.pids[rank] = pid
        elif isinstance(message, Failed):
            claim = self._claims.get(identity)
            host = f" on {claim.hostname}" if claim is not None else ""
            raise RuntimeError(f"headless engine cores{host} failed: {message.reason}")

    def _register(self, identity: bytes, message: Register) -> None:
        dp = self._dp
        ranks = list(range(message.start_rank, message.start_rank + message.size_local))
        error = None
        if message.size_local < 1:
            error = f"size_local={message.size_local}: a headless process runs at least 1 rank"
        elif message.size != dp.data_parallel_size:
            error = (
                f"data_parallel_size={message.size} differs from the head's {dp.data_parallel_size}"
            )
        elif not set(ranks) <= self._pending:
            error = (
                f"DP ranks {ranks} are not free: the head waits for ranks {sorted(self._pending)}"
            )
        if error is not None:
            self._send(identity, Welcome(error))
            return
        self._pending -= set(ranks)
        self._claims[identity] = _Claim(ranks, message.hostname)
        logger.info("headless engine cores on %s registered: ranks %s", message.hostname, ranks)
        frontends = [[self.address(i, r) for i in range(self._api_servers)] for r in ranks]
        self._send(identity, Welcome(None, self._loads_address, frontends))

    def _receive(self) -> tuple[bytes, Any]:
        """A waiting message and its sender's identity; the message None if it is not a
        handshake message (one frame) of ours."""
        identity, *frames = self._socket.recv_multipart(copy=False)
        sender = _peer(identity)
        if len(frames) != 1:
            logger.warning(
                "ignoring a %d-frame message on the DP handshake from %s", len(frames), sender
            )
            return identity.bytes, None
        return identity.bytes, decode_from(frames[0].bytes, sender)

    def _send(self, identity: bytes, message: msgspec.Struct) -> bool:
        try:
            self._socket.send_multipart([identity, m.encode(message)], flags=zmq.NOBLOCK)
        except zmq.Again:  # there, but not reading (its queue is full)
            return True
        except zmq.ZMQError:  # that process is gone
            return False
        return True

    def stop(self) -> None:
        """Tells every headless process to stop its cores; waits (STOP_WAIT_S) for them."""
        waiting = {identity for identity in self._claims if self._send(identity, Stop())}
        deadline = time.monotonic() + STOP_WAIT_S
        while waiting and time.monotonic() < deadline:
            if self._socket.poll(POLL_MS):
                identity, message = self._receive()
                if isinstance(message, Stopped):
                    waiting.discard(identity)
        if waiting:
            logger.warning("%d headless process(es) did not confirm their stop", len(waiting))
        self.close()

    def close(self) -> None:
        self._socket.close()
        self._context.term()


def run_headless(engine_args: Any, dp: Any) -> int:
    """A `--headless` process: registers with the head, runs its cores (connected out to
    the head's ports) until told to stop; its exit status (0: stopped by the head or
    SIGTERM)."""
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
        procs = EngineCoreProcs(
            engine_args,
            dp.local_size,
            welcome.loads_address,
            dp.start_rank,
            frontend_addresses=welcome.frontends,
        )
        told = threading.Event()  # the head said Stop while the cores started
        failure = procs.wait_ready(lambda: _startup_failure(head, watch, stopping, told))
        if failure is not None:
            if told.is_set():  # the head drains: as if told once serving
                procs.stop()
                head.send(m.encode(Stopped()))
                logger.info("%s", failure)
                return 0
            head.send(m.encode(Failed(failure)))
            logger.error("%s", failure)
            return 0 if stopping.is_set() else 1
        head.send(m.encode(Ready(procs.pids)))
        logger.info(
            "engine cores of DP ranks %s (pids %s) serving the head at %s",
            list(procs.ranks),
            procs.pids,
            dp.data_parallel_address,
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
    welcome = decode_from(head.recv(), dp.handshake_address)
    if not isinstance(welcome, Welcome):
        raise RuntimeError(f"the head answered {welcome!r} to a registration")
    if welcome.error is not None:
        raise ValueError(f"the head at {dp.handshake_address} refused these ranks: {welcome.error}")
    return welcome


def _startup_failure(
    head: Any, watch: ConnectionWatch, stopping: threading.Event, told: threading.Event
) -> str | None:
    """Why the cores' start is cut short (None: it goes on); reads the head's messages
    meanwhile (its probes, or a Stop: then sets `told`)."""
    while head.poll(0):
        if isinstance(decode_from(head.recv(), "the head"), Stop):
            told.set()
    if told.is_set():
        return "the head said stop while the engine cores started: stopping them"
    if watch.lost() or stopping.is_set():
        return "stopped while the engine cores started (the head went away, or a signal)"
    return None


def _serve(
    head: Any, watch: ConnectionWatch, procs: Any, stopping: threading.Event, address: str
) -> int:
    while not stopping.is_set():
        if head.poll(POLL_MS * 5) and isinstance(decode_from(head.recv(), address), Stop):
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
        self._remote_ranks = sorted(remote.pids)
        self.pids = local.pids + [remote.pids[r] for r in self._remote_ranks]

    def addresses_for(self, frontend: int) -> list[str]:
        """The addresses API server `frontend` binds, one per core, in DP-rank order."""
        remote = [self._remote.address(frontend, rank) for rank in self._remote_ranks]
        return self._local.addresses_for(frontend) + remote

    def dead(self) -> list[str]:
        """This host's cores that exited (a remote core's death is its front ends' to see)."""
        return self._local.dead()

    def stop(self) -> None:
        self._remote.stop()
        self._local.stop()
