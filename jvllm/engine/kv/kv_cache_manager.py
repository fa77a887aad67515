"""KVCacheManager: per-request block tables, prefix caching and copy-on-write.

Owns which physical block holds each position of each request (the slot of position p
is `table[p // block_size] * block_size + p % block_size`), the chained hashes used to
find a request's cached prefix, the prefix-cache hit counters, and the whole-block
copies that copy-on-write asks of the model runner. It does not decide who runs next
(the scheduler does) and never touches the device.

A block table only changes at positions not yet computed, except by copy-on-write,
whose (old, new) copy the runner applies before the step's forward, and by swapping:
a swapped-out request's computed blocks move to host blocks of a second pool (the
runner copies them out before the step's forward, and back into new device blocks
when swapped in). It holds no device block while swapped out; `SwapSpace` decides
which host copies, and which device blocks on the way back, holders may share.

Every table is also a row of `table_array` (`BlockTableArray`), rewritten where a table
changes, so a step's tables reach the runner as one gather.
"""

from __future__ import annotations

from jvllm.engine.kv.block_pool import NULL_BLOCK, BlockPool, CachedBlock, cdiv
from jvllm.engine.kv.block_table_array import BlockTableArray
from jvllm.engine.kv.disk_tier import DiskPrefixTier
from jvllm.engine.kv.host_tier import HostEntry, HostPrefixTier
from jvllm.engine.kv.prefix import (
    EMPTY_PREFIX,
    CachedPrefix,
    hash_block_tokens,
    root_content_id,
    root_hash,
)
from jvllm.engine.kv.swap_space import SwapSpace
from jvllm.engine.kv.swapping import Swapping
from jvllm.engine.multimodal import block_mm_keys
from jvllm.engine.request import Request


