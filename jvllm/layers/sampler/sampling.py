"""sample(): turns one step's logits into token ids and logprobs, on device.

Owns `sample()` (penalties, logit biases and bans, greedy, temperature, seeded draws,
raw logprobs; the sampling of rows in groups on CPU) and `apply_token_bitmask()`, the
packed allowed-token masks of structured outputs and `allowed_token_ids`. The per-row
arrays are `metadata.py`'s, top_k/top_p/min_p `top_k_top_p.py`'s, and the rejection
test of draft tokens `rejection.py`'s.

Does not own: resolving a request's seed (the engine), choosing the bucket sizes S and
P (the runner), moving the arrays to the device (the runner), or slicing the top
logprobs down to what each request asked for (the engine).

Every sampling knob is an array, never a static argument: new temperatures or seeds
reuse the compiled program; only the shapes S, V, E and F select one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import jax
import jax.numpy as jnp
from jax import lax

from jvllm.layers.sampler.draws import argmax_rows, blocked_race, row_key
from jvllm.layers.sampler.metadata import SamplingMetadata
from jvllm.layers.sampler.rejection import rejection_sample, target_probs
from jvllm.layers.sampler.top_k_top_p import filter_logits
from jvllm.sampling_params import NUM_TOP_CANDIDATES, SAMPLING_EPS

T = TypeVar("T")

# On XLA:CPU the sampler takes its rows in groups of this many, one group after the
# other and only as many groups as the step has rows (`sample`'s `group_rows`): one
# compiled program then serves every row count, and each group's [G, V] intermediates
# stay in the caches.
GROUP_ROWS_CPU = 16


class SamplerOutput(NamedTuple):
    token_ids: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S]; raw log_softmax at the sampled token
    top_ids: jax.Array  # i32[S, K], K = min(NUM_TOP_CANDIDATES, V)
    top_logprobs: jax.Array  # f32[S, K]


def sample(
    logits: jax.Array,
    md: SamplingMetadata,
    last_input: jax.Array | None = None,
    draft_probs: jax.Array | None = None,
    group_rows: int | None = None,
    bitmask: jax.Array | None = None,
) -> SamplerOutput:
    """Choose one token per row; jit-compatible, no branching on parameter values.

    `last_input` `[S]` is each row's last input token (needed where `pending_output`).
    `draft_probs` `[Q, V]`: a draft model's proposal distributions, indexed by
    `md.draft_q_rows`; rows with a draft token are decided by `rejection_sample`.
    Row i's token depends only on logits[i] and row i's parameters, seed and step index,
    never on the other rows or on how many padding rows the batch carries.
    `group_rows` (a divisor of S): the rows go in groups of this many, one group after
    the other, and only the groups that hold one of the `md.used_rows` rows in use
    (`GROUP_ROWS_CPU`): the same outputs for those rows, zeros for the rest.
    `bitmask` `i32[S, ceil(V/32)]`: each row's allowed tokens (`apply_token_bitmask`),
    applied to the logits first, raw logprobs included; a group whose masks allow every
    token skips it.
    """
    logits = logits.astype(jnp.float32)  # [S, V]
    if last_input is None:
        last_input = jnp.zeros(logits.shape[0], jnp.int32)
    if group_rows is not None:
        return _sample_in_groups(logits, md, last_input, draft_probs, group_rows, bitmask)
    return _sample_rows(logits, md, last_input, draft_probs, bitmask)


def _sample_in_groups(
    logits: jax.Array,
    md: SamplingMetadata,
    last_input: jax.Array,
    draft_probs: jax.Array | None,
    size: int,
    bitmask: jax.Array | None,
) -> SamplerOutput:
    """`_sample_rows` over groups of `size` rows, as many as hold the rows in use."""
    num_rows, vocab = logits.shape
    if num_rows % size:
        raise ValueError(f"group_rows={size} must divide the {num_rows} logits rows")

    def group(lo: jax.Array) -> SamplerOutput:
        return _sample_rows(
            lax.dynamic_slice_in_dim(logits, lo, size),
            _group_metadata(md, lo, size),
            lax.dynamic_slice_in_dim(last_input, lo, size),
            draft_probs,
            None if bitmask is None else lax.dynamic_slice_in_dim(bitmask, lo, size),
        )

    num_top = min(NUM_TOP_CANDIDATES, vocab)
    zeros = SamplerOutput(
        jnp.zeros(num_rows, jnp.int32),
        jnp.zeros(num_rows, jnp.float32),
        jnp.zeros((num_rows, num_top), jnp.int32),
        jnp.zeros((num_rows, num_top), jnp.float32),
    )
    return over_groups(group, size, jnp.minimum(md.used_rows[0], num_rows), zeros)


def over_groups(group: Callable[[jax.Array], T], size: int, used: jax.Array, init: T) -> T:
    """`init` (a pytree of `[N, ...]` arrays) with rows `lo` to `lo + size` replaced by
    `group(lo)`, for lo = 0, size, 2 size, ... while below `used`: one group after the
    other (one compiled body), none past the rows in use."""

    def body(g: jax.Array, outs: T) -> T:
        lo = g * size
        put = lambda whole, part: lax.dynamic_update_slice_in_dim(whole, part, lo, 0)
        return jax.tree.map(put, outs, group(lo))

    return lax.fori_loop(0, (used + size - 1) // size, body, init)


# SamplingMetadata's fields that hold one entry per row.
_ROW_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(SamplingMetadata)
    if not f.name.startswith(("penalty_", "bias_")) and f.name != "used_rows"
)


def _group_metadata(md: SamplingMetadata, lo: jax.Array, size: int) -> SamplingMetadata:
    """Rows `lo` to `lo + size` of md: their per-row columns, and the flat penalty and
    bias lists with other rows' entries made padding (token -1) and rows renumbered."""
    columns = {name: lax.dynamic_slice_in_dim(getattr(md, name), lo, size) for name in _ROW_FIELDS}
    penalty_rows = md.penalty_rows - lo
    penalty_in = (penalty_rows >= 0) & (penalty_rows < size)
    bias_rows = md.bias_rows - lo
    bias_in = (bias_rows >= 0) & (bias_rows < size)
    return dataclasses.replace(
        md,
        **columns,
        penalty_rows=jnp.where(penalty_in, penalty_rows, 0),
        penalty_token_ids=jnp.where(penalty_in, md.penalty_token_ids, -1),
        bias_rows=jnp.where(bias_in, bias_rows, 0),
        bias_token_ids=jnp.where(bias_in, md.bias_token_ids, -1),
        used_rows=jnp.full(1, size, jnp.int32),
    )


