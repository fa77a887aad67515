"""Disaggregated prefill's transfer: KV blocks from a prefill server to a decode server
over a local TCP socket.

Owns the wire and both ends. `SocketSender` (the producer's connector) sends each
block as the block-file header (magic, key, layout digest, length, CRC-32) followed
by its raw bytes, and waits for a one-byte acknowledgement; no pickle. `BlockReceiver`
(the consumer's) accepts connections on a thread, checks every frame against its own
layout digest and size, keeps intact blocks in a `MemoryBlockStore` and announces
their keys, so the consumer's engine finds them as lower-tier hits and reads them into
its host tier. On a GPU cluster the same `KVConnectorBase` would be NIXL (RDMA between
the devices, no host copy), LMCache or Mooncake.
"""

from __future__ import annotations

import socket
import threading
from collections import OrderedDict
from collections.abc import Callable

from jvllm.kv_offload.connector import KVConnectorBase
from jvllm.kv_offload.fs_store import HEADER, checked_key, frame_header

ACK, NACK = b"\x01", b"\x00"
CONNECT_TIMEOUT_S = 5.0


class SocketSender(KVConnectorBase):
    """Send-only: `save_block` delivers a block to the consumer (OSError when it cannot)."""

    def __init__(self, host: str, port: int, fingerprint: bytes) -> None:
        self.address = (host, port)
        self.fingerprint = fingerprint
        self._sock: socket.socket | None = None

    def lookup(self, key: str) -> bool:
        return False

    def load_block(self, key: str, num_bytes: int) -> bytes | None:
        return None

    def delete_block(self, key: str) -> None:
        pass  # the consumer bounds what it keeps

    def save_block(self, key: str, payload: bytes | memoryview) -> None:
        try:
            if self._sock is None:
                self._sock = socket.create_connection(self.address, CONNECT_TIMEOUT_S)
            self._sock.sendall(frame_header(key, self.fingerprint, payload))
            self._sock.sendall(payload)
            if _read_exactly(self._sock, 1) != ACK:
                raise OSError(f"the KV consumer at {self.address} refused block {key}")
        except OSError:
            self.close()
            raise

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class MemoryBlockStore(KVConnectorBase):
    """Blocks received from a producer, in host memory (bounded by the engine's tier)."""

    def __init__(self) -> None:
        self._blocks: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def lookup(self, key: str) -> bool:
        with self._lock:
            return key in self._blocks

    def save_block(self, key: str, payload: bytes | memoryview) -> None:
        with self._lock:
            self._blocks[key] = bytes(payload)

    def load_block(self, key: str, num_bytes: int) -> bytes | None:
        with self._lock:
            payload = self._blocks.get(key)
        return payload if payload is not None and len(payload) == num_bytes else None

    def delete_block(self, key: str) -> None:
        with self._lock:
            self._blocks.pop(key, None)


class BlockReceiver:
    def __init__(
        self,
        host: str,
        port: int,
        fingerprint: bytes,
        block_bytes: int,
        store: KVConnectorBase,
        announce: Callable[[str], None],
    ) -> None:
        """Listens on (host, port); each intact block goes into `store`, then
        `announce(key)`, then its acknowledgement."""
        self.fingerprint = fingerprint
        self.block_bytes = block_bytes
        self.store = store
        self._announce = announce
        self._server = socket.create_server((host, port))
        self.port = self._server.getsockname()[1]
        self.num_received_blocks = 0
        self.num_rejected_blocks = 0
        threading.Thread(target=self._accept_loop, name="jvllm-kv-recv", daemon=True).start()

    def close(self) -> None:
        self._server.close()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                header = _read_exactly(conn, HEADER.size)
                if len(header) < HEADER.size:
                    return  # the producer hung up
                length = HEADER.unpack(header)[3]
                if length != self.block_bytes:
                    self.num_rejected_blocks += 1
                    conn.sendall(NACK)
                    return  # another layout: the stream cannot be followed
                payload = _read_exactly(conn, length)
                key = checked_key(header, payload, self.fingerprint, self.block_bytes)
                if key is None:
                    self.num_rejected_blocks += 1
                    conn.sendall(NACK)
                    continue
                self.store.save_block(key, payload)
                self._announce(key)
                self.num_received_blocks += 1
                conn.sendall(ACK)


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    """n bytes, or fewer when the peer closed first."""
    chunks, size = [], 0
    while size < n:
        try:
            chunk = conn.recv(min(n - size, 1 << 20))
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)
