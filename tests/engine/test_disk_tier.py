"""DiskPrefixTier and FsBlockStore without an engine: the LRU bound, writes that are not
hits yet, reads into reserved host-tier blocks, and the file checks."""

from __future__ import annotations

import pytest

from jvllm.engine.kv.block_pool import BlockPool, CachedBlock
from jvllm.engine.kv.disk_tier import DiskPrefixTier
from jvllm.engine.kv.host_tier import HostPrefixTier
from jvllm.engine.kv.prefix import EMPTY_PREFIX, ROOT_HASH, hash_block_tokens
from jvllm.engine.step_io import KVIODone
from jvllm.kv_offload.fs_store import HEADER, FsBlockStore, layout_fingerprint
from jvllm.kv_offload.socket_transfer import BlockReceiver, MemoryBlockStore, SocketSender

FP = layout_fingerprint({"model": "m", "dtype": "float32"})


def _tier(max_blocks: int, present=()) -> tuple[DiskPrefixTier, HostPrefixTier]:
    host = HostPrefixTier(range(1, 5))
    return DiskPrefixTier(FP, max_blocks, present, host, BlockPool(8)), host


def _chain(n: int) -> list[tuple[int, tuple[int, ...]]]:
    keys, parent = [], ROOT_HASH
    for i in range(n):
        tokens = (i, i + 1)
        parent = hash_block_tokens(parent, tokens)
        keys.append((parent, tokens))
    return keys


def test_written_blocks_are_hits_only_once_written_and_lru_bounded():
    tier, _ = _tier(max_blocks=2)
    chain = _chain(3)
    for i, (block_hash, tokens) in enumerate(chain):
        tier.save(CachedBlock(i + 1, block_hash, i + 1, i, tokens), host_block=i + 1)
    ops = tier.take_ops()
    assert [h for h, _ in ops.writes] == [1, 2, 3]
    # Still being written: not a hit, so no read-ahead and no wait.
    assert not tier.read_ahead("r", EMPTY_PREFIX, chain)
    tier.complete([KVIODone(key, False, True) for _, key in ops.writes])
    assert tier.num_blocks == 2
    assert tier.take_ops().deletes == [ops.writes[0][1]]  # the least recently used


def test_read_ahead_reserves_host_blocks_and_publishes_on_completion():
    keys = [_tier(1)[0].key(h, t) for h, t in _chain(3)]
    tier, host = _tier(max_blocks=8, present=keys)
    chain = _chain(3)
    assert tier.still_waiting("r") is None
    assert tier.read_ahead("r", EMPTY_PREFIX, chain)
    reads = tier.take_ops().reads
    assert [k for k, _ in reads] == keys
    assert tier.still_waiting("r") is True
    # Block 1's file turned out torn: a miss, dropped from the index.
    done = [KVIODone(keys[0], True, True), KVIODone(keys[1], True, False)]
    tier.complete(done + [KVIODone(keys[2], True, True)])
    assert tier.still_waiting("r") is False and tier.still_waiting("r") is False
    assert tier.num_read_blocks == 2 and tier.num_failed_reads == 1 and tier.num_blocks == 2
    first = host.lookup(chain[0][0], 0, chain[0][1])
    assert first is not None and first.host_block == reads[0][1]
    assert host.lookup(chain[1][0], first.content_id, chain[1][1]) is None
    assert reads[1][1] in host.free_block_ids()


def test_block_files_check_magic_key_layout_length_and_checksum(tmp_path):
    store = FsBlockStore(tmp_path, FP)
    key, other = "ab" * 32, "cd" * 32
    payload = bytes(range(256)) * 4
    store.save_block(key, payload)
    assert store.scan() == [key] and store.load_block(key, len(payload)) == payload
    assert FsBlockStore(tmp_path, layout_fingerprint({"model": "n"})).scan() == []
    assert store.load_block(key, len(payload) + 1) is None and not store.lookup(key)
    for damage in (lambda d: d[: len(d) - 3], lambda d: d[:20] + b"x" + d[21:]):
        store.save_block(key, payload)
        path = store.path(key)
        path.write_bytes(damage(path.read_bytes()))
        assert store.load_block(key, len(payload)) is None and not path.exists()
    store.save_block(key, payload)
    store.path(key).rename(store.path(other))  # a file under another key's name
    assert store.load_block(other, len(payload)) is None
    store.save_block(key, payload)
    data = bytearray(store.path(key).read_bytes())
    data[HEADER.size + 7] ^= 1
    store.path(key).write_bytes(bytes(data))
    assert store.load_block(key, len(payload)) is None
    (store.directory / f"{key}.kv.tmp1.2").write_bytes(b"torn")
    assert store.scan() == [] and list(store.directory.iterdir()) == []


def test_new_weights_forget_old_blocks_and_reads_in_flight():
    chain = _chain(2)
    keys = [_tier(1)[0].key(h, t) for h, t in chain]
    tier, host = _tier(max_blocks=8, present=keys)
    assert tier.read_ahead("r", EMPTY_PREFIX, chain[:1])
    reads = tier.take_ops().reads
    tier.new_weights()
    assert tier.take_ops().deletes == keys[1:]  # the one being read goes when it is done
    assert tier.key(*chain[0]) != keys[0] and tier.num_blocks == 0
    tier.complete([KVIODone(keys[0], True, True)])  # read with the old weights' K/V
    assert host.lookup(chain[0][0], 0, chain[0][1]) is None
    assert reads[0][1] in host.free_block_ids() and tier.num_read_blocks == 0
    assert tier.take_ops().deletes == keys[:1]


def test_socket_transfer_checks_every_frame():
    """Blocks sent as header + raw bytes arrive intact and announced; a frame of another
    layout is refused (no K/V stored) and the sender told so."""
    store, announced = MemoryBlockStore(), []
    receiver = BlockReceiver("127.0.0.1", 0, FP, 64, store, announced.append)
    try:
        sender = SocketSender("127.0.0.1", receiver.port, FP)
        payload = bytes(range(64))
        sender.save_block("ab" * 32, payload)
        assert announced == ["ab" * 32] and store.load_block("ab" * 32, 64) == payload
        other = SocketSender("127.0.0.1", receiver.port, layout_fingerprint({"model": "n"}))
        with pytest.raises(OSError, match="refused block"):
            other.save_block("cd" * 32, payload)
        assert not store.lookup("cd" * 32) and receiver.num_rejected_blocks == 1
        sender.close()
    finally:
        receiver.close()
