"""KVCacheManager: block tables, prefix-cache hits and metrics, collisions, copy-on-write."""

import random

import pytest

from jvllm.engine.kv import kv_cache_manager
from jvllm.engine.kv.kv_cache_manager import KVCacheManager
from jvllm.engine.request import Request
from jvllm.sampling_params import SamplingParams

BS = 8


def _request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams())


def _admit(kv: KVCacheManager, request: Request, num_new: int | None = None) -> int:
    """Admit like the scheduler does; returns the number of cached tokens taken."""
    prefix = kv.find_cached_prefix(request)
    num_new = request.num_tokens - prefix.num_tokens if num_new is None else num_new
    assert kv.allocate_slots(request, num_new, prefix)
    request.num_computed_tokens = prefix.num_tokens + num_new
    return prefix.num_tokens


def test_tables_grow_block_by_block():
    kv = KVCacheManager(10, BS, enable_prefix_caching=False)
    request = _request("a", list(range(20)))
    assert kv.allocate_slots(request, 9)
    assert kv.get_block_table("a") == [1, 2]
    request.num_computed_tokens = 9
    assert kv.allocate_slots(request, 7)  # positions 9..15 fit in block 2
    assert kv.get_block_table("a") == [1, 2]
    request.num_computed_tokens = 16
    assert kv.allocate_slots(request, 4)
    assert kv.get_block_table("a") == [1, 2, 3]
    assert kv.num_allocated_blocks == 3


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    big = _request("big", list(range(30)))
    assert not kv.allocate_slots(big, 30, kv.find_cached_prefix(big))
    assert kv.get_block_table("big") == []
    assert kv.block_pool.num_free_blocks == 3
    assert kv.prefix_cache_queries == 0
    assert kv.allocate_slots(big, 24, kv.find_cached_prefix(big))


def test_reserved_tokens_allocate_ahead():
    kv = KVCacheManager(10, BS, enable_prefix_caching=False)
    assert kv.allocate_slots(_request("a", [1, 2, 3]), 3, num_reserved_tokens=40)
    assert len(kv.get_block_table("a")) == 5


def test_prefix_hits_and_metrics_count_tokens():
    kv = KVCacheManager(20, BS, enable_prefix_caching=True)
    prompt = list(range(28))  # 3 full blocks + 4 tokens
    assert _admit(kv, _request("a", prompt)) == 0
    b = _request("b", prompt + [99])
    assert _admit(kv, b) == 24
    assert kv.get_block_table("b")[:3] == kv.get_block_table("a")[:3]
    assert kv.get_block_table("b")[3] != kv.get_block_table("a")[3]
    assert b.num_computed_tokens == 29
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (28 + 29, 24)
    c = _request("c", prompt[:10] + [77] * 20)
    assert _admit(kv, c) == 8
    assert kv.prefix_cache_hits == 32


def test_at_least_one_token_is_computed():
    kv = KVCacheManager(20, BS, enable_prefix_caching=True)
    prompt = list(range(16))
    _admit(kv, _request("a", prompt))
    # Both blocks are cached, but the last token must run to produce a logit.
    assert _admit(kv, _request("b", prompt)) == 8


def test_prefix_caching_off_finds_nothing():
    kv = KVCacheManager(20, BS, enable_prefix_caching=False)
    _admit(kv, _request("a", list(range(24))))
    assert _admit(kv, _request("b", list(range(24)))) == 0
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)


def test_blocks_register_once_full_and_scheduled():
    kv = KVCacheManager(20, BS, enable_prefix_caching=True)
    a = _request("a", list(range(20)))
    _admit(kv, a, num_new=12)  # chunk: block 0 full, block 1 half written
    b = _request("b", list(range(20)))
    assert kv.find_cached_prefix(b).num_tokens == 8
    assert kv.allocate_slots(a, 8)
    assert kv.find_cached_prefix(b).num_tokens == 16


def test_freed_blocks_stay_cached_until_evicted():
    kv = KVCacheManager(5, BS, enable_prefix_caching=True)
    _admit(kv, _request("a", list(range(17))))  # 3 blocks, 2 full and cached
    kv.free("a")
    assert kv.block_pool.num_free_blocks == 4
    assert _admit(kv, _request("b", list(range(17)))) == 16
    kv.free("b")
    # Tail blocks are freed (and so evicted) first; a 3-block request evicts one cached block.
    _admit(kv, _request("c", [50] * 24))
    kv.free("c")
    assert _admit(kv, _request("d", list(range(17)))) == 8


