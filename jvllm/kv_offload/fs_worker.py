"""FsKVWorker: the runner side of the file-system KV tier, off the step.

Owns two threads and their queues: a writer (block files saved and deleted, in the
order asked) and a reader (files read into host blocks of the host tier). The engine
decides what moves (`jvllm.engine.kv.disk_tier`); this moves it and reports what
finished. A write names a host block whose content this step's swap-outs produce: its
bytes are copied out at the next `submit` (after those swap-outs have landed, and
before any later step's swap-outs or reads can reuse the block). The writer's queue is
bounded: a write that does not fit is dropped (reported not ok), so the step never
waits on the disk. It owns no host memory: `host_caches` is the runner's pool.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from jvllm.engine.step_io import KVIODone, KVIOOps
from jvllm.kv_offload.connector import KVConnectorBase

HostCaches = list[tuple[np.ndarray, np.ndarray]]
WRITE_QUEUE_BLOCKS = 256


class FsKVWorker:
    def __init__(
        self,
        store: KVConnectorBase,
        host_caches: HostCaches,
        block_axis: int,
        settle: Callable[[], None],
    ) -> None:
        """`host_caches[i]` is layer i's (K, V) host pool whose axis `block_axis` is the
        host block; `settle()` lands every swap-out queued so far in it."""
        self.store = store
        self._caches = host_caches
        self._axis = block_axis
        self._settle = settle
        self.block_bytes = sum(self._row(a, 1).nbytes for kv in host_caches for a in kv)
        self._deferred: list[tuple[int, str]] = []  # writes whose bytes land next submit
        self._writes: queue.Queue[tuple[str, Any] | None] = queue.Queue(WRITE_QUEUE_BLOCKS)
        self._reads: queue.Queue[tuple[str, int] | None] = queue.Queue()
        self._done: deque[KVIODone] = deque()
        self.receiver: Any = None  # a transfer's receiving end, when this is a consumer
        self._threads = [
            threading.Thread(target=self._write_loop, name="jvllm-kv-write", daemon=True),
            threading.Thread(target=self._read_loop, name="jvllm-kv-read", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _row(self, array: np.ndarray, block: int) -> np.ndarray:
        return array[(slice(None),) * self._axis + (block,)]

    def submit(self, ops: KVIOOps) -> list[KVIODone]:
        """Queues the step's work (called before its swaps); what finished since."""
        if self._deferred or ops.reads:
            self._settle()  # the blocks to save hold their bytes; no stale write lands later
        self._queue_deferred()
        self._deferred = list(ops.writes)
        for key in ops.deletes:
            self._put_write(("delete", key), key)
        for read in ops.reads:
            self._reads.put(read)
        return self.poll()

    def announce(self, key: str) -> None:
        """A block another process put in the store (a transfer's receiver): a new hit."""
        self._done.append(KVIODone(key, False, True))

    def poll(self) -> list[KVIODone]:
        done = []
        while self._done:
            done.append(self._done.popleft())
        return done

    def drain(self) -> list[KVIODone]:
        """Saves every write asked so far and waits for both queues; what finished."""
        self._settle()
        self._queue_deferred()
        self._deferred = []
        self._writes.join()
        self._reads.join()
        return self.poll()

    def _queue_deferred(self) -> None:
        for block, key in self._deferred:
            payload = b"".join(self._row(a, block).tobytes() for kv in self._caches for a in kv)
            self._put_write(("save", (key, payload)), key)

    def _put_write(self, item: tuple[str, Any], key: str) -> None:
        try:
            self._writes.put_nowait(item)
        except queue.Full:
            if item[0] == "save":
                self._done.append(KVIODone(key, False, False))

    def _write_loop(self) -> None:
        while True:
            kind, arg = self._writes.get()
            try:
                if kind == "delete":
                    self.store.delete_block(arg)
                    continue
                key, payload = arg
                try:
                    self.store.save_block(key, payload)
                    ok = True
                except OSError:
                    ok = False  # a full or failing disk: the block is just not kept
                self._done.append(KVIODone(key, False, ok))
            finally:
                self._writes.task_done()

    def _read_loop(self) -> None:
        while True:
            key, block = self._reads.get()
            try:
                payload = self.store.load_block(key, self.block_bytes)
                if payload is not None:
                    self._fill(block, payload)
                self._done.append(KVIODone(key, True, payload is not None))
            finally:
                self._reads.task_done()

    def _fill(self, block: int, payload: bytes) -> None:
        """Writes a block's bytes into host block `block` of every layer."""
        offset = 0
        for kv in self._caches:
            for array in kv:
                row = self._row(array, block)
                count = row.size
                values = np.frombuffer(payload, array.dtype, count, offset)
                row[...] = values.reshape(row.shape)
                offset += row.nbytes