class KVCacheManager(Swapping):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        num_host_blocks: int = 0,
        num_tier_blocks: int = 0,
        num_lookahead_tokens: int = 0,
        max_model_len: int | None = None,
    ) -> None:
        """Host blocks 1..num_host_blocks hold swapped-out requests; the next
        `num_tier_blocks` are the prefix cache's host tier (with prefix caching on).
        `num_lookahead_tokens` more positions (up to `max_model_len`) are covered past
        every allocation: a draft model writes its proposals' K/V there."""
        assert not num_lookahead_tokens or max_model_len is not None
        self.block_size = block_size
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_model_len = max_model_len or 0
        self.enable_prefix_caching = enable_prefix_caching
        self.host_tier = None
        if num_tier_blocks and enable_prefix_caching:
            first = num_host_blocks + 1
            self.host_tier = HostPrefixTier(range(first, first + num_tier_blocks))
        on_evict = self._offload if self.host_tier is not None else None
        self.block_pool = BlockPool(num_blocks, on_evict)
        self.disk_tier: DiskPrefixTier | None = None  # below the host tier (kv_offload.setup)
        self._ref_counts = self.block_pool.ref_counts  # the pool's own list, read per row
        # Host blocks for swapped-out requests.
        self.swap_space = SwapSpace(num_host_blocks, self.block_pool) if num_host_blocks else None
        # Host-tier copies since the last take_host_copies(): (device, host), (host, device).
        self._offloads: list[tuple[int, int]] = []
        self._onloads: list[tuple[int, int]] = []
        self.prefix_cache_host_hits = 0  # tokens found in the host tier
        self.num_offloaded_blocks = 0
        self.num_onloaded_blocks = 0
        self._block_tables: dict[str, list[int]] = {}
        # The same tables as rows of one int32 array, rewritten whenever a table changes.
        self.table_array = BlockTableArray(cdiv(self.max_model_len, block_size))
        # Chained hashes of a request's leading full blocks, extended on demand.
        self._block_hashes: dict[str, list[int]] = {}
        # Content ids of a request's leading full blocks that are cached (by it or others).
        self._content_ids: dict[str, list[int]] = {}
        self._blocks_to_copy: list[tuple[int, int]] = []
        # The requests whose `kv_room` is set (`allocate_slot`), until their table changes.
        self._room_holders: dict[str, Request] = {}
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # of those, tokens found cached

    def get_block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table ([] when it holds no blocks)."""
        return list(self._block_tables.get(request_id, ()))

    @property
    def block_tables(self) -> dict[str, list[int]]:
        """Request id -> its block table itself, not a copy (read only; a table is valid
        until the next allocation changes it): for the scheduler's per-row loop."""
        return self._block_tables

    @property
    def num_allocated_blocks(self) -> int:
        return self.block_pool.num_usable_blocks - self.block_pool.num_free_blocks

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """Longest run of cached full blocks within the request's first num_tokens - 1 tokens.

        At least one token is left to compute, so the step has a logit to sample from.
        Changes nothing; pass the result to `allocate_slots` to take the blocks.
        """
        # Prompt logprobs need the logits of every prompt position, cached or not.
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return EMPTY_PREFIX
        block_ids: list[int] = []
        content_ids: list[int] = []
        host_hits: dict[int, HostEntry] = {}
        parent = root_content_id(request.lora_int_id)
        for index in range((request.num_tokens - 1) // self.block_size):
            tokens = tuple(self._block_tokens(request, index))
            block_hash = self._block_hash(request, index, tokens)
            cached = self.block_pool.lookup(block_hash, parent, tokens)
            if cached is not None:
                block_ids.append(cached.block_id)
                content_ids.append(cached.content_id)
            elif self.host_tier is not None and (
                entry := self.host_tier.lookup(block_hash, parent, tokens)
            ):
                host_hits[index] = entry
                block_ids.append(NULL_BLOCK)
                content_ids.append(entry.content_id)
            else:
                break
            parent = content_ids[-1]
        return CachedPrefix(block_ids, content_ids, len(block_ids) * self.block_size, host_hits)

    def allocate_slot(self, request: Request) -> bool:
        """`allocate_slots(request, 1)` for a decode row, its common cases in one call.

        Where the slot is in the request's own last block, which no one else holds, and
        more of it is left before its last slot, the request's `kv_room` says how much:
        the next that many decode rows may each take one slot of it without this call
        (the scheduler's steady rows do). Any other change to its table or to who holds
        that block (allocate_slots, fork, swaps, free) sets it back to 0 first."""
        table = self._block_tables.get(request.request_id)
        if self.num_lookahead_tokens or not table:
            return self.allocate_slots(request, 1)
        computed, block_size = request.num_computed_tokens, self.block_size
        offset = computed - (len(table) - 1) * block_size  # within the last block
        if 0 <= offset < block_size and self._ref_counts[table[-1]] == 1:
            if offset == block_size - 1:  # it fills it (registered now if its token is known)
                if self.enable_prefix_caching and computed < request.num_tokens:
                    self._register_full_blocks(request, table, computed + 1)
            else:  # room left before the slot that fills it
                self._grant_room(request, block_size - 2 - offset)
            return True  # `_fill_own_last_block`'s case: nothing allocated or copied
        if offset != block_size or not self.block_pool.num_free_blocks:
            return self.allocate_slots(request, 1)  # copy-on-write, or no block to take
        # Once in block_size steps: a fresh block, appended (no whole-row rewrite).
        (block,) = self.block_pool.allocate(1)
        table.append(block)
        self.table_array.append(request.request_id, block)
        if self.enable_prefix_caching and block_size == 1:
            self._register_full_blocks(request, table, computed + 1)
        self._grant_room(request, block_size - 2)
        return True

    def _grant_room(self, request: Request, room: int) -> None:
        if room > 0:
            request.kv_room = room
            self._room_holders[request.request_id] = request

    def _revoke_room(self, request_id: str) -> None:
        holder = self._room_holders.pop(request_id, None)
        if holder is not None:
            holder.kv_room = 0

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        cached_prefix: CachedPrefix | None = None,
        num_reserved_tokens: int = 0,
    ) -> bool:
        """Make the table cover the request's next `num_new_tokens` positions.

        The new tokens start at `request.num_computed_tokens`, or right after
        `cached_prefix` when one is given (admission; the request holds no blocks yet).
        The table is grown to at least `num_reserved_tokens` positions. A block about to
        be written that others share is replaced by a private copy (copy-on-write).
        Returns False, changing nothing, when the free blocks do not suffice.
        """
        assert num_new_tokens >= 1, num_new_tokens
        self._revoke_room(request.request_id)
        table = self._block_tables.get(request.request_id, [])
        ahead = 0
        if self.num_lookahead_tokens:
            start = cached_prefix.num_tokens if cached_prefix else request.num_computed_tokens
            limit = self.max_model_len - start - num_new_tokens
            ahead = max(0, min(self.num_lookahead_tokens, limit))
        if (
            cached_prefix is None
            and not num_reserved_tokens
            and self._fill_own_last_block(request, num_new_tokens, ahead)
        ):
            return True  # most decode steps
        if cached_prefix is None:
            prefix, start = EMPTY_PREFIX, request.num_computed_tokens
        else:
            assert not table and request.num_computed_tokens == 0, request
            prefix, start = cached_prefix, cached_prefix.num_tokens
        end = start + num_new_tokens
        # Draft tokens (speculative decoding) take slots past the known tokens.
        limit = request.num_tokens_with_placeholders + len(request.spec_token_ids)
        assert end <= limit, (request, num_new_tokens)
        num_held = len(table) + len(prefix.block_ids)
        covered = max(end + ahead, num_reserved_tokens)
        num_new_blocks = max(0, cdiv(covered, self.block_size) - num_held)
        shared = self._shared_blocks_in(table, start, end)
        device_hits = [b for b in prefix.block_ids if b != NULL_BLOCK]
        # Reviving a free cached block takes it out of the free queue too.
        num_revived = sum(self.block_pool.ref_count(b) == 0 for b in device_hits)
        num_needed = num_new_blocks + len(shared) + len(prefix.host_hits)
        if num_needed > self.block_pool.num_free_blocks - num_revived:
            return False

        # Take the hits before allocating, so that allocation cannot evict them.
        self.block_pool.incref(device_hits)
        table = self._block_tables.setdefault(request.request_id, [])
        table += prefix.block_ids
        self._onload(request, table, prefix.host_hits)
        table += self.block_pool.allocate(num_new_blocks)
        self._copy_on_write(table, shared, start)
        self.table_array.write(request.request_id, table)
        if cached_prefix is not None and self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += prefix.num_tokens
            self.prefix_cache_host_hits += len(prefix.host_hits) * self.block_size
            self._content_ids[request.request_id] = list(prefix.content_ids)
        if self.enable_prefix_caching:
            self._register_full_blocks(request, table, end)
        return True

    def can_fork(self, source_id: str, num_tokens: int) -> bool:
        """Whether the source holds every block a child forked at `num_tokens` reads."""
        return source_id in self._block_tables

    def fork(self, source_id: str, child_id: str, num_tokens: int) -> None:
        """Share the source's blocks covering its first `num_tokens` positions with the
        child, which writes past them (into a shared block: its own copy first)."""
        assert child_id not in self._block_tables, f"{child_id} already holds blocks"
        self._revoke_room(source_id)  # its last block is about to be shared
        source_table = self._block_tables[source_id]
        shared = source_table[: cdiv(num_tokens, self.block_size)]
        assert len(shared) * self.block_size >= num_tokens, (source_id, num_tokens)
        self.block_pool.incref(shared)
        self._block_tables[child_id] = list(shared)
        self.table_array.write(child_id, shared)
        if self.enable_prefix_caching:
            source_content = self._content_ids.get(source_id, [])
            self._content_ids[child_id] = source_content[: num_tokens // self.block_size]

    def free(self, request_id: str) -> None:
        """Release everything the request holds; a request holding nothing is fine."""
        # Tail blocks first: they are the least likely to be shared, so evict them first.
        table = self._block_tables.pop(request_id, [])
        self._revoke_room(request_id)
        if self.disk_tier is not None:
            self.disk_tier.forget(request_id)  # a read-ahead it may have waited for
            if table:  # a producer sends its blocks on
                self._offloads += self.disk_tier.push(table, self._content_ids.get(request_id, []))
        self.table_array.release(request_id)
        self.block_pool.free(b for b in reversed(table) if b != NULL_BLOCK)
        if self.swap_space is not None:
            self.swap_space.free(request_id)
        self._block_hashes.pop(request_id, None)
        self._content_ids.pop(request_id, None)

    def take_host_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The host tier's (device, host) copies out and (host, device) copies in since
        the last call; ends the tier's step (blocks copied in are reusable again)."""
        offloads, self._offloads = self._offloads, []
        onloads, self._onloads = self._onloads, []
        if self.host_tier is not None:
            self.host_tier.end_step()
        return offloads, onloads

    def _offload(self, cached: CachedBlock) -> None:
        """The device pool is evicting a cached block: keep its content in the host tier."""
        assert self.host_tier is not None
        host_block = self.host_tier.store(
            cached.block_hash, cached.parent_content_id, cached.token_ids, cached.content_id
        )
        if host_block is not None:
            self._offloads.append((cached.block_id, host_block))
            self.num_offloaded_blocks += 1
            if self.disk_tier is not None:
                self.disk_tier.save(cached, host_block)

    def _onload(self, request: Request, table: list[int], hits: dict[int, HostEntry]) -> None:
        """Host-tier hits come back into new device blocks, cached again as before."""
        if not hits:
            return
        assert self.host_tier is not None
        # Taken first: the allocation below may evict blocks into the tier, which must
        # not reuse these entries' host blocks before the runner has read them.
        for index in hits:
            self.host_tier.take(self._block_hash(request, index))
        blocks = self.block_pool.allocate(len(hits))
        for (index, entry), block in zip(hits.items(), blocks, strict=True):
            block_hash = self._block_hash(request, index)
            table[index] = block
            self._onloads.append((entry.host_block, block))
            self.num_onloaded_blocks += 1
            self.block_pool.register(
                block, block_hash, entry.parent_content_id, entry.token_ids, entry.content_id
            )

    def drop_unwritten(self, request: Request) -> None:
        """Uncache the blocks this request registered beyond its computed tokens.

        Blocks are registered when allocated, ahead of the step that writes them; a
        request that then loses its blocks unscheduled (its unit preempted or rolled back
        in the same `schedule()`) must not leave them findable.
        """
        content_ids = self._content_ids.get(request.request_id, [])
        table = self._block_tables.get(request.request_id, [])
        first = request.num_computed_tokens // self.block_size
        for index in range(first, len(content_ids)):
            cached = self.block_pool.cached_block(table[index])
            if cached is not None and cached.content_id == content_ids[index]:
                self.block_pool.uncache(table[index])
        del content_ids[first:]

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        """The (src, dst) copies requested since the last call, in order.

        No pair reads a block that an earlier pair writes, so the runner may apply them
        in order or all at once (gather every src, then scatter to every dst).
        """
        copies, self._blocks_to_copy = self._blocks_to_copy, []
        written: set[int] = set()
        for src, dst in copies:
            assert src not in written and dst not in written, copies
            written.add(dst)
        return copies

    def cache_full_blocks(self, request: Request) -> None:
        """Registers the request's computed full blocks whose tokens have all become known
        (a block completed by a token that was still on the device when it was allocated)."""
        table = self._block_tables.get(request.request_id)
        if self.enable_prefix_caching and table:
            self._register_full_blocks(request, table, request.num_computed_tokens)

    def _shared_blocks_in(self, table: list[int], start: int, end: int) -> list[int]:
        """Indices of blocks in the table that positions [start, end) write and others hold."""
        first, stop = start // self.block_size, min(cdiv(end, self.block_size), len(table))
        return [i for i in range(first, stop) if self.block_pool.ref_count(table[i]) > 1]

    def _copy_on_write(self, table: list[int], indices: list[int], start: int) -> None:
        for index in indices:
            old = table[index]
            (table[index],) = self.block_pool.allocate(1)
            # A block with no computed position yet has nothing worth copying.
            if index * self.block_size < start:
                self._blocks_to_copy.append((old, table[index]))
            self.block_pool.free([old])

    def _fill_own_last_block(self, request: Request, num_new_tokens: int, ahead: int) -> bool:
        """Whether the request's next `num_new_tokens` positions (and `ahead` more) all
        land in its own last block, which no one else holds: then nothing is allocated
        or copied (the block is registered if they fill it)."""
        table = self._block_tables.get(request.request_id)
        if not table:
            return False
        computed, block_size = request.num_computed_tokens, self.block_size
        offset = computed - (len(table) - 1) * block_size  # within the last block
        if offset < 0 or offset + num_new_tokens + ahead > block_size:
            return False
        if self._ref_counts[table[-1]] != 1:
            return False
        end = computed + num_new_tokens
        if self.enable_prefix_caching and end % block_size == 0:
            self._register_full_blocks(request, table, end)
        return True

    def _register_full_blocks(self, request: Request, table: list[int], end: int) -> None:
        """Cache the blocks that are full once positions below `end` are written.

        Registering at allocation is safe: the step's forward writes all its K/V before
        any attention reads them, so a request admitted later in this step may hit them.
        Blocks holding a token still on the device wait for `cache_full_blocks`.
        """
        content_ids = self._content_ids.setdefault(request.request_id, [])
        for index in range(len(content_ids), min(end, request.num_tokens) // self.block_size):
            parent = content_ids[-1] if content_ids else root_content_id(request.lora_int_id)
            tokens = tuple(self._block_tokens(request, index))
            block_hash = self._block_hash(request, index, tokens)
            content_id = self.block_pool.register(table[index], block_hash, parent, tokens)
            if content_id is None:
                return  # hash collision: this prefix and everything after it stay uncached
            content_ids.append(content_id)

    def block_key(self, request: Request, index: int) -> tuple[int, tuple[int, ...]]:
        """Full block `index`'s chained hash and tokens (what the fs tier keys it by)."""
        return self._block_hash(request, index), tuple(self._block_tokens(request, index))

    def _block_tokens(self, request: Request, index: int) -> list[int]:
        start, stop = index * self.block_size, (index + 1) * self.block_size
        tokens = request.get_token_ids(start, stop)
        return tokens + block_mm_keys(request, start, stop) if request.mm_features else tokens

    def _block_hash(self, request: Request, index: int, tokens: tuple | None = None) -> int:
        """Full block `index`'s chained hash (`tokens`: its `_block_tokens`, if known)."""
        hashes = self._block_hashes.setdefault(request.request_id, [])
        while (at := len(hashes)) <= index:
            parent = hashes[-1] if hashes else root_hash(request.lora_int_id)
            block = tokens if at == index and tokens else self._block_tokens(request, at)
            hashes.append(hash_block_tokens(parent, block))
        return hashes[index]
