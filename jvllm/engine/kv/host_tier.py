"""HostPrefixTier: full prefix-cache blocks evicted from the device, kept in host memory.

Owns which host blocks of the prefix tier (vLLM V1's `kv_offloading_size`) hold which
evicted content, their LRU order, and the lookup that mirrors the device cache's: an
entry is found by its block hash and only returned when its parent content id and
tokens match (a hash collision costs a hit, never wrong K/V). It decides nothing about
copies: the KV cache manager asks for a host block when the device pool evicts a
cached block (the runner copies it out before the step writes the block again), and
takes an entry back when a prefix lookup hits it (copied in before the step's forward).

A host block taken back this step is released only at `end_step()`: the runner reads
it during the step, so no eviction in the same `schedule()` may reuse it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple


class HostEntry(NamedTuple):
    host_block: int
    parent_content_id: int
    token_ids: tuple[int, ...]
    content_id: int  # the device registration's, kept so children still chain to it


class HostPrefixTier:
    def __init__(self, host_block_ids: range) -> None:
        self.num_blocks = len(host_block_ids)
        self._free: list[int] = list(reversed(host_block_ids))
        self._entries: OrderedDict[int, HostEntry] = OrderedDict()  # hash -> entry, LRU first
        self._releasing: list[int] = []
        self._reserved: set[int] = set()  # being read from a lower tier
        self._fresh: set[int] = set()  # stored this step (their copy-out is still queued)

    @property
    def num_used_blocks(self) -> int:
        return len(self._entries)

    def store(
        self,
        block_hash: int,
        parent_content_id: int,
        token_ids: tuple[int, ...],
        content_id: int,
    ) -> int | None:
        """A host block to copy an evicted block into, evicting the least recently used
        entry when full; None when the content is there already or no block can be had."""
        existing = self._entries.get(block_hash)
        if existing is not None:
            self._entries.move_to_end(block_hash)
            return None  # the same content (or a collision, which keeps the older one)
        if not self._free and self._entries:
            _, oldest = self._entries.popitem(last=False)
            self._free.append(oldest.host_block)
        if not self._free:
            return None
        host_block = self._free.pop()
        self._fresh.add(host_block)
        self._entries[block_hash] = HostEntry(host_block, parent_content_id, token_ids, content_id)
        return host_block

    def lookup(
        self, block_hash: int, parent_content_id: int, token_ids: tuple[int, ...]
    ) -> HostEntry | None:
        entry = self._entries.get(block_hash)
        if entry is None or entry.parent_content_id != parent_content_id:
            return None
        return entry if entry.token_ids == token_ids else None

    def take(self, block_hash: int) -> HostEntry:
        """Removes a hit entry; its host block is released at `end_step()`."""
        entry = self._entries.pop(block_hash)
        self._releasing.append(entry.host_block)
        return entry

    def clear(self) -> None:
        """Forgets every entry (the prefix cache reset); their host blocks are free."""
        self._free += [e.host_block for e in self._entries.values()]
        self._entries.clear()

    def end_step(self) -> None:
        self._free += self._releasing
        self._releasing.clear()
        self._fresh.clear()

    def reserve(self, keep: set[int]) -> int | None:
        """A host block for content read from a lower tier (`publish` makes it an entry),
        evicting the least recently used entry stored before this step and not in
        `keep` when none is free; None when none can be had."""
        if not self._free:
            skip = keep | self._fresh
            victim = next((h for h, e in self._entries.items() if e.host_block not in skip), None)
            if victim is None:
                return None
            self._free.append(self._entries.pop(victim).host_block)
        host_block = self._free.pop()
        self._reserved.add(host_block)
        return host_block

    def publish(self, block_hash: int, entry: HostEntry) -> None:
        """A reserved block now holds `entry`'s content: found by lookups from now on."""
        self._reserved.discard(entry.host_block)
        if block_hash in self._entries:
            self._free.append(entry.host_block)  # the same content came back meanwhile
        else:
            self._entries[block_hash] = entry

    def unreserve(self, host_block: int) -> None:
        self._reserved.discard(host_block)
        self._free.append(host_block)

    def free_block_ids(self) -> list[int]:
        return [*self._free, *self._releasing]

    def held_block_ids(self) -> list[int]:
        return [e.host_block for e in self._entries.values()] + sorted(self._reserved)
