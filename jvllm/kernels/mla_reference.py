"""Multi-head latent attention (DeepSeek's MLA) over a paged latent cache, in jax.numpy.

The contract, over the ragged batch of `reference.py` (S sequences, T new tokens, the
same `block_tables`, `seq_lens` and `query_start_loc`):

- the cache holds, per token, the normalised latent `c` `[R]` (`latent_cache`
  `[N, BS, 1, R]`, R = kv_lora_rank) and the rotated rope key `k_pe` `[Dr]`
  (`rope_cache` `[N, BS, 1, Dr]`): one shared head, nothing per query head;
- head h's key of a token is `[W_kb[h] c, k_pe]` and its value `W_vb[h] c`, with
  `w_kb` `[Hq, Dn, R]` and `w_vb` `[Hq, Dv, R]` the two halves of `kv_b_proj`;
- queries arrive split: `q_nope` `[T, Hq, Dn]` and the rotated `q_pe` `[T, Hq, Dr]`;
  the output is `[T, Hq, Dv]`, causal as in `reference.py`.

Two computations of the same attention, as vLLM's MLA backends run them:

- decode rows (one query) take the absorbed form: `q_nope` is folded into the latent
  space once (`q_lat = W_kb[h]^T q_nope`, `[Hq, R]`), each key costs `R + Dr` per head
  read straight from the cache, the softmax-weighted latents are summed and only then
  multiplied by `W_vb[h]`: no per-head key or value is ever made;
- prefill rows (tiles of QUERY_TILE queries) expand each chunk of cached latents into
  per-head keys and values (`Dn + Dv` per head and key), which costs fewer FLOPs than
  the absorbed form when many queries share the keys.

Both accumulate in float32 with an online softmax over key chunks, as `reference.py`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jvllm.kernels.reference import (
    KEY_CHUNK,
    MASK_VALUE,
    QUERY_TILE,
    _decode_items,
    _Items,
    _leading_decodes,
    _prefill_items,
)

ITEM_BATCH = 64  # work items vectorised together per sequential step, as reference.py

# A decode kernel (`jax_triton_mla.mla_decode`'s contract): each sequence's one query
# `[S, Hq, Dn]`, `[S, Hq, Dr]` at position seq_len - 1 over the paged latents, the caches,
# `w_kb`, `w_vb`, block tables `[S, W]`, seq_lens `[S]` (0: skip the row) and the scale
# -> `[S, Hq, Dv]`.
DecodeFn = Callable[..., jax.Array]


def write_latent(
    latent_cache: jax.Array,  # [N, BS, 1, R]
    rope_cache: jax.Array,  # [N, BS, 1, Dr]
    latent: jax.Array,  # [T, R]
    k_pe: jax.Array,  # [T, Dr]
    slot_mapping: jax.Array,  # [T] int32; padding -> null block 0
) -> tuple[jax.Array, jax.Array]:
    """Scatters each new token's latent and rope key into its slot."""

    def put(cache: jax.Array, x: jax.Array) -> jax.Array:
        n, bs, _, d = cache.shape
        flat = cache.reshape(n * bs, d).at[slot_mapping].set(x.astype(cache.dtype))
        return flat.reshape(cache.shape)

    return put(latent_cache, latent), put(rope_cache, k_pe)


def mla_paged_attention(
    q_nope: jax.Array,  # [T, Hq, Dn]
    q_pe: jax.Array,  # [T, Hq, Dr], rotated
    latent_cache: jax.Array,  # [N, BS, 1, R]
    rope_cache: jax.Array,  # [N, BS, 1, Dr]
    w_kb: jax.Array,  # [Hq, Dn, R]
    w_vb: jax.Array,  # [Hq, Dv, R]
    block_tables: jax.Array,  # [S, W] int32
    seq_lens: jax.Array,  # [S] int32
    query_start_loc: jax.Array,  # [S + 1] int32
    scale: float,
    decode: DecodeFn | None = None,
) -> jax.Array:  # [T, Hq, Dv]
    """Leading decode rows in the absorbed form (by `decode`, a kernel, when given), the
    rest expanded (module docstring)."""
    num_tokens, num_heads, _ = q_nope.shape
    v_dim = w_vb.shape[1]
    num_decodes = _leading_decodes(query_start_loc)
    args = (q_nope, q_pe, latent_cache, rope_cache, w_kb, w_vb, block_tables, seq_lens)
    if decode is None:
        dec = _run_items(
            _decode_items(query_start_loc, num_decodes), 1, True, query_start_loc, scale, *args
        )
    else:
        dec = _kernel_decodes(decode, num_decodes, query_start_loc, scale, *args)
    pre_items = _prefill_items(num_tokens, query_start_loc, num_decodes)
    pre = _run_items(pre_items, QUERY_TILE, False, query_start_loc, scale, *args)
    out = jnp.zeros((num_tokens + 1, num_heads, v_dim), q_nope.dtype)
    rows = jnp.concatenate([dec[1], pre[1]])
    out = out.at[rows].set(jnp.concatenate([dec[0], pre[0]]))
    return out[:num_tokens]