def _sample_rows(
    logits: jax.Array,
    md: SamplingMetadata,
    last_input: jax.Array,
    draft_probs: jax.Array | None,
    bitmask: jax.Array | None = None,
) -> SamplerOutput:
    """`sample` of every row at once."""
    if bitmask is not None:
        masked = jnp.any(bitmask != -1)
        logits = lax.cond(masked, apply_token_bitmask, lambda lg, _: lg, logits, bitmask)
    penalised = _bias(apply_penalties(logits, md, last_input), md)  # [S, V]
    greedy = md.temperature < SAMPLING_EPS  # [S]
    greedy_ids = argmax_rows(penalised)  # [S]

    def mixed() -> jax.Array:
        return jnp.where(greedy, greedy_ids, _draw(filter_logits(penalised, md), md))

    # An all-greedy batch (common: temperature=0 evals) skips filtering and the draws.
    token_ids = lax.cond(jnp.all(greedy), lambda: greedy_ids, mixed)  # [S]
    if draft_probs is not None:
        drafted = md.draft_q_rows >= 0  # [S]

        def verified() -> jax.Array:
            p = target_probs(penalised, md)  # [S, V]
            q = draft_probs[jnp.maximum(md.draft_q_rows, 0)]  # [S, V]
            keys = jax.vmap(row_key)(md.seeds, md.step_index)
            decided = rejection_sample(p, q, jnp.maximum(md.draft_token_ids, 0), keys)
            return jnp.where(drafted, decided, token_ids)

        # A greedy row's verdict is its argmax whatever the draft (p and q are one-hot,
        # the residual of a wrong draft is p): only sampled rows need the rejection rule.
        token_ids = lax.cond(jnp.any(drafted & ~greedy), verified, lambda: token_ids)
    num_top = min(NUM_TOP_CANDIDATES, logits.shape[-1])

    def with_logprobs() -> tuple[jax.Array, jax.Array, jax.Array]:
        raw_logprobs = jax.nn.log_softmax(logits, axis=-1)  # [S, V]
        chosen = jnp.take_along_axis(raw_logprobs, token_ids[:, None], axis=-1)[:, 0]  # [S]
        top_logprobs, top_ids = lax.top_k(raw_logprobs, num_top)
        return chosen, top_ids.astype(jnp.int32), top_logprobs

    def without() -> tuple[jax.Array, jax.Array, jax.Array]:
        rows = logits.shape[0]
        zeros = jnp.zeros((rows, num_top), jnp.float32)
        return jnp.zeros(rows, jnp.float32), jnp.zeros((rows, num_top), jnp.int32), zeros

    # A batch in which nobody asked for logprobs skips the log-softmax and the top-k.
    logprobs, top_ids, top_logprobs = lax.cond(jnp.any(md.want_logprobs), with_logprobs, without)
    return SamplerOutput(token_ids, logprobs, top_ids, top_logprobs)


