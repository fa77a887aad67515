"""Multi-host serving: the leader's step programs, replayed by the follower processes.

`jvllm serve` on P processes joined by `jax.distributed`: process 0 (the leader) runs
HTTP, the scheduler and the engine; the others (followers) serve nothing and run the
same jitted programs on their devices, so every collective inside a step meets its
peers. Each device program the leader's `ModelRunner` launches with host inputs (a
forward with its packed int32 buffer, a sampling with its arrays, a block copy, a
proposal) is one `StepMessage`, written to the coordination service's key-value store
(the one `jax.distributed` already runs in process 0) under consecutive keys; a
follower reads them in order and launches the same program with the same inputs.

Encoding: a length-prefixed JSON header (operation, static ints, each array's name,
dtype and shape) followed by the arrays' raw bytes. No pickle: a message is data.

Liveness: every process bumps a counter key twice a second; each watches the others'
and calls its `on_lost` callback when one stops moving for `timeout` seconds, or the
store itself stops answering (process 0, which hosts it, died). The leader then fails
its requests, answers 503 on /health and exits non-zero; a follower exits.

The store is reached through `jax._src.distributed.global_state.client`, the client
`jax.distributed.initialize` creates (JAX has no public handle for it).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger("jvllm")

PREFIX = "jvllm"
# Messages kept in the store behind the newest: followers run at most a few steps
# behind the leader (each step's collectives wait for them), far fewer than this.
KEEP_MESSAGES = 1024
HEARTBEAT_PERIOD_S = 0.5
DEFAULT_LIVENESS_TIMEOUT_S = 5.0
# How long one blocking read waits before the reader checks that its peers live.
POLL_MS = 1000


def coordination_client() -> Any:
    """The `jax.distributed` client of this process (key-value store and barriers)."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialised in this process")
    return client


@dataclass(frozen=True)
class StepMessage:
    """One device program of the leader: `op`, its static ints, its host arrays."""

    op: str
    statics: Mapping[str, int] = field(default_factory=dict)
    arrays: Mapping[str, np.ndarray] = field(default_factory=dict)

    def encode(self) -> bytes:
        arrays = {k: np.ascontiguousarray(v) for k, v in self.arrays.items()}
        header = {
            "op": self.op,
            "statics": dict(self.statics),
            "arrays": [[k, a.dtype.str, list(a.shape)] for k, a in arrays.items()],
        }
        head = json.dumps(header).encode()
        payload = [a.tobytes() for a in arrays.values()]
        return b"".join([struct.pack("<I", len(head)), head, *payload])

    @classmethod
    def decode(cls, data: bytes) -> StepMessage:
        (length,) = struct.unpack_from("<I", data)
        header = json.loads(data[4 : 4 + length])
        offset, arrays = 4 + length, {}
        for name, dtype, shape in header["arrays"]:
            dt = np.dtype(dtype)
            n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            arrays[name] = np.frombuffer(data, dt, count=n // dt.itemsize, offset=offset).reshape(
                shape
            )
            offset += n
        if offset != len(data):
            raise ValueError(f"step message {header['op']!r}: {len(data) - offset} stray bytes")
        return cls(header["op"], header["statics"], arrays)


STOP = StepMessage("stop")


class StepPublisher:
    """The leader's side: `publish(message)` in program order. The caller only encodes;
    a thread of its own writes to the store (about 0.3 ms a message on localhost), so
    the engine goes on to launch the program and prepare the next step meanwhile."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.sequence = 0
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="jvllm-publisher", daemon=True)
        self._thread.start()

    def publish(self, message: StepMessage) -> None:
        self._queue.put(message.encode())

    def close(self, timeout: float = 30.0) -> None:
        """Writes what is queued, then stops the thread."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            try:
                self.client.key_value_set_bytes(f"{PREFIX}/step/{self.sequence}", data)
                stale = self.sequence - KEEP_MESSAGES
                if stale >= 0:
                    self.client.key_value_delete(f"{PREFIX}/step/{stale}")
            except Exception as e:  # the store is gone: the liveness watch reports it
                logger.error("multi-host: cannot publish step message %d: %s", self.sequence, e)
                return
            self.sequence += 1


class StepSubscriber:
    """A follower's side: `receive()` blocks for the leader's next message; raises
    `PeerLost` when `alive()` says the leader is gone while it waits."""

    def __init__(self, client: Any, alive: Callable[[], bool]) -> None:
        self.client = client
        self.alive = alive
        self.sequence = 0

    def receive(self) -> StepMessage:
        key = f"{PREFIX}/step/{self.sequence}"
        while True:
            try:
                data = self.client.blocking_key_value_get_bytes(key, POLL_MS)
                break
            except Exception as e:  # a timeout, or the store is gone with process 0
                if "DEADLINE_EXCEEDED" not in str(e) or not self.alive():
                    raise PeerLost(f"the leader (process 0) is gone: {e}") from None
        self.sequence += 1
        return StepMessage.decode(data)


class PeerLost(RuntimeError):
    pass


