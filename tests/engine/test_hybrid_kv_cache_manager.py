"""HybridKVCacheManager: a sliding group freed behind the window, shared pool, forks."""

import pytest

from jvllm.engine.kv.block_pool import NULL_BLOCK
from jvllm.engine.kv.hybrid_kv_cache_manager import HybridKVCacheManager
from jvllm.engine.request import Request
from jvllm.sampling_params import SamplingParams

BS, WINDOW, MAX_LEN = 4, 6, 64


def _run(kv: HybridKVCacheManager, request: Request, num_new: int) -> None:
    assert kv.allocate_slots(request, num_new)
    request.num_computed_tokens += num_new


def test_sliding_blocks_left_behind_are_freed_as_decoding_advances():
    kv = HybridKVCacheManager(40, BS, WINDOW, MAX_LEN)
    request = Request("a", list(range(20)), SamplingParams())
    _run(kv, request, 12)  # positions 0..11
    _run(kv, request, 8)  # 12..19: the first query (12) reads back to 7, block 1
    sliding = kv.get_sliding_block_table("a")
    assert sliding[:1] == [NULL_BLOCK] and all(sliding[1:])
    for _ in range(30):  # decode to position 49
        request.output_token_ids.append(7)
        _run(kv, request, 1)
        # Positions (next - 6, next]: never more than ceil(6 / 4) + 1 blocks.
        assert kv.num_sliding_blocks("a") <= -(-WINDOW // BS) + 1
    assert len(kv.get_block_table("a")) == 13  # the full group keeps everything
    held = 13 + kv.num_sliding_blocks("a")
    assert kv.num_allocated_blocks == held
    row = kv.table_array.array[kv.table_array.row("a")]
    assert list(row[: kv.width][:13]) == kv.get_block_table("a")
    assert list(row[kv.width :][:13]) == kv.get_sliding_block_table("a")
    kv.free("a")
    assert kv.num_allocated_blocks == 0 and not kv.table_array.array.any()


def test_allocation_counts_both_groups_and_fails_changing_nothing():
    kv = HybridKVCacheManager(6, BS, WINDOW, MAX_LEN)  # 5 usable blocks
    request = Request("a", list(range(12)), SamplingParams())
    assert not kv.allocate_slots(request, 12)  # 3 full + 3 sliding blocks
    assert kv.num_allocated_blocks == 0
    _run(kv, request, 8)  # 2 + 2
    assert kv.num_allocated_blocks == 4
    assert not kv.allocate_slots(request, 4)  # one full block more, one sliding: 6 > 5
    assert len(kv.get_block_table("a")) == len(kv.get_sliding_block_table("a")) == 2


def test_forked_child_shares_both_groups_and_copies_on_write():
    kv = HybridKVCacheManager(40, BS, WINDOW, MAX_LEN)
    source = Request("a", list(range(14)), SamplingParams())
    _run(kv, source, 14)
    child = Request("b", list(range(14)), SamplingParams())
    kv.fork("a", "b", 13)
    child.num_computed_tokens = 13
    assert kv.get_sliding_block_table("b") == kv.get_sliding_block_table("a")
    _run(kv, child, 1)  # position 13 lands in the shared last block of both groups
    copies = kv.take_blocks_to_copy()
    assert len(copies) == 2
    assert kv.get_sliding_block_table("b")[-1] != kv.get_sliding_block_table("a")[-1]
    kv.free("a")
    kv.free("b")
    assert kv.num_allocated_blocks == 0


def test_a_pool_too_small_for_one_sequence_and_its_window_is_refused():
    from jvllm.config import CacheConfig
    from jvllm.engine.kv.hybrid_kv_cache_manager import new_kv_cache_manager

    cache = CacheConfig(block_size=8, enable_prefix_caching=False)
    # 8 full blocks for 64 tokens, 2 + 1 sliding ones for a window of 12, the null block.
    kv = new_kv_cache_manager(cache, MAX_LEN, 12, 0, 0, 0, 12)
    assert isinstance(kv, HybridKVCacheManager)
    with pytest.raises(ValueError, match="num_blocks=11 .* needs 12 blocks"):
        new_kv_cache_manager(cache, MAX_LEN, 11, 0, 0, 0, 12)


def test_a_child_forks_only_while_its_source_holds_the_window_it_reads():
    """A sibling admitted after its source decoded past the window would read freed
    sliding blocks: can_fork says no, and the scheduler then prefills it instead."""
    kv = HybridKVCacheManager(40, BS, WINDOW, MAX_LEN)
    source = Request("a", list(range(14)), SamplingParams())
    _run(kv, source, 14)
    assert kv.can_fork("a", 13)  # the prompt just computed: blocks 2 and 3 held
    for _ in range(8):  # decode to position 21: blocks up to 3 leave the window
        source.output_token_ids.append(7)
        _run(kv, source, 1)
    assert NULL_BLOCK in kv.get_sliding_block_table("a")[2:4]
    assert not kv.can_fork("a", 13)
    assert not kv.can_fork("gone", 13)
