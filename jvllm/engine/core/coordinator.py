"""DPCoordinator: one view of every data-parallel engine core's load, shared by all API
servers (vLLM's `DPCoordinator`), so that each balances on the same counts.

Owns the relay: each engine core pushes its `EngineLoad` (waiting and running counted in
sequences, as its scheduler holds them: a request with n choices counts n; and the
requests it has taken so far) whenever it changes (`core.py`); the coordinator, a thread
of the supervising process, keeps the latest of each and publishes the whole `LoadTable`
to every API server when something changed, and every `HEARTBEAT_S` seconds for a
subscriber that joined late. The API server's side, `LoadView`, reads the newest table
without waiting (`client.py` adds the sequences of its own requests the table does not
show yet). Used with several API
servers and several cores; one API server already sees every request it balances. Not
owned: choosing a core (`client.py`), the processes (`launcher.py`, `server/split.py`).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
import time
from typing import Any

import msgspec
import zmq

from jvllm.engine.core import messages as m

# Seconds between publications of an unchanged table (for subscribers that joined late).
HEARTBEAT_S = 1.0
# Milliseconds between checks for a stop while nothing arrives.
POLL_MS = 100


class DPCoordinator:
    """The coordinator thread; cores push to `input_address`, API servers subscribe to
    `output_address`."""

    def __init__(self, num_engines: int, remote_input_address: str | None = None) -> None:
        """`remote_input_address`: also take loads there (tcp://IP:PORT), from cores on
        other hosts."""
        self._dir = tempfile.mkdtemp(prefix="jvllm-coordinator-")
        self.input_address = f"ipc://{self._dir}/loads_in"
        self.output_address = f"ipc://{self._dir}/loads_out"
        self._context = zmq.Context()
        self._pull = self._context.socket(zmq.PULL)
        self._pub = self._context.socket(zmq.PUB)
        for socket in (self._pull, self._pub):
            socket.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self.input_address)
        self._pub.bind(self.output_address)
        self.remote_input_address = remote_input_address
        if remote_input_address is not None:
            try:
                self._pull.bind(remote_input_address)
            except zmq.ZMQError as e:
                self._close()
                raise ValueError(
                    f"the DP coordinator cannot listen on {remote_input_address} ({e})"
                ) from None
        self._table = m.LoadTable([None] * num_engines)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jvllm-dp-coordinator", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        decode = m.decoder(m.EngineLoad).decode
        published = 0.0
        while not self._stop.is_set():
            heard = self._pull.poll(POLL_MS)
            if not heard and time.monotonic() - published < HEARTBEAT_S:
                continue
            while heard:  # every load waiting, then one publication
                try:
                    load = decode(self._pull.recv(flags=zmq.NOBLOCK))
                except zmq.Again:
                    break
                if 0 <= load.engine_index < len(self._table.engines):
                    self._table.engines[load.engine_index] = load
            self._pub.send(m.encode(self._table))  # news, or the heartbeat
            published = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._close()

    def _close(self) -> None:
        self._pull.close()
        self._pub.close()
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)


class LoadView:
    """An API server's subscription to the coordinator: `latest()` is the newest table
    published (None before the first), read without blocking."""

    def __init__(self, context: Any, address: str) -> None:
        self._socket = context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(address)
        self._decode = m.decoder(m.LoadTable).decode
        self._table: m.LoadTable | None = None

    def latest(self) -> m.LoadTable | None:
        while True:
            try:
                payload = self._socket.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return self._table
            with contextlib.suppress(msgspec.DecodeError):
                self._table = self._decode(payload)

    def close(self) -> None:
        self._socket.close()


class LoadPusher:
    """An engine core's side: pushes its load when it changed (never blocks: a load the
    coordinator cannot take now goes with the next push, which an idle core makes every
    `core.PARENT_CHECK_S`, so that its row does not stay stale)."""

    def __init__(self, context: Any, address: str, engine_index: int) -> None:
        self._socket = context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 64)
        self._socket.connect(address)
        self._index = engine_index
        self._last: tuple[int, int, int] | None = None

    def push(self, waiting: int, running: int, num_added: int) -> None:
        if (waiting, running, num_added) == self._last:
            return
        load = m.EngineLoad(self._index, waiting, running, num_added)
        with contextlib.suppress(zmq.Again):  # not connected yet, or full: sent next time
            self._socket.send(m.encode(load), flags=zmq.NOBLOCK)
            self._last = (waiting, running, num_added)

    def close(self) -> None:
        self._socket.close()
