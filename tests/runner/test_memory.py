"""The KV-cache sizing rule (jvllm.runner.memory)."""

from __future__ import annotations

import ctypes
import platform

import pytest

from jvllm.models.spec import spec_from_hf_config
from jvllm.runner import memory

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"],
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
)


def test_an_8b_block_is_two_mib_and_splits_over_tp():
    spec = spec_from_hf_config(LLAMA3_8B)
    assert memory.kv_block_bytes(spec, 16, 2, 1) == 2 << 20  # 2 x 32 layers x 16 x 8 x 128 x 2
    assert memory.kv_block_bytes(spec, 16, 2, 4) == 512 << 10


def test_blocks_fill_the_budget_up_to_what_sequences_can_use():
    block = 1 << 20
    budget = memory.gpu_budget(100 * block, 20 * block, 0.5, 10 * block).kv_bytes
    assert budget == 20 * block  # 0.5 x 100 - 20 in use - 10 reserve
    size = memory.kv_cache_size(budget, block, 16, max_num_seqs=4, max_model_len=1024)
    assert size == memory.KVCacheSize(20, 16, block)  # the null block within the budget
    assert size.num_tokens == 19 * 16
    capped = memory.kv_cache_size(budget, block, 16, max_num_seqs=1, max_model_len=64)
    assert capped.num_blocks == 4 + 1
    assert memory.kv_cache_size(-budget, block, 16, 4, 1024).num_blocks == 1


def test_the_budget_is_of_the_whole_device_within_the_allocators_cap():
    """vLLM's rule: utilization of the device's total, less what is in use and the
    reserve; an allocator set by someone else (or short of memory) lowers the limit."""
    gib = memory.GIB
    b = memory.gpu_budget(140 * gib, 16 * gib, 0.9, 3 * gib)
    assert (b.limit, b.kv_bytes) == (int(140 * gib * 0.9), int(140 * gib * 0.9) - 19 * gib)
    capped = memory.gpu_budget(140 * gib, 16 * gib, 0.9, 3 * gib, allocator_cap=105 * gib)
    assert capped.limit == 105 * gib and capped.kv_bytes == 86 * gib
    assert memory.gpu_budget(140 * gib, 16 * gib, 0.1, 3 * gib).kv_bytes < 0


def test_the_start_up_line_names_every_figure():
    gib = memory.GIB
    budget = memory.gpu_budget(140 * gib, 17 * gib, 0.9, 3 * gib)
    size = memory.kv_cache_size(budget.kv_bytes, 2 << 20, 16, 256, 8192)
    line = memory.startup_line(budget, 16 * gib, size, "measured")
    assert line == (
        "Device memory: total 140.00 GiB, gpu_memory_utilization 0.90 -> limit 126.00 GiB; "
        "weights 16.00 GiB (other arrays 1.00 GiB); step reserve 3.00 GiB (measured); "
        "KV cache 106.00 GiB (54272 blocks of 16, one the null block) = 868,336 tokens"
    )
    assert size.num_tokens == 54271 * 16  # 106 GiB of 2 MiB blocks, one the null block


def test_reserve_is_four_float32_logits_arrays():
    assert memory.activation_reserve(2048, 128256) == 4 * 2048 * 128256 * 4


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",  # bytes the heap holds from the kernel (sbrk)
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",  # bytes in blocks mapped on their own (mmap)
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",  # free bytes the heap keeps
            "keepcost",
        )
    ]


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc"
)
def test_freed_host_memory_is_kept_in_the_heap_for_the_next_step():
    """A 48 MiB block (over glibc's 32 MiB mapping limit) comes from the heap once the
    settings apply, and the heap keeps it when freed: the next one lands where it was,
    in pages already faulted in."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("glibc older than 2.33")
    libc.mallinfo2.restype = _MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    size = 48 << 20
    assert memory.retain_freed_host_memory()  # what a runner on CPU devices calls
    mapped_before = libc.mallinfo2().hblkhd
    first = libc.malloc(size)
    assert first
    assert libc.mallinfo2().hblkhd == mapped_before  # not a mapping of its own
    libc.free(first)
    assert libc.mallinfo2().fordblks >= size  # kept, not trimmed
    second = libc.malloc(size)
    libc.free(second)
    assert second == first


def test_retaining_freed_memory_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(memory.DISABLE_HEAP_RETAIN_ENV, "0")
    assert memory.retain_freed_host_memory.__wrapped__() is False