def _kernel_decodes(
    decode: DecodeFn,
    num_decodes: jax.Array,
    query_start_loc: jax.Array,
    scale: float,
    q_nope: jax.Array,
    q_pe: jax.Array,
    latent_cache: jax.Array,
    rope_cache: jax.Array,
    w_kb: jax.Array,
    w_vb: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The leading decode rows by `decode` over every sequence slot (the others given
    seq_len 0, which the kernel skips): `[S, Hq, Dv]` and their rows (the dump row `T`
    for sequences that are not decodes)."""
    num_tokens = q_nope.shape[0]
    first = jnp.minimum(query_start_loc[:-1], num_tokens - 1)  # [S] each one's first query
    is_decode = jnp.arange(first.shape[0], dtype=jnp.int32) < num_decodes
    lens = jnp.where(is_decode, seq_lens, 0).astype(jnp.int32)
    out = decode(
        q_nope[first], q_pe[first], latent_cache, rope_cache, w_kb, w_vb, block_tables, lens, scale
    )
    return out.astype(q_nope.dtype), jnp.where(is_decode, first, num_tokens)


def _run_items(
    items: _Items,
    tile: int,
    absorbed: bool,
    query_start_loc: jax.Array,
    scale: float,
    q_nope: jax.Array,
    q_pe: jax.Array,
    latent_cache: jax.Array,
    rope_cache: jax.Array,
    w_kb: jax.Array,
    w_vb: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Each item's `tile` output rows `[I * tile, Hq, Dv]` and their row indices (the
    dump row `T` for rows that are not real)."""
    num_tokens, num_heads, _ = q_nope.shape
    _, block_size, _, rank = latent_cache.shape
    rope_dim = rope_cache.shape[-1]
    v_dim = w_vb.shape[1]
    chunk_blocks = max(1, KEY_CHUNK // block_size)
    chunk = chunk_blocks * block_size
    width = block_tables.shape[1]
    tables = jnp.pad(block_tables, ((0, 0), (0, -width % chunk_blocks)))
    pad = ((0, QUERY_TILE), (0, 0), (0, 0))  # windows never run off the end
    qn_pad, qp_pad = jnp.pad(q_nope, pad), jnp.pad(q_pe, pad)
    w_kb32, w_vb32 = w_kb.astype(jnp.float32), w_vb.astype(jnp.float32)
    acc_dim = rank if absorbed else v_dim

    def one_item(item: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        s, start, valid = item
        rows = start + jnp.arange(tile, dtype=jnp.int32)  # [Qt]
        row_ok = valid & (rows < query_start_loc[s + 1])
        pos = seq_lens[s] - query_start_loc[s + 1] + rows
        qn = jax.lax.dynamic_slice_in_dim(qn_pad, start, tile).astype(jnp.float32) * scale
        qp = jax.lax.dynamic_slice_in_dim(qp_pad, start, tile).astype(jnp.float32) * scale
        if absorbed:
            qn = jnp.einsum("qhd,hdr->qhr", qn, w_kb32)  # [Qt, Hq, R]

        def body(c: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            m, denom, acc = carry  # [Hq, Qt], [Hq, Qt], [Hq, Qt, acc_dim]
            blocks = jax.lax.dynamic_slice_in_dim(tables[s], c * chunk_blocks, chunk_blocks)
            lat = latent_cache[blocks].reshape(chunk, rank).astype(jnp.float32)
            k_pe = rope_cache[blocks].reshape(chunk, rope_dim).astype(jnp.float32)
            key_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
            mask = (key_pos[None, :] <= pos[:, None]) & row_ok[:, None]  # [Qt, C]
            scores = jnp.einsum("qhd,cd->hqc", qp, k_pe)
            if absorbed:  # keys are the latents themselves
                scores += jnp.einsum("qhr,cr->hqc", qn, lat)
            else:  # per-head keys and values of this chunk
                k_nope = jnp.einsum("cr,hdr->chd", lat, w_kb32)
                scores += jnp.einsum("qhd,chd->hqc", qn, k_nope)
            scores = jnp.where(mask[None], scores, MASK_VALUE)
            m_new = jnp.maximum(m, scores.max(-1))
            p = jnp.exp(scores - m_new[..., None])
            correction = jnp.exp(m - m_new)
            denom = denom * correction + p.sum(-1)
            if absorbed:
                pv = jnp.einsum("hqc,cr->hqr", p, lat)
            else:
                pv = jnp.einsum("hqc,chv->hqv", p, jnp.einsum("cr,hvr->chv", lat, w_vb32))
            return m_new, denom, acc * correction[..., None] + pv

        shape = (num_heads, tile)
        init = (
            jnp.full(shape, MASK_VALUE, jnp.float32),
            jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, acc_dim), jnp.float32),
        )
        num_chunks = jnp.where(valid, (seq_lens[s] + chunk - 1) // chunk, 0)
        _, denom, acc = jax.lax.fori_loop(0, num_chunks, body, init)
        out = acc / jnp.maximum(denom, 1e-30)[..., None]  # [Hq, Qt, acc_dim]
        if absorbed:  # the summed latents, up-projected once per head
            out = jnp.einsum("hqr,hvr->hqv", out, w_vb32)
        out = out.transpose(1, 0, 2).astype(q_nope.dtype)  # [Qt, Hq, Dv]
        return out, jnp.where(row_ok, rows, num_tokens)

    outs, rows = jax.lax.map(one_item, tuple(items), batch_size=ITEM_BATCH)
    return outs.reshape(-1, num_heads, v_dim), rows.reshape(-1)