def test_hash_collisions_never_share_wrong_content(monkeypatch):
    monkeypatch.setattr(kv_cache_manager, "hash_block_tokens", lambda parent, tokens: 42)
    kv = KVCacheManager(30, BS, enable_prefix_caching=True)
    x, y, z = [1] * BS, [2] * BS, [3] * BS
    _admit(kv, _request("a", x + y + [0]))
    # Every block hashes alike: only block 0 of "a" is indexed, so "b" (z, then y) must miss.
    assert _admit(kv, _request("b", z + y + [0])) == 0
    assert _admit(kv, _request("c", y + [0])) == 0
    assert _admit(kv, _request("d", x + x + [0])) == 8  # tokens checked per block


def test_collision_on_parent_content_is_caught(monkeypatch):
    # Chained hashes equal for different first blocks: the parent check must reject.
    monkeypatch.setattr(
        kv_cache_manager, "hash_block_tokens", lambda parent, tokens: hash(tuple(tokens))
    )
    kv = KVCacheManager(30, BS, enable_prefix_caching=True)
    x, y, z = [1] * BS, [2] * BS, [3] * BS
    _admit(kv, _request("a", x + y + [0]))
    _admit(kv, _request("b", z + [0]))
    assert _admit(kv, _request("c", z + y + [0])) == 8


def test_fork_shares_blocks_and_copies_on_write():
    kv = KVCacheManager(20, BS, enable_prefix_caching=False)
    prompt = list(range(20))
    source = _request("s", prompt)
    _admit(kv, source)
    used = kv.num_allocated_blocks
    child = _request("c", prompt)
    kv.fork("s", "c", 19)
    assert kv.get_block_table("c") == kv.get_block_table("s")
    assert all(kv.block_pool.ref_count(b) == 2 for b in kv.get_block_table("s"))
    child.num_computed_tokens = 19
    assert kv.allocate_slots(child, 1)
    src_table, child_table = kv.get_block_table("s"), kv.get_block_table("c")
    assert child_table[:2] == src_table[:2] and child_table[2] != src_table[2]
    assert kv.take_blocks_to_copy() == [(src_table[2], child_table[2])]
    assert kv.take_blocks_to_copy() == []
    assert kv.block_pool.ref_count(src_table[2]) == 1
    assert kv.num_allocated_blocks == used + 1  # 3 blocks without sharing


def test_fork_at_a_block_boundary_needs_no_copy():
    kv = KVCacheManager(20, BS, enable_prefix_caching=True)
    prompt = list(range(17))
    _admit(kv, _request("s", prompt))
    child = _request("c", prompt)
    kv.fork("s", "c", 16)
    child.num_computed_tokens = 16
    assert kv.allocate_slots(child, 1)
    assert kv.take_blocks_to_copy() == []
    assert kv.get_block_table("c")[:2] == kv.get_block_table("s")[:2]


def test_copy_on_write_needs_a_free_block():
    kv = KVCacheManager(4, BS, enable_prefix_caching=False)
    _admit(kv, _request("s", list(range(20))))
    child = _request("c", list(range(20)))
    kv.fork("s", "c", 19)
    child.num_computed_tokens = 19
    assert not kv.allocate_slots(child, 1)
    assert kv.take_blocks_to_copy() == []
    kv.free("c")
    assert all(kv.block_pool.ref_count(b) == 1 for b in kv.get_block_table("s"))


def test_free_releases_everything_and_tolerates_unknown_ids():
    kv = KVCacheManager(10, BS, enable_prefix_caching=True)
    _admit(kv, _request("a", list(range(30))))
    kv.free("a")
    kv.free("a")
    kv.free("never-seen")
    assert kv.block_pool.num_free_blocks == 9
    assert all(kv.block_pool.ref_count(b) == 0 for b in range(10))


def test_allocate_slots_rejects_an_empty_step():
    kv = KVCacheManager(10, BS, enable_prefix_caching=False)
    with pytest.raises(AssertionError):
        kv.allocate_slots(_request("a", [1, 2]), 0)


def test_swapped_siblings_copy_their_shared_full_blocks_once():
    kv = KVCacheManager(16, BS, enable_prefix_caching=False, num_host_blocks=8)
    a = _request("a", list(range(1, 21)))  # 20 tokens: two full blocks and four more
    _admit(kv, a)
    b = _request("b", a.prompt_token_ids)
    kv.fork("a", "b", 19)
    b.num_computed_tokens = 19
    shared = kv.get_block_table("a")
    assert kv.get_block_table("b") == shared and len(shared) == 3
    out_a = kv.swap_out(a)
    assert [d for d, _ in out_a] == shared  # every block, the partial one too
    out_b = kv.swap_out(b)
    # b's full blocks share a's host copies; only its partial block is copied.
    assert [d for d, _ in out_b] == [shared[2]]
    host_a, host_b = kv.get_host_blocks("a"), kv.get_host_blocks("b")
    assert [host_a[i] for i in (0, 1)] == [host_b[i] for i in (0, 1)] and host_a[2] != host_b[2]
    assert kv.get_block_table("a") == kv.get_block_table("b") == [0, 0, 0]
    assert kv.block_pool.num_free_blocks == kv.block_pool.num_usable_blocks
    assert kv.host_pool.num_usable_blocks - kv.host_pool.num_free_blocks == 4
    in_a = kv.swap_in(a, 0)
    assert len(in_a) == 3
    in_b = kv.swap_in(b, 0)
    # b shares the full blocks a brought back; its own partial block is copied in.
    assert [h for h, _ in in_b] == [host_b[2]]
    table_a, table_b = kv.get_block_table("a"), kv.get_block_table("b")
    assert table_a[:2] == table_b[:2] and table_a[2] != table_b[2]
    assert all(kv.block_pool.ref_count(blk) == 2 for blk in table_a[:2])
    assert kv.host_pool.num_free_blocks == kv.host_pool.num_usable_blocks
    kv.free("a")
    kv.free("b")
    assert kv.block_pool.num_free_blocks == kv.block_pool.num_usable_blocks


