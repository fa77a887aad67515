"""HybridKVCacheManager: two KV cache groups, full-attention and sliding-window layers.

A model whose layers alternate one-for-one between full attention and one sliding
window (Gemma 2, gpt-oss) keeps, per request, two block tables over the same block
pool, as vLLM's hybrid KV cache manager does with its KV cache groups. The full group's
table is `KVCacheManager`'s own. The sliding group's table is positional too (entry i
covers positions [i * block_size, (i + 1) * block_size)), but an entry whose positions
every future query has left behind is freed and becomes the null block: a query at
position p reads keys in (p - window, p], so once a request's next query starts at s,
the blocks wholly below s - window + 1 are dead. A decoding request then holds at most
ceil(window / block_size) + 1 sliding blocks, however long it runs.

Physically, full layer j and sliding layer j share one cache array (the runner
allocates num_layers / 2 of them, `jvllm.models.kv_groups`): a block id belongs to one
group at a time, so a block costs half of what it costs in a one-table layout, and a
sliding block freed is a block either group can take.

Both tables travel as one row of `table_array`: the full table in columns [0, width),
the sliding table in [width, 2 * width) (`width` blocks cover max_model_len).

Not supported here (the engine keeps the one-table layout when they are asked for):
prefix caching (a hit would need the sliding group's blocks of the window before it,
which are freed), swap preemption (preemption recomputes) and lookahead slots of a
draft model. Forks (n > 1, beam search) share both groups' blocks, copy-on-write.
"""

from __future__ import annotations

from jvllm.config import CacheConfig
from jvllm.engine.kv.block_pool import NULL_BLOCK, cdiv
from jvllm.engine.kv.block_table_array import BlockTableArray
from jvllm.engine.kv.kv_cache_manager import KVCacheManager
from jvllm.engine.kv.prefix import CachedPrefix
from jvllm.engine.request import Request