def apply_penalties(logits: jax.Array, md: SamplingMetadata, last_input: jax.Array) -> jax.Array:
    """Repetition (prompt + output), then frequency and presence (output only)."""
    active = jnp.any(
        (md.repetition_penalty != 1.0)
        | (md.frequency_penalty != 0.0)
        | (md.presence_penalty != 0.0)
    )
    return lax.cond(active, _penalise, lambda lg, *_: lg, logits, md, last_input)


def _bias(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Adds each bias entry to its row's logit (logit_bias; -inf for bad words and the
    EOS and stop ids min_tokens holds back). A scatter of F entries, no pass over [S, V]."""
    vocab = logits.shape[-1]
    ids = jnp.where(md.bias_token_ids >= 0, md.bias_token_ids, vocab)  # padding -> V, dropped
    return logits.at[md.bias_rows, ids].add(md.bias_values, mode="drop")


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Sets to -inf every token whose bit is 0 in its row of `bitmask` `i32[S, ceil(V/32)]`
    (bit j of word w is token 32 w + j; -1 everywhere allows all)."""
    num_rows, vocab = logits.shape
    bits = jnp.arange(32, dtype=jnp.int32)  # [32]
    allowed = (bitmask[:, :, None] >> bits) & 1  # [S, W, 32]
    allowed = allowed.reshape(num_rows, -1)[:, :vocab]  # [S, V]
    return jnp.where(allowed.astype(bool), logits, -jnp.inf)


def _penalise(logits: jax.Array, md: SamplingMetadata, last_input: jax.Array) -> jax.Array:
    """Counts md's history entries (token -1 = padding) per row and applies the penalties."""
    num_rows, vocab = logits.shape
    # The output token still on the device joins its row's history as one more entry.
    rows = jnp.concatenate([md.penalty_rows, jnp.arange(num_rows, dtype=jnp.int32)])  # [N]
    pending = jnp.where(md.pending_output, last_input, -1)  # [S]
    token_ids = jnp.concatenate([md.penalty_token_ids, pending])  # [N = E + S]
    is_output = jnp.concatenate([md.penalty_is_output, md.pending_output])
    valid = token_ids >= 0  # [N]
    # Padding goes to index V, which mode="drop" discards (-1 would wrap to V - 1).
    ids = jnp.where(valid, token_ids, vocab)  # [N]
    counted = (valid & is_output).astype(jnp.float32)  # [N]
    output_counts = jnp.zeros_like(logits).at[rows, ids].add(counted, mode="drop")  # [S, V]
    seen = jnp.zeros(logits.shape, bool).at[rows, ids].set(True, mode="drop")  # [S, V]
    rep = md.repetition_penalty[:, None]  # [S, 1]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - md.frequency_penalty[:, None] * output_counts
    return logits - md.presence_penalty[:, None] * (output_counts > 0)


def _draw(filtered: jax.Array, md: SamplingMetadata) -> jax.Array:
    """A token from softmax(filtered) per row, by a race keyed by the row alone
    (`blocked_race`)."""
    keys = jax.vmap(row_key)(md.seeds, md.step_index)
    weights = jnp.exp(filtered - jnp.max(filtered, axis=-1, keepdims=True))  # dropped: 0
    return blocked_race(weights, keys)
