"""DiskPrefixTier: which prefix blocks the file-system tier holds, and reading them ahead.

Owns the engine's view of the tier below the host tier (vLLM's tiered offloading, an
`fs` secondary tier): the keys of the block files present in LRU order and bounded in
number, the keys being written (not yet hits) and being read, and the work it asks of
the runner's IO threads each step (`KVIOOps`). Every block the device evicts into the
host tier is also saved to a file; a waiting request whose next blocks miss the
device and the host tier but are on disk has them read into host-tier blocks first
and waits in the scheduler (others go ahead) until they are there, then hits them
in the host tier. A block's key is a digest of the model layout, its chained block
hash and its tokens, so another process or a restart of the same model finds it.
It touches no file: the runner side (`jvllm.kv_offload`) does the IO.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import NamedTuple

import numpy as np

from jvllm.engine.kv.block_pool import BlockPool, CachedBlock
from jvllm.engine.kv.host_tier import HostEntry, HostPrefixTier
from jvllm.engine.kv.prefix import CachedPrefix, root_content_id
from jvllm.engine.step_io import KVIODone, KVIOOps

# Requests remembered as having had their one read-ahead (a bound, not a policy).
MAX_TRIED = 65536


class _Load(NamedTuple):
    host_block: int
    block_hash: int
    parent_content_id: int
    token_ids: tuple[int, ...]
    content_id: int


class DiskPrefixTier:
    def __init__(
        self,
        fingerprint: bytes,
        max_blocks: int,
        present: Iterable[str],
        host_tier: HostPrefixTier,
        block_pool: BlockPool,
        role: str = "kv_both",
        poll: Callable[[], list[KVIODone]] | None = None,
    ) -> None:
        """`present`: keys of the files found at start, least recently used first.
        `role`: "kv_both" (save what the device evicts, read ahead), "kv_producer"
        (send every finished request's blocks; no reads) or "kv_consumer" (read ahead
        what a producer sent). `poll` gives what finished since (for fresh lookups)."""
        if max_blocks < 1:
            raise ValueError(f"the fs KV tier must hold at least one block, got {max_blocks}")
        self._fingerprint = fingerprint
        self.max_blocks = max_blocks
        self._host = host_tier
        self._pool = block_pool
        self._ready: OrderedDict[str, None] = OrderedDict.fromkeys(present)
        self._writing: set[str] = set()
        self._loading: dict[str, _Load] = {}
        self._waiting: dict[str, list[str]] = {}  # request id -> keys it waits for
        self._tried: set[str] = set()
        self._ops = KVIOOps()
        self.role = role
        self._poll = poll
        self._pushing: dict[str, int] = {}  # key -> the host block it is sent from
        self._stale: set[str] = set()  # reads and writes begun before new weights
        self.num_written_blocks = 0
        self.num_read_blocks = 0  # read back into the host tier
        self.num_failed_reads = 0  # missing, torn or altered files: misses
        self._evict()

    @property
    def num_blocks(self) -> int:
        return len(self._ready)

    def key(self, block_hash: int, token_ids: tuple[int, ...]) -> str:
        digest = hashlib.sha256(self._fingerprint)
        digest.update(struct.pack("<q", block_hash))
        digest.update(np.asarray(token_ids, np.int64).tobytes())
        return digest.hexdigest()

    def take_ops(self) -> KVIOOps:
        ops, self._ops = self._ops, KVIOOps()
        return ops

    def new_weights(self) -> None:
        """The model's weights changed: blocks saved or being read so far hold K/V of
        the old ones: their files are deleted, and from now on keys differ."""
        self._fingerprint = hashlib.sha256(self._fingerprint + b"new weights").digest()
        self._stale |= set(self._loading) | self._writing
        self._ops.deletes += [key for key in self._ready if key not in self._loading]
        self._ready.clear()
        self._waiting.clear()
        self._tried.clear()

    @property
    def busy(self) -> bool:
        """Whether a producer still has blocks to send (the engine keeps stepping)."""
        return bool(self._pushing)

    def refresh(self) -> None:
        """Takes what finished since the last step into account (blocks just received)."""
        if self._poll is not None:
            self.complete(self._poll())

    def push(self, table: list[int], content_ids: list[int]) -> list[tuple[int, int]]:
        """A producer's request is done with its blocks: its cached full blocks not sent
        lately go to host blocks (the (device, host) copies returned) and are sent."""
        if self.role != "kv_producer":
            return []
        pairs = []
        for block, content_id in zip(table, content_ids, strict=False):
            cached = self._pool.cached_block(block)
            if cached is None or cached.content_id != content_id:
                continue
            key = self.key(cached.block_hash, cached.token_ids)
            if key in self._ready or key in self._pushing:
                continue
            host_block = self._host.reserve(set())
            if host_block is None:
                break
            self._pushing[key] = host_block
            self._ops.writes.append((host_block, key))
            pairs.append((block, host_block))
        return pairs

    def save(self, cached: CachedBlock, host_block: int) -> None:
        """The device evicted `cached` into `host_block`: keep it on disk too."""
        if self.role != "kv_both":
            return
        key = self.key(cached.block_hash, cached.token_ids)
        if key in self._ready:
            self._ready.move_to_end(key)
        elif key not in self._writing:
            self._writing.add(key)
            self._ops.writes.append((host_block, key))

    def forget(self, request_id: str) -> None:
        """A request that ends (finished or aborted) waits for nothing any more."""
        self._waiting.pop(request_id, None)

    def still_waiting(self, request_id: str) -> bool | None:
        """Whether the request still waits for blocks read ahead for it; None when it
        has had no read-ahead yet (then `read_ahead` decides)."""
        if self.role == "kv_producer":
            return False
        keys = self._waiting.get(request_id)
        if keys is not None:
            if any(key in self._loading for key in keys):
                return True
            del self._waiting[request_id]
            return False
        return False if request_id in self._tried else None

    def read_ahead(
        self,
        request_id: str,
        prefix: CachedPrefix,
        block_keys: Iterable[tuple[int, tuple[int, ...]]],
    ) -> bool:
        """Asks for the request's blocks past `prefix` (what the device and the host tier
        hold) that are on disk, up to the first that is not, to be read into the host
        tier; whether any was (then the request waits). `block_keys` gives each next
        full block's (chained hash, tokens). A request gets one read-ahead."""
        if len(self._tried) >= MAX_TRIED:
            self._tried.clear()
        self._tried.add(request_id)
        keep = {entry.host_block for entry in prefix.host_hits.values()}
        parent = prefix.content_ids[-1] if prefix.content_ids else root_content_id(0)
        keys = []
        for block_hash, tokens in block_keys:
            key = self.key(block_hash, tokens)
            load = self._loading.get(key)
            if load is None:
                load = self._read(key, block_hash, parent, tokens, keep)
                if load is None:
                    break
            keys.append(key)
            parent = load.content_id
        if keys:
            self._waiting[request_id] = keys
        return bool(keys)

    def _read(
        self, key: str, block_hash: int, parent: int, tokens: tuple[int, ...], keep: set[int]
    ) -> _Load | None:
        if key not in self._ready:
            return None
        host_block = self._host.reserve(keep)
        if host_block is None:
            return None
        self._ready.move_to_end(key)
        load = _Load(host_block, block_hash, parent, tokens, self._pool.new_content_id())
        self._loading[key] = load
        self._ops.reads.append((key, host_block))
        return load

    def complete(self, done: Iterable[KVIODone]) -> None:
        """Takes the runner's finished reads and writes into account."""
        for key, is_read, ok in done:
            stale = key in self._stale  # begun before new weights: its file goes
            self._stale.discard(key)
            if stale and ok:
                self._ops.deletes.append(key)
            if is_read:
                load = self._loading.pop(key)
                if ok and not stale:
                    entry = HostEntry(
                        load.host_block, load.parent_content_id, load.token_ids, load.content_id
                    )
                    self._host.publish(load.block_hash, entry)
                    self.num_read_blocks += 1
                else:
                    self._host.unreserve(load.host_block)
                    self._ready.pop(key, None)
                    self.num_failed_reads += not ok
                continue
            self._writing.discard(key)
            if key in self._pushing:
                self._host.unreserve(self._pushing.pop(key))
            if ok and not stale:
                self._ready[key] = None
                self.num_written_blocks += 1
        self._evict()

    def _evict(self) -> None:
        """Deletes least recently used files beyond the bound (never one being read)."""
        excess = len(self._ready) - self.max_blocks
        if excess <= 0:
            return
        victims = [key for key in self._ready if key not in self._loading][:excess]
        for key in victims:
            del self._ready[key]
            self._ops.deletes.append(key)
