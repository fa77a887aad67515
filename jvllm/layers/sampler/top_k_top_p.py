"""top_k, top_p and min_p: which of a row's logits stay candidates, on device.

Owns `filter_logits` and the threshold search behind it: a `lax.top_k` over the
first TOP_CANDIDATES logits of each row, falling back to a bisection over the whole
vocabulary where a row's top_k or top_p reaches past them. Does not own penalties,
biases or the draw (`sampling.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jvllm.layers.sampler.metadata import SamplingMetadata
from jvllm.sampling_params import SAMPLING_EPS

# Logits per row that top_k/top_p read through `lax.top_k` before falling back to a
# bisection over the whole vocabulary.
TOP_CANDIDATES = 64


def filter_logits(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Temperature, then min_p, top_k, top_p; dropped tokens become -inf.

    Greedy rows are scaled by 1 (their result is not used). The sort behind top_k/top_p
    runs only when some sampled row enables one of them.
    """
    num_rows, vocab = logits.shape
    greedy = md.temperature < SAMPLING_EPS  # [S]
    temperature = jnp.where(greedy, 1.0, md.temperature)  # [S]
    scaled = logits / temperature[:, None]  # [S, V]
    # prob < min_p * max_prob  <=>  logit - max_logit < log(min_p); log(0) = -inf keeps all.
    row_max = jnp.max(scaled, axis=-1, keepdims=True)  # [S, 1]
    scaled = jnp.where(scaled - row_max < jnp.log(md.min_p)[:, None], -jnp.inf, scaled)
    top_k = jnp.where((md.top_k <= 0) | (md.top_k > vocab), vocab, md.top_k)  # [S]
    needs_sort = jnp.any(~greedy & ((top_k < vocab) | (md.top_p < 1.0)))
    threshold = lax.cond(
        needs_sort,
        _top_k_top_p_threshold,
        lambda *_: jnp.full((num_rows,), -jnp.inf, jnp.float32),
        scaled,
        top_k,
        md.top_p,
    )  # [S]
    return jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)


def _top_k_top_p_threshold(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Smallest logit each row keeps under top_k and then top_p (ties at it are kept): as
    if the row were sorted, the first top_k positions form the set, and top_p keeps its
    shortest prefix whose mass before the last token is short of top_p.

    No full sort: XLA:CPU sorts [48, 8192] in about 60 ms. The best TOP_CANDIDATES
    logits (`lax.top_k`) settle every row whose top_k is at most that many or whose
    top_p mass is reached among them; any other row's threshold is found by bisection
    over the float order (`_bisect_threshold`), run only when some row needs it.
    """
    vocab = scaled.shape[-1]
    num_cand = min(TOP_CANDIDATES, vocab)
    # The barrier keeps XLA from folding the slices below into the top_k, which turns it
    # into a full sort of [S, V] again on XLA:CPU (jax 0.10).
    cand = lax.optimization_barrier(lax.top_k(scaled, num_cand)[0])  # [S, C], descending
    row_max = cand[:, :1]  # [S, 1]
    cand_w = jnp.exp(cand - row_max)  # [S, C]
    in_set = jnp.arange(num_cand)[None, :] < top_k[:, None]  # [S, C]
    k_in_cand = top_k <= num_cand  # [S]
    wide_k = ~k_in_cand & (top_k < vocab)  # the k-th logit lies past the candidates
    kth_cand = jnp.take_along_axis(cand, jnp.clip(top_k - 1, 0, num_cand - 1)[:, None], -1)
    kth_wide, total_wide = lax.cond(
        jnp.any(wide_k),
        _wide_top_k,
        lambda *_: (jnp.full(top_k.shape, -jnp.inf), jnp.ones(top_k.shape)),
        scaled,
        row_max,
        top_k,
    )
    kth = jnp.where(k_in_cand, kth_cand[:, 0], jnp.where(wide_k, kth_wide, -jnp.inf))  # [S]
    total = jnp.where(
        k_in_cand,
        jnp.sum(jnp.where(in_set, cand_w, 0.0), axis=-1),
        jnp.where(wide_k, total_wide, jnp.sum(jnp.exp(scaled - row_max), axis=-1)),
    )  # [S]: the set's unnormalised mass
    mass_before = jnp.cumsum(cand_w, axis=-1) - cand_w  # [S, C]
    keep = in_set & ((mass_before < (top_p * total)[:, None]) | (top_p[:, None] >= 1.0))
    num_keep = jnp.sum(keep, axis=-1)  # [S], >= 1: a prefix of the candidates
    settled = k_in_cand | (num_keep < num_cand)
    by_cand = jnp.take_along_axis(cand, (num_keep - 1)[:, None], axis=-1)[:, 0]

    def by_mass() -> jax.Array:
        # The smallest logit t with less than top_p of the set's mass above it.
        keys, weights = _order_keys(scaled), jnp.exp(scaled - row_max)  # [S, V]
        limit = top_p * total

        def holds(t: jax.Array) -> jax.Array:
            return jnp.sum(jnp.where(keys > t[:, None], weights, 0.0), axis=-1) < limit

        return _key_value(_bisect_threshold(keys, holds))

    past = lax.cond(jnp.any(~settled & (top_p < 1.0)), by_mass, lambda: kth)
    wide = jnp.where(top_p < 1.0, jnp.maximum(past, kth), kth)
    return jnp.where(settled, by_cand, wide)


def _wide_top_k(
    scaled: jax.Array, row_max: jax.Array, top_k: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The k-th largest logit of each row (the smallest t with fewer than k logits above
    it) and the mass of exactly k tokens from the top, ties at the k-th included only as
    far as the set has room: `[S]` each."""
    keys = _order_keys(scaled)  # [S, V]
    kth = _key_value(_bisect_threshold(keys, lambda t: jnp.sum(keys > t[:, None], axis=-1) < top_k))
    above = scaled > kth[:, None]  # [S, V]
    ties = top_k - jnp.sum(above, axis=-1)  # [S], >= 1
    weights = jnp.where(above, jnp.exp(scaled - row_max), 0.0)
    return kth, jnp.sum(weights, axis=-1) + ties * jnp.exp(kth - row_max[:, 0])


def _order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys in the order of the float32 values (-inf lowest): a negative float's
    bits are flipped, a positive one's sign bit set."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    sign = bits >> 31
    return jnp.where(sign == 1, ~bits, bits | jnp.uint32(0x80000000))


def _key_value(key: jax.Array) -> jax.Array:
    """The float32 whose `_order_keys` key is `key`."""
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _bisect_threshold(keys: jax.Array, holds: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """Per row, the smallest key t (uint32 [S]) at which `holds(t)` (bool [S], false
    below some key and true from it on) is true, searched between each row's smallest
    and largest key: 32 halvings cover the whole uint32 range."""
    lo, hi = jnp.min(keys, axis=-1), jnp.max(keys, axis=-1)

    def halve(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = holds(mid)
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    return lax.fori_loop(0, 32, halve, (lo, hi))[1]
