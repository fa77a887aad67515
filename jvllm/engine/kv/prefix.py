"""What a prefix-cache lookup finds, and the chained hash it looks blocks up by.

Owns the hash of one full block given its parent's (`hash_block_tokens`; a hit is
always verified against the block's tokens) and `CachedPrefix`, a request's leading
cached blocks. The lookup itself, and the cache, are `KVCacheManager`'s and
`BlockPool`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from jvllm.engine.kv.host_tier import HostEntry

# Parent hash of every sequence's first block.
ROOT_HASH = 0


def root_hash(lora_int_id: int) -> int:
    """The parent hash of a sequence's first block: ROOT_HASH for the base model, one of
    its own for each LoRA adapter (whose K/V differ for the same tokens)."""
    return ROOT_HASH if lora_int_id == 0 else hash(("lora", lora_int_id))


def root_content_id(lora_int_id: int) -> int:
    """The parent content id a first block is verified against: 0 (the block pool's
    ROOT_CONTENT_ID) for the base model, -id for adapter `id`, so that even a hash
    collision never hands one adapter's K/V to another."""
    return -lora_int_id


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Chained hash of one full block. It only indexes the cache: hits are verified."""
    return hash((parent_hash, tuple(token_ids)))


class CachedPrefix(NamedTuple):
    """The leading full blocks of a request found in the prefix cache.

    A block found in the host tier has NULL_BLOCK in `block_ids` and its entry in
    `host_hits` (table index -> entry): allocation brings it back into a new block.
    """

    block_ids: list[int]
    content_ids: list[int]
    num_tokens: int
    host_hits: dict[int, HostEntry] = {}


EMPTY_PREFIX = CachedPrefix([], [], 0)
