"""The device's half of correcting a speculative step scheduled before the last verdict.

With async scheduling and speculation, step N + 1 is scheduled while step N (rows
verifying drafts) still runs: the host does not know how many drafts each row keeps,
so it places each row of N + 1 that continues a row of N as if every draft of N were
kept (the optimistic length), with its first token a placeholder. This module owns
the two pure, traced pieces that make such a step right on the device, without a host
read in between (vLLM corrects its inputs the same way, on the GPU, from
`num_rejected_tokens`):

- `device_verdict`: from step N's sampled tokens and the drafts they verified, each
  row's kept draft count, rejected count and last emitted token (the token the host's
  `spec_decode.verify` would end the row's output with), all `[S]` on the device;
- `roll_back_rows`: step N + 1's unpacked input with the positions, slot mapping and
  sequence lengths of every row that continues a row of N moved back by that row's
  rejected count (the slots recomputed from the row's block table);
- `feed_buffer`: the one buffer the forward's placeholder tokens read when a step
  feeds back both step N's last tokens (entries [0, R), by row of N, as `prev_step_row`
  names them) and a proposal's drafts (entries [R, 2R), in the step's draft order;
  `draft_feed.feed_draft_tokens(..., offset=R)` points the drafts there);
- `proposal_from_verdict`: the proposal after step N, its rows placed by the host at
  the optimistic lengths, made right from the verdict: each row's newest token, its
  first step's position, its output index and (EAGLE, MTP, Medusa) its feature row.

Not owned (and not yet done; `docs/speculative_decoding.md` lists them): scheduling
N + 1 before N's verdict and rolling `num_computed_tokens` back at commit (the
scheduler), the forward and proposal programs that apply these, and shifting the
sampler's output indices and penalty histories.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jvllm.layers.attention import AttentionMetadata
from jvllm.runner.draft_feed import _place
from jvllm.runner.drafter import ProposalInputs
from jvllm.runner.input_batch import ModelInput


def device_verdict(
    sampled: jax.Array,  # [L] int32: the token drawn at each logits row of step N
    drafted: jax.Array,  # [L] int32: the draft each logits row verified (row r's j-th
    # draft at first[r] + j, j < num_drafts[r]; other entries are never read)
    first: jax.Array,  # [S] int32: each row's first logits row
    num_drafts: jax.Array,  # [S] int32: each row's draft count (0: a row without drafts)
    max_drafts: int,  # static: num_speculative_tokens
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each row's (accepted `[S]`, rejected `[S]`, last emitted token `[S]`), int32.

    A draft is kept while it equals the token drawn at its position; the row emits the
    kept drafts and then the token drawn after them. A padding row (num_drafts 0)
    reads logits row `first` (clamped), so give it any index in range.
    """
    last_row = sampled.shape[0] - 1
    within = jnp.arange(max_drafts + 1, dtype=jnp.int32)  # [K + 1]
    index = jnp.minimum(first[:, None] + within[None, :], last_row)  # [S, K + 1]
    match = (sampled[index] == drafted[index]) & (within[None, :] < num_drafts[:, None])
    accepted = jnp.cumprod(match.astype(jnp.int32), axis=1).sum(axis=1)  # [S]
    last = sampled[jnp.minimum(first + accepted, last_row)]  # [S]
    return accepted, num_drafts - accepted, last


def roll_back_rows(
    inp: ModelInput,
    prev_index: jax.Array,  # [T] int32: a row's first token names its row of step N
    rejected: jax.Array,  # [R] int32: step N's rejected drafts per row (`device_verdict`)
    block_size: int,
) -> ModelInput:
    """`inp` with each row that continues a row of step N (its first token's
    `prev_index` >= 0) moved back by that row's rejected count: positions, slots (from
    the row's block table) and sequence length. Other rows and padding are unchanged;
    the tokens and logits rows keep their places (the rows' lengths do not change)."""
    meta = inp.attn
    qsl, seq_lens, tables = meta.query_start_loc, meta.seq_lens, meta.block_tables
    num_seqs, num_tokens = seq_lens.shape[0], inp.positions.shape[0]
    total = qsl[num_seqs]
    firsts = jnp.minimum(qsl[:num_seqs], num_tokens - 1)  # [S]
    prev = prev_index[firsts]  # [S]
    real_row = qsl[1:] > qsl[:num_seqs]  # [S]
    shift = jnp.where(real_row & (prev >= 0), rejected[jnp.maximum(prev, 0)], 0)  # [S]
    t = jnp.arange(num_tokens, dtype=jnp.int32)  # [T]
    row_of = jnp.minimum(jnp.searchsorted(qsl[1:], t, side="right"), num_seqs - 1)  # [T]
    real = t < total  # [T]
    positions = jnp.where(real, inp.positions - shift[row_of], inp.positions)
    block = tables[row_of, jnp.maximum(positions, 0) // block_size]  # [T]
    slots = jnp.where(real, block * block_size + positions % block_size, meta.slot_mapping)
    attn = AttentionMetadata(slots, qsl, seq_lens - shift, tables)
    return dataclasses.replace(inp, positions=positions, attn=attn)


def feed_buffer(
    last: jax.Array,  # [R] int32: step N's last emitted token per row (`device_verdict`)
    drafts: jax.Array,  # [S, k] int32: the proposal's drafts
    sources: jax.Array,  # [R] int32: flat index of the step's j-th draft, -1 past them
) -> jax.Array:
    """`[2R]` int32: `last`, then the step's drafts in row order (`draft_feed._place`)."""
    return jnp.concatenate([last, _place(drafts, sources)])


def proposal_from_verdict(
    rows: ProposalInputs,  # [S] rows placed as if every draft of step N were kept
    source: jax.Array,  # [S] int32: each row's row of step N (-1: a row it did not sample)
    accepted: jax.Array,  # [R] int32: step N's kept drafts per row (`device_verdict`)
    rejected: jax.Array,  # [R] int32
    last: jax.Array,  # [R] int32: step N's last emitted token per row
    first: jax.Array,  # [R] int32: step N's first logits row per row
) -> ProposalInputs:
    """`rows` with each row that step N sampled drafting from the token N emitted last:
    that token, its first step's position and output index moved back by N's rejected
    count, and its feature row the logits row the token was drawn from. Rows with
    `source` -1 (a prompt chunk's last entry, padding) are unchanged. The draft counts
    (`limits`) stay the optimistic ones: never more than the true room."""
    has = source >= 0  # [S]
    src = jnp.maximum(source, 0)
    back = jnp.where(has, rejected[src], 0)  # [S]
    return rows._replace(
        tokens=jnp.where(has, last[src], rows.tokens),
        positions=rows.positions - back,
        steps=rows.steps - back,
        feature_rows=jnp.where(has, first[src] + accepted[src], rows.feature_rows),
    )
