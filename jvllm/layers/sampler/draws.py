"""The draws every sampling path shares, on device: greedy, Gumbel-style and inverse-CDF.

Owns how a row's randomness is derived (`row_key`: its seed folded with its step
index, so a row's token never depends on the other rows) and the ways a token is drawn
from it. Not which logits they see (`sampling.py`, `top_k_top_p.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def argmax_rows(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` as int32 (the first index of each row's maximum, or of
    its first NaN), as two plain reductions: XLA:CPU lowers argmax to a variadic
    (value, index) reduce that it does not vectorise, 1.3 against 0.4 ms for [64, 8192]
    float32 (`bench/sampler.py`)."""
    top = jnp.max(x, axis=-1, keepdims=True)
    index = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    hit = (x == top) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1)


def exponentials(keys: jax.Array, vocab: int) -> jax.Array:
    """`[S, V]` Exp(1) noise, row i's from `keys[i]` alone: E = -log U, with U the uniforms
    of `jax.random.gumbel` (its default mode). For weights w >= 0, argmax(w / E) is the
    Gumbel-max argmax(log w - log E) of the same draw, one log an entry fewer (on XLA:CPU
    2.9 against 4.9 ms at 64 rows of 8192)."""
    tiny = jnp.finfo(jnp.float32).tiny

    def row(key: jax.Array) -> jax.Array:
        return -jnp.log(jax.random.uniform(key, (vocab,), jnp.float32, tiny, 1.0))  # > 0

    return jax.vmap(row)(keys)


def row_key(seed: jax.Array, step: jax.Array) -> jax.Array:
    return jax.random.fold_in(jax.random.key(seed), step)


def inverse_cdf_draw(weights: jax.Array, key: jax.Array) -> jax.Array:
    """A token drawn from one row's unnormalised `weights [V]` by inverting their
    cumulative sum at one uniform draw: one random number a row, where a Gumbel-max draw
    takes one a vocabulary entry. The threshold is scaled by the total, so rounding never
    lands past the last token with weight."""
    cdf = jnp.cumsum(weights)
    threshold = jax.random.uniform(key, dtype=cdf.dtype) * cdf[-1]
    return jnp.minimum(jnp.sum(cdf <= threshold), weights.shape[-1] - 1).astype(jnp.int32)


# Entries per block of the sampler's two-level draw (`blocked_race`).
RACE_BLOCK = 256


def blocked_race(weights: jax.Array, keys: jax.Array) -> jax.Array:
    """A token per row from unnormalised `weights [S, V]` (>= 0) and one key per row, in
    two exponential races (Gumbel-max, as `exponentials`): the blocks of `RACE_BLOCK`
    entries race with their sums (the key's noise), then the winning block's entries
    with their own weights (noise from the key folded with 1). The same distribution as
    one race over the whole row, from blocks + RACE_BLOCK random numbers a row instead of
    one a vocabulary entry (on XLA:CPU the sampler program takes 0.47 against 1.04 ms
    at 16 rows of 8192). Each block's sum is a fixed tree of elementwise adds, so a row draws
    the same token in any batch; like one race (and unlike inverting a cumulative sum), a
    rounding-level change in a row's logits moves its token only where two racers tie
    within it. A row without weight draws token 0, as `argmax_rows` of its NaNs."""
    rows, vocab = weights.shape
    blocks = -(-vocab // RACE_BLOCK)
    padded = jnp.pad(weights, ((0, 0), (0, blocks * RACE_BLOCK - vocab)))
    by_block = padded.reshape(rows, blocks, RACE_BLOCK)
    sums = _tree_sum(by_block)  # [S, blocks]
    block = argmax_rows(sums / exponentials(keys, blocks))
    entries = jnp.take_along_axis(by_block, block[:, None, None], axis=1)[:, 0]  # [S, B]
    entry_keys = jax.vmap(lambda key: jax.random.fold_in(key, 1))(keys)
    index = argmax_rows(entries / exponentials(entry_keys, RACE_BLOCK))
    return (block * RACE_BLOCK + index).astype(jnp.int32)


def _tree_sum(x: jax.Array) -> jax.Array:
    """Sums over the last axis (a power of two) by halving it: one order whatever the
    other axes (a row reduction's may change with the batch's shape)."""
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]