class HybridKVCacheManager(KVCacheManager):
    def __init__(
        self, num_blocks: int, block_size: int, sliding_window: int, max_model_len: int
    ) -> None:
        super().__init__(num_blocks, block_size, False, max_model_len=max_model_len)
        assert sliding_window >= 1, sliding_window
        self.sliding_window = sliding_window
        self.width = cdiv(max_model_len, block_size)
        self.table_array = BlockTableArray(2 * self.width)
        # Request id -> its sliding-group table (NULL_BLOCK where freed).
        self._sliding_tables: dict[str, list[int]] = {}

    def get_sliding_block_table(self, request_id: str) -> list[int]:
        """A copy of the request's sliding-group table ([] when it holds none)."""
        return list(self._sliding_tables.get(request_id, ()))

    def num_sliding_blocks(self, request_id: str) -> int:
        """Blocks the request's sliding group holds (null entries not counted)."""
        return sum(b != NULL_BLOCK for b in self._sliding_tables.get(request_id, ()))

    def allocate_slot(self, request: Request) -> bool:
        return self.allocate_slots(request, 1)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        cached_prefix: CachedPrefix | None = None,
        num_reserved_tokens: int = 0,
    ) -> bool:
        """Both groups cover the request's next `num_new_tokens` positions, or neither
        changes (False) when the free blocks do not suffice for both; the sliding group
        first frees the blocks the next query can no longer read."""
        assert cached_prefix is None or not cached_prefix.block_ids, "prefix caching is off"
        start = request.num_computed_tokens
        end = start + num_new_tokens
        rid = request.request_id
        sliding = self._sliding_tables.setdefault(rid, [])
        changed = self._free_dead_blocks(sliding, start)
        num_blocks = cdiv(max(end, num_reserved_tokens), self.block_size)
        full = self._block_tables.get(rid, [])
        needed = max(0, num_blocks - len(full)) + len(self._shared_blocks_in(full, start, end))
        missing = [i for i in range(len(sliding), num_blocks)]
        missing += [i for i in range(start // self.block_size, len(sliding)) if not sliding[i]]
        shared = self._shared_blocks_in(sliding, start, end)
        if needed + len(missing) + len(shared) > self.block_pool.num_free_blocks:
            if changed and rid in self.table_array:
                self._write_sliding_row(rid)
            return False
        fits = super().allocate_slots(request, num_new_tokens, None, num_reserved_tokens)
        assert fits, request
        sliding += [NULL_BLOCK] * (num_blocks - len(sliding))
        for index, block in zip(missing, self.block_pool.allocate(len(missing)), strict=True):
            sliding[index] = block
        self._copy_on_write(sliding, shared, start)
        if changed or missing or shared:
            self._write_sliding_row(rid)
        return True

    def can_fork(self, source_id: str, num_tokens: int) -> bool:
        """As the one-group manager's, and the source has not yet freed a sliding block
        that the child's first query (at `num_tokens`) reads: a source that decoded on
        past the window has."""
        if not super().can_fork(source_id, num_tokens):
            return False
        sliding = self._sliding_tables.get(source_id, [])[: cdiv(num_tokens, self.block_size)]
        first_read = max(0, (num_tokens - self.sliding_window + 1) // self.block_size)
        return NULL_BLOCK not in sliding[first_read:]

    def fork(self, source_id: str, child_id: str, num_tokens: int) -> None:
        super().fork(source_id, child_id, num_tokens)
        shared = self._sliding_tables.get(source_id, [])[: cdiv(num_tokens, self.block_size)]
        self.block_pool.incref(b for b in shared if b != NULL_BLOCK)
        self._sliding_tables[child_id] = list(shared)
        self._write_sliding_row(child_id)

    def free(self, request_id: str) -> None:
        sliding = self._sliding_tables.pop(request_id, [])
        if request_id in self.table_array:
            row = self.table_array.row(request_id)
            self.table_array.array[row, self.width :] = 0
        self.block_pool.free(b for b in reversed(sliding) if b != NULL_BLOCK)
        super().free(request_id)

    def _free_dead_blocks(self, sliding: list[int], start: int) -> bool:
        """Frees the blocks no query from position `start` on reads; whether any was."""
        num_dead = min(max(0, (start - self.sliding_window + 1) // self.block_size), len(sliding))
        dead = [b for b in sliding[:num_dead] if b != NULL_BLOCK]
        if not dead:
            return False
        sliding[:num_dead] = [NULL_BLOCK] * num_dead
        self.block_pool.free(dead)
        return True

    def _write_sliding_row(self, request_id: str) -> None:
        """The sliding table into its columns of the request's row (the full table's
        write took the row)."""
        sliding = self._sliding_tables[request_id]
        row = self.table_array.row(request_id)
        columns = self.table_array.array[row, self.width :]
        columns[: len(sliding)] = sliding
        columns[len(sliding) :] = 0


def new_kv_cache_manager(
    cache_config: CacheConfig,
    max_model_len: int,
    num_blocks: int,
    num_host_blocks: int,
    num_tier_blocks: int,
    num_lookahead_tokens: int,
    sliding_window: int | None,
) -> KVCacheManager:
    """The hybrid manager when the runner laid the cache out in two groups (it does so
    only with a `sliding_window` and none of what the hybrid manager refuses), else the
    one-table manager. The hybrid manager has no swap space: preemption recomputes."""
    block_size, prefix_caching = cache_config.block_size, cache_config.enable_prefix_caching
    if sliding_window is None:
        return KVCacheManager(
            num_blocks,
            block_size,
            prefix_caching,
            num_host_blocks,
            num_tier_blocks,
            num_lookahead_tokens,
            max_model_len,
        )
    assert not (prefix_caching or num_lookahead_tokens), "the runner refuses these"
    # One sequence of max_model_len holds every full block and a window's sliding ones.
    needed = cdiv(max_model_len, block_size) + cdiv(sliding_window, block_size) + 1
    if num_blocks - 1 < needed:
        raise ValueError(
            f"num_blocks={num_blocks} (one reserved) cannot hold one sequence of "
            f"max_model_len={max_model_len} tokens in the hybrid KV layout, which needs "
            f"{needed + 1} blocks of block_size={block_size} (its sliding window "
            f"{sliding_window} included); lower max_model_len or give the KV cache more "
            "memory (gpu_memory_utilization, num_gpu_blocks_override)"
        )
    return HybridKVCacheManager(num_blocks, block_size, sliding_window, max_model_len)
