"""The swap half of `KVCacheManager`: a swapped-out request's blocks to host memory and back.

Owns turning `SwapSpace`'s answers into (device, host) and (host, device) block copies
and the request's table while it is swapped out (NULL_BLOCK where its blocks were).
`KVCacheManager` mixes this in; which request is preempted, and how, is the
scheduler's (`scheduling/admission.py`).
"""

from __future__ import annotations

from collections.abc import Callable

from jvllm.engine.kv.block_pool import NULL_BLOCK, BlockPool, cdiv
from jvllm.engine.kv.block_table_array import BlockTableArray
from jvllm.engine.kv.swap_space import SwapSpace
from jvllm.engine.request import Request


class Swapping:
    """The swapping half of `KVCacheManager` (whose `__init__` sets these attributes)."""

    block_size: int
    block_pool: BlockPool
    swap_space: SwapSpace | None
    table_array: BlockTableArray
    _block_tables: dict[str, list[int]]
    drop_unwritten: Callable[[Request], None]
    _revoke_room: Callable[[str], None]

    @property
    def host_pool(self) -> BlockPool | None:
        """The swap space's host blocks (None without swap preemption)."""
        return self.swap_space.pool if self.swap_space is not None else None

    def can_swap_out(self, request: Request) -> bool:
        """Whether the host pool has room for the request's computed blocks."""
        if self.swap_space is None:
            return False
        blocks = self._computed_blocks(request)
        needed = self.swap_space.num_new_host_blocks(blocks, self._num_full(request))
        return needed <= self.swap_space.pool.num_free_blocks

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Moves the request's computed blocks to host blocks and drops its device blocks
        (a block others share stays theirs); returns the (device, host) copies. Blocks
        past its computed tokens are dropped (nothing was written there)."""
        assert self.swap_space is not None and self.can_swap_out(request), request
        self._revoke_room(request.request_id)
        self.drop_unwritten(request)
        table = self._block_tables.get(request.request_id, [])
        blocks = self._computed_blocks(request)
        pairs = self.swap_space.swap_out(request.request_id, blocks, self._num_full(request))
        self.block_pool.free(reversed(table))
        table[:] = [NULL_BLOCK] * len(blocks)
        if request.request_id in self._block_tables:
            self.table_array.write(request.request_id, table)
        return pairs

    def swap_in(self, request: Request, num_spare_blocks: int) -> list[tuple[int, int]] | None:
        """Brings a swapped-out request's blocks back (into new device blocks, or ones it
        shares again), leaving at least `num_spare_blocks` free; returns the (host,
        device) copies, or None (changing nothing) when the device pool has no room."""
        assert self.swap_space is not None
        self._revoke_room(request.request_id)
        needed = self.swap_space.num_new_device_blocks(request.request_id)
        if needed + num_spare_blocks > self.block_pool.num_free_blocks:
            return None
        blocks, pairs = self.swap_space.swap_in(
            request.request_id, self._num_full(request), self.block_pool.allocate
        )
        table = self._block_tables.setdefault(request.request_id, [])
        for index, block in blocks.items():
            table[index] = block
        self.table_array.write(request.request_id, table)
        return pairs

    def get_host_blocks(self, request_id: str) -> dict[int, int]:
        """A copy of the swapped-out request's {table index: host block}."""
        return self.swap_space.get_host_blocks(request_id) if self.swap_space else {}

    def _computed_blocks(self, request: Request) -> list[int]:
        table = self._block_tables.get(request.request_id, [])
        return table[: cdiv(request.num_computed_tokens, self.block_size)]

    def _num_full(self, request: Request) -> int:
        return request.num_computed_tokens // self.block_size
