"""BlockPool: the physical KV blocks, their reference counts, the free queue, the cache index.

Owns which blocks are free, how many block tables hold each block, and the prefix-cache
index from a block hash to the block that holds that content. It knows nothing of
requests: block tables and the hashing scheme live in the KV cache manager.

Block 0 is the null block: it is never handed out, so padded slots can write into it.
Free blocks wait in one queue that allocation pops from the front. A freed block that
holds registered (cached) content joins the back and keeps its content, so a prefix hit
can revive it until allocation reaches it and evicts it: least recently freed first.
A freed block with nothing cached joins the front, so it is reused before any cached
content is evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import NamedTuple

NULL_BLOCK = 0
# Content id of the empty prefix: the parent of every sequence's first block.
ROOT_CONTENT_ID = 0


class CachedBlock(NamedTuple):
    """A block registered in the prefix cache and the exact content it holds.

    `content_id` is unique per registration, so (parent_content_id, token_ids) names
    the whole token prefix up to this block exactly, whatever the hash function does.
    """

    block_id: int
    block_hash: int
    content_id: int
    parent_content_id: int
    token_ids: tuple[int, ...]


class BlockPool:
    def __init__(
        self, num_blocks: int, on_evict: Callable[[CachedBlock], None] | None = None
    ) -> None:
        """`on_evict` sees each cached block that allocation evicts, before its new
        holder can write it (a host tier copies it out)."""
        assert num_blocks >= 2, f"need the null block and one usable block, got {num_blocks}"
        self.num_blocks = num_blocks
        self._on_evict = on_evict
        self._ref_counts = [0] * num_blocks
        # Bumped at each allocation: (block, generation) names one tenancy of a block.
        self._generations = [0] * num_blocks
        # Insertion-ordered set of free block ids; the front is allocated (evicted) first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._cached_by_hash: dict[int, CachedBlock] = {}
        self._cached_by_block: dict[int, CachedBlock] = {}
        self._next_content_id = ROOT_CONTENT_ID + 1

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocation can hand out, including free blocks that still hold cached content."""
        return len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    @property
    def ref_counts(self) -> list[int]:
        """Every block's reference count, indexed by block id (read only: for loops that
        ask of hundreds of blocks a step)."""
        return self._ref_counts

    def generation(self, block_id: int) -> int:
        return self._generations[block_id]

    def holds(self, block_id: int, generation: int) -> bool:
        """Whether the block is still held in the tenancy `generation` names."""
        return self._ref_counts[block_id] > 0 and self._generations[block_id] == generation

    def free_block_ids(self) -> list[int]:
        """The free queue, front (next to be allocated) first."""
        return list(self._free)

    def cached_block(self, block_id: int) -> CachedBlock | None:
        return self._cached_by_block.get(block_id)

    def allocate(self, num_blocks: int) -> list[int]:
        """Pop `num_blocks` blocks from the front of the free queue, evicting their content."""
        assert 0 <= num_blocks <= len(self._free), (num_blocks, len(self._free))
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            cached = self._evict(block_id)
            if cached is not None and self._on_evict is not None:
                self._on_evict(cached)
            assert self._ref_counts[block_id] == 0
            self._ref_counts[block_id] = 1
            self._generations[block_id] += 1
            block_ids.append(block_id)
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add a holder to each block; a free cached block is revived out of the free queue."""
        for block_id in block_ids:
            assert block_id != NULL_BLOCK, "the null block is never shared"
            if self._ref_counts[block_id] == 0:
                assert block_id in self._cached_by_block, f"block {block_id} is free and uncached"
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one holder from each block, in order; blocks nobody holds join the free queue."""
        for block_id in block_ids:
            assert block_id != NULL_BLOCK, "the null block is never freed"
            assert self._ref_counts[block_id] > 0, f"double free of block {block_id}"
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] > 0:
                continue
            self._free[block_id] = None
            if block_id not in self._cached_by_block:
                self._free.move_to_end(block_id, last=False)

    def lookup(
        self, block_hash: int, parent_content_id: int, token_ids: tuple[int, ...]
    ) -> CachedBlock | None:
        """The cached block with exactly this content, or None.

        The hash only indexes: a hit must also match the parent prefix and the tokens,
        so a hash collision can cost a hit but never return the wrong K/V.
        """
        cached = self._cached_by_hash.get(block_hash)
        if cached is None or not _same_content(cached, parent_content_id, token_ids):
            return None
        return cached

    def new_content_id(self) -> int:
        """A content id no registration has used (content read back from a lower tier)."""
        content_id, self._next_content_id = self._next_content_id, self._next_content_id + 1
        return content_id

    def register(
        self,
        block_id: int,
        block_hash: int,
        parent_content_id: int,
        token_ids: tuple[int, ...],
        content_id: int | None = None,
    ) -> int | None:
        """Cache a full, computed block; returns the content id of its token prefix.

        If a block with the same content is cached already, this block stays uncached
        and that block's content id is returned. None when the hash is taken by other
        content (a collision): the content cannot be cached then. `content_id` restores
        the id of content brought back from a host tier (no block holds it now).
        """
        assert self._ref_counts[block_id] > 0, f"registering free block {block_id}"
        existing = self._cached_by_hash.get(block_hash)
        if existing is not None:
            if _same_content(existing, parent_content_id, token_ids):
                return existing.content_id
            return None
        assert block_id not in self._cached_by_block, f"block {block_id} holds other content"
        if content_id is None:
            content_id, self._next_content_id = self._next_content_id, self._next_content_id + 1
        cached = CachedBlock(block_id, block_hash, content_id, parent_content_id, token_ids)
        self._cached_by_hash[block_hash] = cached
        self._cached_by_block[block_id] = cached
        return cached.content_id

    def uncache(self, block_id: int) -> None:
        """Forget a held block's cached content (it was registered but never written)."""
        assert self._ref_counts[block_id] > 0, f"uncaching free block {block_id}"
        self._evict(block_id)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached content (vLLM's reset_prefix_cache); False, and nothing
        forgotten, while any block is held."""
        if len(self._free) != self.num_usable_blocks:
            return False
        self._cached_by_hash.clear()
        self._cached_by_block.clear()
        return True

    def _evict(self, block_id: int) -> CachedBlock | None:
        cached = self._cached_by_block.pop(block_id, None)
        if cached is not None:
            del self._cached_by_hash[cached.block_hash]
        return cached


def _same_content(cached: CachedBlock, parent_content_id: int, token_ids: tuple[int, ...]) -> bool:
    return cached.parent_content_id == parent_content_id and cached.token_ids == token_ids


def cdiv(a: int, b: int) -> int:
    """a / b rounded up (blocks for a tokens)."""
    return -(-a // b)
