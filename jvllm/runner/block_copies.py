"""Whole-block KV copies: on the device (copy-on-write) and to and from host memory (swap).

Owns the gather, scatter and copy programs and the host-memory pool that swapped-out
blocks live in. Does not own the device cache: each call takes the runner's `caches`
and returns them updated (donated, so written in place). With pipeline stages a KV
layer is `[pp, blocks, ...]` and a block id indexes its second axis, every stage's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jvllm.layers.attention import KVCache
from jvllm.runner.input_batch import pick_bucket
from jvllm.runner.programs import ExecutableStore, Program

# Block counts one swap copy program handles (padded up; larger swaps are chunked).
SWAP_BUCKETS = (8, 32, 128)

HostCache = list[tuple[np.ndarray, np.ndarray]]


class BlockCopier:
    def __init__(
        self,
        pp: int,
        store: ExecutableStore | None,
        put: Callable[[Any], Any],
        host_shapes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
        kv_dtype: np.dtype,
    ) -> None:
        """`put` places host arrays for a program (the runner's, mesh-aware);
        `host_shapes`, K's and V's of each KV layer, size the host pool (empty: no
        swapping)."""
        self.pp = pp
        self._put = put
        donate = ("caches",)
        self.copy_fn = Program(self._copy, "copy", store, donate_argnames=donate, fixed=(0,))
        self.gather_fn = Program(self._gather, "gather", store, fixed=(0,))
        self.scatter_fn = Program(
            self._scatter, "scatter", store, donate_argnames=donate, fixed=(0,)
        )
        # Host block 0 is never used (the host pool's ids start at 1) and stays zero:
        # padding rows of a swap-in copy it into the null block. np.zeros maps pages on
        # first touch: the pool costs nothing until swaps fill it.
        self.host_caches: HostCache = [
            (np.zeros(k, kv_dtype), np.zeros(v, kv_dtype)) for k, v in host_shapes
        ]
        # Swap-outs dispatched but not yet written into host_caches: (host ids, blocks).
        self._pending_swap_out: list[tuple[np.ndarray, list[KVCache]]] = []

    @property
    def programs(self) -> tuple[Program, ...]:
        return self.copy_fn, self.gather_fn, self.scatter_fn

    # -- device programs (methods: each runner counts its own compilations) --

    def _blocks(self, ids: Any) -> Any:
        """An index of blocks `ids` into a KV layer: its first axis, or with pipeline
        stages ([pp, blocks, ...]) its second, every stage's."""
        return (slice(None), ids) if self.pp > 1 else ids

    def _copy(self, caches: list[KVCache], src: jax.Array, dst: jax.Array) -> list[KVCache]:
        return self._scatter(caches, dst, self._gather(caches, src))

    def _gather(self, caches: list[KVCache], ids: jax.Array) -> list[KVCache]:
        at = self._blocks(ids)
        return [(k[at], v[at]) for k, v in caches]  # [n, block_size, kv_heads, head_dim]

    def _scatter(
        self, caches: list[KVCache], ids: jax.Array, blocks: list[KVCache]
    ) -> list[KVCache]:
        at = self._blocks(ids)
        return [
            (k.at[at].set(bk), v.at[at].set(bv))
            for (k, v), (bk, bv) in zip(caches, blocks, strict=True)
        ]

    # -- host side --

    def swap_out(self, caches: list[KVCache], pairs: Sequence[tuple[int, int]]) -> None:
        """(device, host) copies of whole blocks: one gather per chunk, queued after every
        step already dispatched (so it reads what they wrote) and before anything this
        step writes; written into host memory when needed (`_flush_swap_out`)."""
        for device_ids, host_ids in _swap_chunks(pairs):
            blocks = self.gather_fn(caches, self._put(device_ids))
            for k, v in blocks:
                k.copy_to_host_async()
                v.copy_to_host_async()
            self._pending_swap_out.append((host_ids, blocks))

    def swap_in(self, caches: list[KVCache], pairs: Sequence[tuple[int, int]]) -> list[KVCache]:
        """(host, device) copies of whole blocks, one scatter per chunk, queued before the
        step's forward; the updated caches."""
        self._flush_swap_out()
        for host_ids, device_ids in _swap_chunks(pairs):
            at = self._blocks(host_ids)
            blocks = [(k[at], v[at]) for k, v in self.host_caches]  # copies
            caches = self.scatter_fn(caches, self._put(device_ids), self._put(blocks))
        return caches

    def settle(self) -> None:
        """Lands every swap-out queued so far in host memory (waits for its gathers)."""
        self._flush_swap_out()

    def _flush_swap_out(self) -> None:
        # Waits for the gathers; by a swap-in's step, the steps they followed are done.
        for host_ids, blocks in self._pending_swap_out:
            real = host_ids != 0
            to, of = self._blocks(host_ids[real]), self._blocks(real)
            for (hk, hv), (k, v) in zip(self.host_caches, blocks, strict=True):
                hk[to] = np.asarray(k)[of]
                hv[to] = np.asarray(v)[of]
        self._pending_swap_out.clear()


def _swap_chunks(pairs: Sequence[tuple[int, int]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The pairs as (first ids, second ids) arrays padded to a SWAP_BUCKETS size with
    (0, 0): padding reads and writes only the null blocks."""
    chunks = []
    largest = SWAP_BUCKETS[-1]
    for lo in range(0, len(pairs), largest):
        chunk = list(pairs[lo : lo + largest])
        chunk += [(0, 0)] * (pick_bucket(len(chunk), SWAP_BUCKETS) - len(chunk))
        first, second = np.array(chunk, np.int32).T
        chunks.append((first, second))
    return chunks