class Liveness:
    """Heartbeats for this process and a watch on the others' (a daemon thread). A
    peer is timed from its first heartbeat seen; `on_lost` may be replaced while it
    runs (start-up, then serving)."""

    def __init__(
        self,
        client: Any,
        process_id: int,
        num_processes: int,
        on_lost: Callable[[str], None],
        timeout: float = DEFAULT_LIVENESS_TIMEOUT_S,
    ) -> None:
        self.client, self.process_id = client, process_id
        self.peers = [p for p in range(num_processes) if p != process_id]
        self.on_lost, self.timeout = on_lost, timeout
        self.lost: str | None = None
        self._beats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jvllm-liveness", daemon=True)

    def start(self) -> Liveness:
        self._beat()
        self._thread.start()
        # At exit, before JAX's own handler (registered earlier, run later) shuts the
        # coordination service down: a beat after that is no lost peer.
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        """Ends the heartbeats and the watch; waits for a beat in progress."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * HEARTBEAT_PERIOD_S)

    def alive(self) -> bool:
        return self.lost is None

    def _beat(self) -> None:
        self._beats += 1
        self.client.key_value_set(
            f"{PREFIX}/alive/{self.process_id}", str(self._beats), allow_overwrite=True
        )

    def _run(self) -> None:
        seen: dict[int, tuple[str | None, float]] = {}
        while not self._stop.wait(HEARTBEAT_PERIOD_S):
            try:
                self._beat()
                values = {peer: self._read(peer) for peer in self.peers}
            except Exception as e:
                if not self._stop.is_set():  # stopped: the service may be going away
                    self._lose(f"the coordination service stopped answering ({e})")
                return
            now = time.monotonic()
            for peer, value in values.items():
                last = seen.get(peer)
                if last is None or last[0] != value:
                    seen[peer] = (value, now)
                elif now - last[1] > self.timeout:
                    self._lose(f"process {peer} sent no heartbeat for {self.timeout:g} s")
                    return

    def _read(self, peer: int) -> str | None:
        try:
            return self.client.key_value_try_get(f"{PREFIX}/alive/{peer}")
        except Exception as e:
            if "NOT_FOUND" in str(e):  # not started yet: its silence is timed from now
                return None
            raise

    def _lose(self, reason: str) -> None:
        self.lost = reason
        logger.error("multi-host: %s", reason)
        self.on_lost(reason)


_liveness: Liveness | None = None


def exit_on_loss(reason: str) -> None:
    """The default reaction to a lost peer: nothing this process runs can complete."""
    logging.shutdown()
    os._exit(1)


def start_liveness(process_id: int, num_processes: int) -> Liveness:
    """Starts (once) this process's heartbeats and its watch on the others; until a
    caller sets `on_lost`, a lost peer ends the process."""
    global _liveness
    if _liveness is None:
        client = coordination_client()
        _liveness = Liveness(client, process_id, num_processes, exit_on_loss).start()
    return _liveness


def current_liveness() -> Liveness | None:
    return _liveness


def start_fingerprint(engine_args: Mapping[str, Any], model_dir: str) -> dict[str, Any]:
    """What every process must agree on: the engine arguments (but where each process
    is and which it is) and the checkpoint's config and weight files (names and sizes:
    hosts may mount it at different paths)."""
    skip = {"model", "tokenizer", "process_id", "coordinator_address", "compilation_cache_dir"}
    args = {k: v for k, v in engine_args.items() if k not in skip}
    root = Path(model_dir)
    config = root / "config.json"
    digest = hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None
    files = sorted(
        (str(p.relative_to(root)), p.stat().st_size)
        for p in root.rglob("*")
        if p.is_file() and p.suffix in (".safetensors", ".json")
    )
    return {
        "engine_args": json.loads(json.dumps(args, default=str)),
        "config": digest,
        "files": [list(f) for f in files],
    }


def agree_on_start(
    client: Any,
    process_id: int,
    num_processes: int,
    fingerprint: dict[str, Any],
    num_blocks: int,
    timeout_s: float = 600.0,
) -> int:
    """Checks that every process was started alike (ValueError naming the first
    difference from process 0) and returns the KV block count all can hold (the least)."""
    mine = {"fingerprint": fingerprint, "num_blocks": num_blocks}
    client.key_value_set(f"{PREFIX}/start/{process_id}", json.dumps(mine))
    starts = {}
    for p in range(num_processes):
        raw = client.blocking_key_value_get(f"{PREFIX}/start/{p}", int(timeout_s * 1000))
        starts[p] = json.loads(raw)
    leader = starts[0]["fingerprint"]
    for p, start in starts.items():
        difference = _first_difference(leader, start["fingerprint"])
        if difference is not None:
            what, ours, theirs = difference
            raise ValueError(
                f"multi-host start-up: process {p} and process 0 disagree on {what}: "
                f"{theirs!r} against {ours!r}; start every process with the same model and flags"
            )
    return min(start["num_blocks"] for start in starts.values())


def _first_difference(a: Any, b: Any, where: str = "") -> tuple[str, Any, Any] | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            found = _first_difference(a.get(key), b.get(key), f"{where}.{key}" if where else key)
            if found is not None:
                return found
        return None
    return None if a == b else (where, a, b)
