"""KV-cache sizing: how many cache blocks fit in what a device has left.

Owns the arithmetic of vLLM's sizing rule: the engine may use `gpu_memory_utilization`
of the device's memory; the weights are already there; a reserve is kept for one step's
activations; the KV cache gets the rest, in whole blocks, never more blocks than every
sequence at full length could use. It reads no device: the caller passes the numbers (a
GPU's `memory_stats()` at start-up, or a compile-only device's memory size and compiled
programs in tests/gpu_compile), so the same rule is checked without a GPU.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
from typing import NamedTuple

from jvllm.models.spec import ModelSpec

logger = logging.getLogger(__name__)


class KVCacheSize(NamedTuple):
    num_blocks: int  # blocks to allocate, the null block 0 included
    block_size: int  # tokens per block
    block_bytes: int  # one block's K and V over every layer, on one device

    @property
    def num_tokens(self) -> int:
        """Tokens the cache holds for requests (vLLM's "GPU KV cache size: N tokens")."""
        return (self.num_blocks - 1) * self.block_size


def kv_block_bytes(spec: ModelSpec, block_size: int, itemsize: int, tp: int) -> int:
    """Bytes of one block on one device; each of the `tp` devices holds its KV heads only.

    `spec` is the model as built (KV heads already replicated up to `tp` where fewer)."""
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * itemsize // tp


def activation_reserve(max_num_batched_tokens: int, vocab_size: int) -> int:
    """Bytes kept back for one step's activations: four float32 `[T, V]` arrays.

    At the largest bucket the logits-sized arrays dominate (every token's log-softmax
    for prompt logprobs, the sampler's copies); tests/gpu_compile checks this bound
    against the compiled programs' temporaries and outputs for an 8B model on an H200."""
    return 4 * max_num_batched_tokens * vocab_size * 4


def gpu_budget(bytes_limit: int, bytes_in_use: int, utilization: float, reserve: int) -> int:
    """Bytes left for the KV cache on one device."""
    return int(bytes_limit * utilization) - bytes_in_use - reserve


def kv_cache_size(
    budget_bytes: int, block_bytes: int, block_size: int, max_num_seqs: int, max_model_len: int
) -> KVCacheSize:
    """Whole blocks within the budget, capped at what every sequence at full length uses."""
    useful = max_num_seqs * math.ceil(max_model_len / block_size)
    fitting = max(0, budget_bytes // block_bytes)
    return KVCacheSize(min(fitting, useful) + 1, block_size, block_bytes)  # + the null block


GIB = 1 << 30


def host_block_count(swap_space_gib: float, block_bytes: int) -> int:
    """Host blocks in `swap_space_gib` GiB per device (vLLM's swap_space): a host block
    holds a whole block, every device's KV heads, so `block_bytes` is one device's."""
    return int(swap_space_gib * GIB) // block_bytes


def available_host_bytes() -> int:
    """Host memory available to this process now (MemAvailable, else free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Host allocations up to this size come from the heap and stay there once freed.
HEAP_RETAIN_BYTES = GIB
DISABLE_HEAP_RETAIN_ENV = "JVLLM_CPU_RETAIN_FREED_MEMORY"


@functools.cache
def retain_freed_host_memory() -> bool:
    """Makes glibc's malloc keep freed blocks of up to `HEAP_RETAIN_BYTES` for reuse,
    instead of handing each back to the kernel. Called once a process by a runner on CPU
    devices, where XLA allocates every program's temporaries at every call: glibc maps
    any block over 32 MiB afresh and unmaps it when freed, so each call faulted in and
    zeroed every page again (the sampler at 256 rows of an 8192 vocabulary: 16.5 ms
    greedy, 2.7 ms with this; `bench/sampler.py`). The heap keeps the step's peak, which
    the next step needs anyway. `JVLLM_CPU_RETAIN_FREED_MEMORY=0` leaves malloc alone.
    Returns whether the settings were applied (not on other C libraries)."""
    if os.environ.get(DISABLE_HEAP_RETAIN_ENV, "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    applied = bool(mallopt(_M_MMAP_THRESHOLD, HEAP_RETAIN_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, HEAP_RETAIN_BYTES)
    )
    if not applied:
        logger.info("malloc left as it was: mallopt refused a %d-byte threshold", HEAP_RETAIN_BYTES)
    return applied
