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

from jvllm.engine.block_pool import BlockPool


class SwapSpace:
    def __init__(self, num_blocks: int, device_pool: BlockPool) -> None:
        self.pool = BlockPool(num_blocks + 1)  # block 0 unused, as the device's null block
        self._device = device_pool
        # Full device block -> (host copy, host generation, device generation).
        self._copy_of: dict[int, tuple[int, int, int]] = {}
        # Full host block -> (device block it came back into, device gen, host gen).
        self._back_in: dict[int, tuple[int, int, int]] = {}
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
                gen = self._device.generation(block)
                self._copy_of[block] = (host, self.pool.generation(host), gen)
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
                    gen = self._device.generation(block)
                    self._back_in[host] = (block, gen, self.pool.generation(host))
            else:
                blocks[index] = shared[index]
        self.pool.free(table.values())
        return blocks, copies

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        if table:
            self.pool.free(table.values())

    def _host_copy(self, block: int) -> int | None:
        """The live host copy of a full device block, if one was made in its tenancy."""
        entry = self._copy_of.get(block)
        if entry is None:
            return None
        host, host_gen, device_gen = entry
        if self._device.holds(block, device_gen) and self.pool.holds(host, host_gen):
            return host
        del self._copy_of[block]
        return None

    def _device_copy(self, host: int) -> int | None:
        """The live device block a full host block came back into, if any."""
        entry = self._back_in.get(host)
        if entry is None:
            return None
        block, device_gen, host_gen = entry
        if self._device.holds(block, device_gen) and self.pool.holds(host, host_gen):
            return block
        del self._back_in[host]
        return None
