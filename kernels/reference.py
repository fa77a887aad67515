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

from typing import NamedTuple

import jax
import jax.numpy as jnp

# A finite mask value keeps fully masked (padding) rows free of NaN.
MASK_VALUE = -1e30
# Queries of one sequence handled together: one matrix product per key chunk.
QUERY_TILE = 16
# Keys visited per inner-loop iteration.
KEY_CHUNK = 128


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
    """Prefill work items: up to QUERY_TILE consecutive queries of one sequence each."""

    seq: jax.Array  # [I] sequence of each item
    start: jax.Array  # [I] first query row
    valid: jax.Array  # [I] False for items past the real work


def _leading_decodes(query_start_loc: jax.Array) -> jax.Array:
    """How many sequences at the front of the batch run exactly one query (decodes).

    Token i of such a prefix belongs to sequence i, so those tokens are handled in
    tiles of unrelated rows; everything after goes through prefill items.
    """
    q_len = query_start_loc[1:] - query_start_loc[:-1]
    return jnp.sum(jnp.cumprod(q_len == 1)).astype(jnp.int32)


def _work_items(num_tokens: int, query_start_loc: jax.Array, num_decodes: jax.Array) -> _Items:
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


class _Attend(NamedTuple):
    """One layer's static view of the cache for the chunked online softmax."""

    k_cache: jax.Array  # [N, BS, Hkv, D]
    v_cache: jax.Array
    tables: jax.Array  # [S, W'] block tables padded to whole key chunks
    chunk_blocks: int
    sliding_window: int | None

    def rows(
        self,
        q: jax.Array,  # [R, Hkv, G, D] float32, already scaled
        seqs: jax.Array,  # [R] sequence of each row (one shared sequence: shape [])
        pos: jax.Array,  # [R] absolute position of each row
        row_ok: jax.Array,  # [R]
        num_chunks: jax.Array,  # [] key chunks to visit
    ) -> jax.Array:  # [R, Hkv, G, D] float32
        _, bs, hkv, d = self.k_cache.shape
        chunk = self.chunk_blocks * bs
        shared = seqs.ndim == 0  # one sequence: gather its keys once for all rows

        def body(c: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            m, denom, acc = carry  # [R, Hkv, G], [R, Hkv, G], [R, Hkv, G, D]
            blocks = jax.lax.dynamic_slice_in_dim(
                self.tables[seqs], c * self.chunk_blocks, self.chunk_blocks, axis=-1
            )
            k = self.k_cache[blocks].reshape(*blocks.shape[:-1], chunk, hkv, d)
            v = self.v_cache[blocks].reshape(*blocks.shape[:-1], chunk, hkv, d)
            k, v = k.astype(jnp.float32), v.astype(jnp.float32)
            eq = "rkgd,ckd->rkgc" if shared else "rkgd,rckd->rkgc"
            scores = jnp.einsum(eq, q, k)
            key_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
            mask = (key_pos[None, :] <= pos[:, None]) & row_ok[:, None]  # [R, C]
            if self.sliding_window is not None:
                mask &= key_pos[None, :] > pos[:, None] - self.sliding_window
            scores = jnp.where(mask[:, None, None, :], scores, MASK_VALUE)
            m_new = jnp.maximum(m, scores.max(-1))
            p = jnp.exp(scores - m_new[..., None])
            correction = jnp.exp(m - m_new)
            denom = denom * correction + p.sum(-1)
            eq = "rkgc,ckd->rkgd" if shared else "rkgc,rckd->rkgd"
            acc = acc * correction[..., None] + jnp.einsum(eq, p, v)
            return m_new, denom, acc

        init = (
            jnp.full(q.shape[:-1], MASK_VALUE, jnp.float32),
            jnp.zeros(q.shape[:-1], jnp.float32),
            jnp.zeros(q.shape, jnp.float32),
        )
        _, denom, acc = jax.lax.fori_loop(0, num_chunks, body, init)
        return acc / jnp.maximum(denom, 1e-30)[..., None]


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
    """Flash-style online softmax over key chunks, visiting only each sequence's real
    length. Leading decode rows go in tiles of QUERY_TILE rows (each row its own
    keys); prefill queries in tiles of one sequence (keys gathered once per tile)."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    chunk_blocks = max(1, KEY_CHUNK // block_size)
    chunk = chunk_blocks * block_size
    width = block_tables.shape[1]
    tables = jnp.pad(block_tables, ((0, 0), (0, -width % chunk_blocks)))
    attend = _Attend(k_cache, v_cache, tables, chunk_blocks, sliding_window)
    q_pad = jnp.pad(q, ((0, QUERY_TILE), (0, 0), (0, 0))).astype(jnp.float32) * scale
    q_pad = q_pad.reshape(-1, num_kv_heads, group, head_dim)  # windows never run off the end
    out = jnp.zeros((num_tokens + QUERY_TILE, num_kv_heads, group, head_dim), jnp.float32)
    num_decodes = _leading_decodes(query_start_loc)

    def decode_tile(i: jax.Array, out: jax.Array) -> jax.Array:
        rows = i * QUERY_TILE + jnp.arange(QUERY_TILE, dtype=jnp.int32)  # token = sequence
        row_ok = rows < num_decodes
        seqs = jnp.minimum(rows, num_seqs - 1)
        lens = jnp.where(row_ok, seq_lens[seqs], 0)
        q_rows = jax.lax.dynamic_slice_in_dim(q_pad, i * QUERY_TILE, QUERY_TILE)
        num_chunks = (lens.max() + chunk - 1) // chunk
        res = attend.rows(q_rows, seqs, lens - 1, row_ok, num_chunks)
        old = jax.lax.dynamic_slice_in_dim(out, i * QUERY_TILE, QUERY_TILE)
        res = jnp.where(row_ok[:, None, None, None], res, old)
        return jax.lax.dynamic_update_slice_in_dim(out, res, i * QUERY_TILE, 0)

    out = jax.lax.fori_loop(0, (num_decodes + QUERY_TILE - 1) // QUERY_TILE, decode_tile, out)

    def prefill_item(item: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
        s, start, valid = item
        rows = start + jnp.arange(QUERY_TILE, dtype=jnp.int32)
        row_ok = valid & (rows < query_start_loc[s + 1])
        pos = seq_lens[s] - query_start_loc[s + 1] + rows  # seq_len - q_len + row offset
        q_rows = jax.lax.dynamic_slice_in_dim(q_pad, start, QUERY_TILE)
        num_chunks = jnp.where(valid, (seq_lens[s] + chunk - 1) // chunk, 0)
        res = attend.rows(q_rows, s, pos, row_ok, num_chunks)
        return res, jnp.where(row_ok, rows, num_tokens)  # others land in a dump row

    items = _work_items(num_tokens, query_start_loc, num_decodes)
    res, rows = jax.lax.map(prefill_item, tuple(items), batch_size=8)  # [I, Qt, ...], [I, Qt]
    keep = out[num_tokens]
    out = out.at[rows.reshape(-1)].set(res.reshape(-1, num_kv_heads, group, head_dim))
    out = out.at[num_tokens].set(keep)
    return out[:num_tokens].reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
