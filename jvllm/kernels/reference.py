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

Two optional variants change the softmax, in every backend alike:
- `soft_cap` (Gemma 2): each logit `scale * q.k` becomes `cap * tanh(logit / cap)`
  before masking;
- `sinks` `[Hq]` (gpt-oss): one learned logit per query head joins the softmax's
  denominator only (`exp(sink)` is added to the sum; it has no value row).
A custom softmax scale (Gemma's `query_pre_attn_scalar ** -0.5`) is just `scale`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# A finite mask value keeps fully masked (padding) rows free of NaN.
MASK_VALUE = -1e30
# Queries of one sequence handled together: one matrix product per key chunk.
QUERY_TILE = 8
# Keys visited per inner-loop iteration.
KEY_CHUNK = 128
# Work items vectorised together per sequential step.
ITEM_BATCH = 64


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


class _Items(NamedTuple):
    """Work items: up to `tile` consecutive queries of one sequence each."""

    seq: jax.Array  # [I] sequence of each item
    start: jax.Array  # [I] first query row
    valid: jax.Array  # [I] False for items past the real work


def _leading_decodes(query_start_loc: jax.Array) -> jax.Array:
    """How many sequences at the front of the batch run exactly one query (decodes);
    the runner orders rows that way."""
    q_len = query_start_loc[1:] - query_start_loc[:-1]
    return jnp.sum(jnp.cumprod(q_len == 1)).astype(jnp.int32)


def _decode_items(query_start_loc: jax.Array, num_decodes: jax.Array) -> _Items:
    seq = jnp.arange(query_start_loc.shape[0] - 1, dtype=jnp.int32)
    return _Items(seq, query_start_loc[:-1], seq < num_decodes)


def _prefill_items(num_tokens: int, query_start_loc: jax.Array, num_decodes: jax.Array) -> _Items:
    num_seqs = query_start_loc.shape[0] - 1
    q_len = query_start_loc[1:] - query_start_loc[:-1]
    per_seq = (q_len + QUERY_TILE - 1) // QUERY_TILE
    per_seq = jnp.where(jnp.arange(num_seqs) < num_decodes, 0, per_seq)
    ends = jnp.cumsum(per_seq)
    # Each sequence wastes at most one partial tile: a static bound on the item count.
    count = -(-num_tokens // QUERY_TILE) + num_seqs
    i = jnp.arange(count, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, i, side="right"), num_seqs - 1).astype(jnp.int32)
    start = query_start_loc[seq] + (i - (ends[seq] - per_seq[seq])) * QUERY_TILE
    return _Items(seq, start, i < ends[-1])


def paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,  # [N, BS, Hkv, D]
    v_cache: jax.Array,  # [N, BS, Hkv, D]
    block_tables: jax.Array,  # [S, W] int32
    seq_lens: jax.Array,  # [S] int32
    query_start_loc: jax.Array,  # [S + 1] int32
    scale: float,
    sliding_window: int | None = None,
    *,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,  # [Hq]
) -> jax.Array:  # [T, Hq, D]
    """Flash-style: per item, an online softmax over key chunks of the item's own
    sequence, so the work follows each sequence's real length, not the table width.
    Leading decode rows are one-query items; the rest go in tiles of QUERY_TILE."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    chunk_blocks = max(1, KEY_CHUNK // block_size)
    chunk = chunk_blocks * block_size
    width = block_tables.shape[1]
    tables = jnp.pad(block_tables, ((0, 0), (0, -width % chunk_blocks)))
    q_pad = jnp.pad(q, ((0, QUERY_TILE), (0, 0), (0, 0)))  # windows never run off the end

    def run_items(items: _Items, tile: int) -> tuple[jax.Array, jax.Array]:
        def one_item(item: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
            s, start, valid = item
            rows = start + jnp.arange(tile, dtype=jnp.int32)  # [Qt]
            row_ok = valid & (rows < query_start_loc[s + 1])
            pos = seq_lens[s] - query_start_loc[s + 1] + rows  # seq_len - q_len + offset
            qi = jax.lax.dynamic_slice_in_dim(q_pad, start, tile).astype(jnp.float32)
            qi = qi.reshape(tile, num_kv_heads, group, head_dim) * scale

            def body(c: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
                m, denom, acc = carry  # [Hkv, G, Qt], [Hkv, G, Qt], [Hkv, G, Qt, D]
                blocks = jax.lax.dynamic_slice_in_dim(tables[s], c * chunk_blocks, chunk_blocks)
                k = k_cache[blocks].reshape(chunk, num_kv_heads, head_dim).astype(jnp.float32)
                v = v_cache[blocks].reshape(chunk, num_kv_heads, head_dim).astype(jnp.float32)
                key_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
                mask = (key_pos[None, :] <= pos[:, None]) & row_ok[:, None]  # [Qt, C]
                if sliding_window is not None:
                    mask &= key_pos[None, :] > pos[:, None] - sliding_window
                scores = jnp.einsum("qkgd,ckd->kgqc", qi, k)
                if soft_cap:
                    scores = soft_cap * jnp.tanh(scores / soft_cap)
                scores = jnp.where(mask, scores, MASK_VALUE)
                m_new = jnp.maximum(m, scores.max(-1))
                p = jnp.exp(scores - m_new[..., None])
                correction = jnp.exp(m - m_new)
                denom = denom * correction + p.sum(-1)
                acc = acc * correction[..., None] + jnp.einsum("kgqc,ckd->kgqd", p, v)
                return m_new, denom, acc

            shape = (num_kv_heads, group, tile)
            init = (
                jnp.full(shape, MASK_VALUE, jnp.float32),
                jnp.zeros(shape, jnp.float32),
                jnp.zeros((*shape, head_dim), jnp.float32),
            )
            if sinks is not None:  # the sink starts the running max, with weight exp(0)
                sink = sinks.astype(jnp.float32).reshape(num_kv_heads, group, 1)
                init = (jnp.broadcast_to(sink, shape), jnp.ones(shape, jnp.float32), init[2])
            num_chunks = jnp.where(valid, (seq_lens[s] + chunk - 1) // chunk, 0)
            _, denom, acc = jax.lax.fori_loop(0, num_chunks, body, init)
            out = acc / jnp.maximum(denom, 1e-30)[..., None]  # [Hkv, G, Qt, D]
            out = out.transpose(2, 0, 1, 3).reshape(tile, num_heads, head_dim)
            return out.astype(q.dtype), jnp.where(row_ok, rows, num_tokens)

        # Items in vectorised batches: few sequential iterations, each a wide body.
        outs, rows = jax.lax.map(one_item, tuple(items), batch_size=ITEM_BATCH)
        return outs.reshape(-1, num_heads, head_dim), rows.reshape(-1)

    num_decodes = _leading_decodes(query_start_loc)
    dec_out, dec_rows = run_items(_decode_items(query_start_loc, num_decodes), 1)
    pre_items = _prefill_items(num_tokens, query_start_loc, num_decodes)
    pre_out, pre_rows = run_items(pre_items, QUERY_TILE)
    # Every real query row belongs to exactly one item; the rest land in a dump row.
    out = jnp.zeros((num_tokens + 1, num_heads, head_dim), q.dtype)
    out = out.at[jnp.concatenate([dec_rows, pre_rows])].set(jnp.concatenate([dec_out, pre_out]))
    return out[:num_tokens]
