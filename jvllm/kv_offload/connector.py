"""KVConnectorBase: what a place that holds KV blocks by key offers the engine.

Owns the interface only. A block is named by its prefix content key (hex text) and
carried as raw bytes: every layer's K then V rows of one block, the host layout's.
The file-system tier (`FsBlockStore`) implements it; so would a transfer to another
instance (a socket between two processes on one machine) or, on a GPU cluster, NIXL
(device-to-device RDMA), LMCache or Mooncake, which move the same keyed blocks
between instances and storage without the host copy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class KVConnectorBase(ABC):
    @abstractmethod
    def lookup(self, key: str) -> bool:
        """Whether the block is held (a hint: `load_block` may still miss)."""

    @abstractmethod
    def save_block(self, key: str, payload: bytes | memoryview) -> None:
        """Stores one block's bytes under `key` (atomically: whole or not at all)."""

    @abstractmethod
    def load_block(self, key: str, num_bytes: int) -> bytes | None:
        """The block's `num_bytes` bytes, or None when it is missing or not intact."""

    @abstractmethod
    def delete_block(self, key: str) -> None:
        """Forgets the block (no error when it is not held)."""
