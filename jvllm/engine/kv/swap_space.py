"""SwapSpace: the host blocks of swapped-out requests, shared where sharing is safe.

Owns the ref-counted host pool of swap preemption and which host block holds each
table index of each swapped-out request. A swapped-out request holds no device block
(blocks held only by swapped requests could pin the device pool). Full blocks are
never written again, so a full block shared on the device is copied to the host once:
a second holder swapping out while the first copy lives shares it; and a host block
shared by swapped requests comes back into one device block, which the others share
when they swap in while it lives. A partial block is copied per request: its holder
may write it in place once it holds it alone. It never touches the device: the KV
cache manager turns its answers into (device, host) and (host, device) copies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from jvllm.engine.kv.block_pool import BlockPool


class SwapSpace:
    def __init__(self, num_blocks: int, device_pool: BlockPool) -> None:
        self.pool = BlockPool(num_blocks + 1)  # block 0 unused, as the device's null block
        self._device = device_pool
        # Full device block -> its host copy; full host block -> where it came back in.
        self._copy_of: dict[int, _Pair] = {}
        self._back_in: dict[int, _Pair] = {}
        self._tables: dict[str, dict[int, int]] = {}  # request id -> {table index: host block}

    def get_host_blocks(self, request_id: str) -> dict[int, int]:
        return dict(self._tables.get(request_id, {}))

    def num_new_host_blocks(self, blocks: list[int], num_full: int) -> int:
        """Host blocks a swap-out of these device blocks (the first num_full full) takes."""
        return sum(self._host_copy(b) is None or i >= num_full for i, b in enumerate(blocks))

    def swap_out(self, request_id: str, blocks: list[int], num_full: int) -> list[tuple[int, int]]:
        """Host blocks for the request's computed device blocks (table order); returns
        the (device, host) copies needed. The caller then drops its device blocks."""
        assert request_id not in self._tables, request_id
        copies, table = [], {}
        for index, block in enumerate(blocks):
            shared = self._host_copy(block) if index < num_full else None
            if shared is not None:
                self.pool.incref([shared])
                table[index] = shared
                continue
            (host,) = self.pool.allocate(1)
            copies.append((block, host))
            table[index] = host
            if index < num_full and self._device.ref_count(block) > 1:
                # Others still hold it: a later swap-out of theirs can share this copy.
                self._copy_of[block] = self._pair(block, host)
        self._tables[request_id] = table
        return copies

    def num_new_device_blocks(self, request_id: str) -> int:
        table = self._tables.get(request_id, {})
        return sum(self._device_copy(h) is None for h in table.values())

    def swap_in(
        self, request_id: str, num_full: int, allocate: Callable[[int], list[int]]
    ) -> tuple[dict[int, int], list[tuple[int, int]]]:
        """The request's device blocks back ({table index: block}, shared ones already
        held for it) and the (host, device) copies; `allocate(n)` gives new blocks."""
        table = self._tables.pop(request_id, {})
        shared = {i: self._device_copy(h) for i, h in table.items()}
        fresh = [i for i, b in shared.items() if b is None]
        blocks = dict(zip(fresh, allocate(len(fresh)), strict=True))
        self._device.incref([b for b in shared.values() if b is not None])
        copies = []
        for index, host in table.items():
            if index in blocks:
                block = blocks[index]
                copies.append((host, block))
                if index < num_full and self.pool.ref_count(host) > 1:
                    self._back_in[host] = self._pair(block, host)
            else:
                blocks[index] = shared[index]
        self.pool.free(table.values())
        return blocks, copies

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        if table:
            self.pool.free(table.values())

    def _pair(self, block: int, host: int) -> _Pair:
        return _Pair(block, self._device.generation(block), host, self.pool.generation(host))

    def _host_copy(self, block: int) -> int | None:
        """The live host copy of a full device block, if one was made in its tenancy."""
        pair = self._live(self._copy_of, block)
        return pair.host if pair is not None else None

    def _device_copy(self, host: int) -> int | None:
        """The live device block a full host block came back into, if any."""
        pair = self._live(self._back_in, host)
        return pair.device if pair is not None else None

    def _live(self, pairs: dict[int, _Pair], key: int) -> _Pair | None:
        """pairs[key] while both of its blocks are in the tenancies it names (forgotten
        once either is freed)."""
        pair = pairs.get(key)
        if pair is None:
            return None
        if self._device.holds(pair.device, pair.device_gen) and self.pool.holds(
            pair.host, pair.host_gen
        ):
            return pair
        del pairs[key]
        return None


class _Pair(NamedTuple):
    """A device block and a host block holding the same full block's K/V."""

    device: int
    device_gen: int
    host: int
    host_gen: int
