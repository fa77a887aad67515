"""Reference paged attention in pure jax.numpy.

The contract every attention backend implements, over a flattened ragged batch of
S sequences and T new tokens:

- q `[T, Hq, D]`: queries of the new tokens, sequence by sequence
  (`query_start_loc[s]:query_start_loc[s+1]` belong to sequence s);
- k_cache, v_cache `[num_blocks, block_size, Hkv, D]`: one layer's cache, already
  holding this step's new K/V (see `write_kv`);
- block_tables `[S, W]`: physical block of each sequence's logical block;
- seq_lens `[S]`: tokens in the cache for each sequence after this step.

The new tokens of sequence s are its last `q_len` positions, so query i sits at
position `seq_lens[s] - q_len + i` and attends to keys at positions <= its own
(and, with a sliding window, > position - window). Tokens past
`query_start_loc[-1]` are padding: their output is finite and unused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# A finite mask value keeps fully masked (padding) rows free of NaN.
MASK_VALUE = -1e30
# Queries handled per gathered tile: bounds the [tile, W * block_size, Hkv, D] gather.
QUERY_TILE = 16


def write_kv(
    k_cache: jax.Array,  # [N, BS, Hkv, D]
    v_cache: jax.Array,  # [N, BS, Hkv, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # [T] int32, block * BS + offset; padding -> null block 0
) -> tuple[jax.Array, jax.Array]:
    """Scatters each new token's K/V into its slot (in place when the cache is donated)."""
    n, bs, hkv, d = k_cache.shape
    k_flat = k_cache.reshape(n * bs, hkv, d).at[slot_mapping].set(k.astype(k_cache.dtype))
    v_flat = v_cache.reshape(n * bs, hkv, d).at[slot_mapping].set(v.astype(v_cache.dtype))
    return k_flat.reshape(n, bs, hkv, d), v_flat.reshape(n, bs, hkv, d)


def token_metadata(
    num_tokens: int, query_start_loc: jax.Array, seq_lens: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Sequence index and absolute position of each query token, both `[T]` int32."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    num_seqs = seq_lens.shape[0]
    seq_idx = jnp.searchsorted(query_start_loc[1:], t, side="right").astype(jnp.int32)
    seq_idx = jnp.minimum(seq_idx, num_seqs - 1)
    q_start = query_start_loc[seq_idx]
    q_len = query_start_loc[seq_idx + 1] - q_start
    position = seq_lens[seq_idx] - q_len + (t - q_start)
    return seq_idx, position


def paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,  # [N, BS, Hkv, D]
    v_cache: jax.Array,  # [N, BS, Hkv, D]
    block_tables: jax.Array,  # [S, W] int32
    seq_lens: jax.Array,  # [S] int32
    query_start_loc: jax.Array,  # [S + 1] int32
    scale: float,
    sliding_window: int | None = None,
) -> jax.Array:  # [T, Hq, D]
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    seq_idx, position = token_metadata(num_tokens, query_start_loc, seq_lens)
    valid = jnp.arange(num_tokens) < query_start_loc[-1]
    tile = min(QUERY_TILE, num_tokens)
    pad = -num_tokens % tile
    num_tiles = (num_tokens + pad) // tile

    def tiled(x: jax.Array) -> jax.Array:
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(num_tiles, tile, *x.shape[1:])

    key_pos = jnp.arange(block_tables.shape[1] * block_size, dtype=jnp.int32)  # [L]

    def one_tile(args: tuple[jax.Array, ...]) -> jax.Array:
        q_t, seq_t, pos_t, valid_t = args  # [tile, Hq, D], [tile], [tile], [tile]
        blocks = block_tables[seq_t]  # [tile, W]
        k = k_cache[blocks].reshape(tile, -1, num_kv_heads, head_dim)  # [tile, L, Hkv, D]
        v = v_cache[blocks].reshape(tile, -1, num_kv_heads, head_dim)
        qg = q_t.reshape(tile, num_kv_heads, group, head_dim).astype(jnp.float32)
        scores = jnp.einsum("tkgd,tlkd->tkgl", qg, k.astype(jnp.float32)) * scale
        mask = (key_pos[None, :] <= pos_t[:, None]) & valid_t[:, None]  # [tile, L]
        if sliding_window is not None:
            mask &= key_pos[None, :] > pos_t[:, None] - sliding_window
        scores = jnp.where(mask[:, None, None, :], scores, MASK_VALUE)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("tkgl,tlkd->tkgd", probs, v.astype(jnp.float32))
        return out.reshape(tile, num_heads, head_dim).astype(q.dtype)

    out = jax.lax.map(one_tile, (tiled(q), tiled(seq_idx), tiled(position), tiled(valid)))
    return out.reshape(num_tiles * tile, num_heads, head_dim)[:num_tokens]