@pytest.mark.parametrize("caching", [False, True])
def test_allocate_slot_matches_allocate_slots_one_token(caching):
    """The decode-row shortcut against the general path, on twin managers driven by the
    same random trace (admissions with shared prefixes, forks that share a partial last
    block, decode steps, frees): the same tables, copies, counts and cache at every step.
    The shortcut's twin takes a slot of its `kv_room` instead, where it has one, as the
    scheduler's steady rows do; that room is always in a block it alone holds."""
    rng = random.Random(7)
    twins = [KVCacheManager(60, BS, enable_prefix_caching=caching) for _ in range(2)]
    live: dict[str, list[Request]] = {}
    for op in range(600):
        kind = rng.random()
        if kind < 0.15 or not live:
            rid = f"r{op}"
            prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 30))]
            pair = [_request(rid, prompt) for _ in twins]
            fits = [
                kv.allocate_slots(r, r.num_tokens, kv.find_cached_prefix(r))
                for kv, r in zip(twins, pair, strict=True)
            ]
            assert fits[0] == fits[1]
            if fits[0]:
                for r in pair:
                    r.num_computed_tokens = r.num_tokens
                live[rid] = pair
        elif kind < 0.25:
            source = rng.choice(sorted(live))
            pair = [_request(f"f{op}", list(r.all_token_ids)) for r in live[source]]
            shared = pair[0].num_tokens - 1
            if shared:
                for kv, r in zip(twins, pair, strict=True):
                    kv.fork(source, r.request_id, shared)
                    r.num_computed_tokens = shared
                live[r.request_id] = pair
        elif kind < 0.35:
            rid = rng.choice(sorted(live))
            for kv in twins:
                kv.free(rid)
            del live[rid]
        else:
            rid = rng.choice(sorted(live))
            token = rng.randrange(3)
            a, b = live[rid]
            if a.num_computed_tokens == a.num_tokens:
                for r in (a, b):
                    r.output_token_ids.append(token)
            if a.kv_room:
                a.kv_room -= 1
                fits = (True, twins[1].allocate_slots(b, 1))
            else:
                fits = (twins[0].allocate_slot(a), twins[1].allocate_slots(b, 1))
            assert fits[0] == fits[1], (op, rid)
            if fits[0]:
                a.num_computed_tokens += 1
                b.num_computed_tokens += 1
        for rid in live:
            assert twins[0].get_block_table(rid) == twins[1].get_block_table(rid), (op, rid)
            if room := live[rid][0].kv_room:  # slots before its own last block's last
                table = twins[0].get_block_table(rid)
                offset = live[rid][0].num_computed_tokens - (len(table) - 1) * BS
                assert twins[0].block_pool.ref_count(table[-1]) == 1, (op, rid)
                assert offset >= 0 and offset + room <= BS - 1, (op, rid, offset, room)
            for kv in twins:  # the persistent array row mirrors the list
                table = kv.get_block_table(rid)
                if table:
                    row = kv.table_array.array[kv.table_array.row(rid)]
                    assert row[: len(table)].tolist() == table, (op, rid)
                    assert not row[len(table) :].any(), (op, rid)
        assert twins[0].take_blocks_to_copy() == twins[1].take_blocks_to_copy(), op
        pools = [kv.block_pool for kv in twins]
        assert pools[0].ref_counts == pools[1].ref_counts, op
        assert pools[0].num_free_blocks == pools[1].num_free_blocks, op
        assert twins[0].prefix_cache_hits == twins[1].prefix_cache_hits, op
    for rid in list(live):
        for kv in twins:
            kv.free(rid)
    assert all(count == 0 for kv in twins for count in kv.block_pool.ref_counts[1:])
    assert not any(kv._room_holders for kv in twins)  # every grant forgotten with its table
