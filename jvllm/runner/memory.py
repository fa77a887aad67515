"""KV-cache sizing: how many cache blocks fit in what a device has left.

Owns the arithmetic of vLLM's sizing rule: the engine may use `gpu_memory_utilization`
of the device's total memory (never more than XLA's allocator lets this process have);
what is already in use there (the weights, and any arrays a JAX program made before
the engine) and a reserve for one step's temporaries (measured from the compiled
programs, `jvllm.runner.aot.measure_step_reserve`) come off it; the KV cache gets the
rest, in whole blocks, never more blocks than every sequence at full length could use;
and the start-up line that reports it all. It reads no device: the caller passes the
numbers (a GPU's `memory_stats()` at start-up, or a compile-only device's memory size
and compiled programs in tests/gpu_compile), so the same rule is checked without a GPU.
Setting XLA's allocator is `jvllm.runner.xla_allocator`'s.
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

GIB = 1 << 30


class KVCacheSize(NamedTuple):
    num_blocks: int  # blocks to allocate, the null block 0 included
    block_size: int  # tokens per block
    block_bytes: int  # one block's K and V over every layer, on one device

    @property
    def num_tokens(self) -> int:
        """Tokens the cache holds for requests (vLLM's "GPU KV cache size: N tokens")."""
        return (self.num_blocks - 1) * self.block_size


def kv_block_bytes(spec: ModelSpec, block_size: int, itemsize: int, tp: int) -> int:
    """Bytes of one block on one device; each of the `tp` devices holds its KV heads only
    (a latent-attention cache, one shared head, is whole on every device).

    `spec` is the model as built (KV heads already replicated up to `tp` where fewer)."""
    heads, k_dim, v_dim = spec.kv_cache_dims
    split = tp if spec.kv_cache_split else 1
    return spec.num_layers * block_size * heads * (k_dim + v_dim) * itemsize // split


def activation_reserve(max_num_batched_tokens: int, vocab_size: int) -> int:
    """An estimate of one step's temporaries, four float32 `[T, V]` arrays, for where
    the compiled programs cannot be measured (pipeline stages, offloaded weights).

    At the largest bucket the logits-sized arrays dominate (every token's log-softmax
    for prompt logprobs, the sampler's copies); tests/gpu_compile compares it with the
    measured reserve of an 8B model on an H200."""
    return 4 * max_num_batched_tokens * vocab_size * 4


class DeviceBudget(NamedTuple):
    """One device's memory at start-up, as the sizing rule sees it (bytes)."""

    total: int  # the device's memory
    utilization: float  # gpu_memory_utilization
    limit: int  # what the engine may use: total x utilization, within the allocator's cap
    in_use: int  # arrays already on the device: the weights, and any made before
    reserve: int  # one step's temporaries and fresh outputs

    @property
    def kv_bytes(self) -> int:
        """Bytes left for the KV cache (negative: not even the weights fit)."""
        return self.limit - self.in_use - self.reserve


def gpu_budget(
    total: int, in_use: int, utilization: float, reserve: int, allocator_cap: int | None = None
) -> DeviceBudget:
    """vLLM's rule: `total x utilization - in_use - reserve` for the KV cache, where
    `allocator_cap` (XLA's `bytes_limit`, or its preallocated pool) may lower the limit
    when the allocator was set by someone else or got less from the driver."""
    limit = int(total * utilization)
    if allocator_cap is not None:
        limit = min(limit, allocator_cap)
    return DeviceBudget(total, utilization, limit, in_use, reserve)


def startup_line(budget: DeviceBudget, weights: int, size: KVCacheSize, reserve_how: str) -> str:
    """The one start-up line, as vLLM's: device total, utilization, weights (and other
    arrays in use), the KV cache, the reserve, and the KV tokens that results."""
    gib = lambda n: f"{n / GIB:.2f} GiB"
    kv = size.num_blocks * size.block_bytes
    return (
        f"Device memory: total {gib(budget.total)}, gpu_memory_utilization "
        f"{budget.utilization:.2f} -> limit {gib(budget.limit)}; weights {gib(weights)} "
        f"(other arrays {gib(max(0, budget.in_use - weights))}); step reserve "
        f"{gib(budget.reserve)} ({reserve_how}); KV cache {gib(kv)} ({size.num_blocks} "
        f"blocks of {size.block_size}, one the null block) = {size.num_tokens:,} tokens"
    )


def kv_cache_size(
    budget_bytes: int, block_bytes: int, block_size: int, max_num_seqs: int, max_model_len: int
) -> KVCacheSize:
    """Whole blocks within the budget, the null block among them, capped at what every
    sequence at full length uses (plus the null block); at least the null block."""
    useful = max_num_seqs * math.ceil(max_model_len / block_size)
    fitting = max(1, budget_bytes // block_bytes)
    return KVCacheSize(min(fitting, useful + 1), block_size, block_bytes)


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
