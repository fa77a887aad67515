"""Rejection sampling of draft tokens (speculative decoding with a draft model), on device.

A row whose position holds a draft token d drawn from q accepts d with probability
min(1, p(d) / q(d)), p being the row's target distribution after every processor, and
otherwise draws from the normalised residual max(p - q, 0), so the token is
distributed as p exactly. A rejected d has no residual mass, so a row kept its draft
exactly when its token equals the draft. Owns that test; not the residual's draw
(`draws.blocked_race`, the sampler's) or the target distribution's processors
(`sampling.py`, `top_k_top_p.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jvllm.layers.sampler.draws import argmax_rows, blocked_race
from jvllm.layers.sampler.metadata import SamplingMetadata
from jvllm.layers.sampler.top_k_top_p import filter_logits
from jvllm.sampling_params import SAMPLING_EPS

# Folded into a row's key for the accept/reject uniform (the draws keep the plain key).
_ACCEPT_TAG = 0x5EC


def target_probs(penalised: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Each row's distribution after every processor: softmax of the filtered logits, or
    one-hot at the argmax for greedy rows. `[S, V]` float32."""
    greedy = md.temperature < SAMPLING_EPS
    probs = jax.nn.softmax(filter_logits(penalised, md), axis=-1)
    one_hot = jax.nn.one_hot(argmax_rows(penalised), penalised.shape[-1])
    return jnp.where(greedy[:, None], one_hot, probs)


def rejection_sample(
    p: jax.Array, q: jax.Array, draft_ids: jax.Array, keys: jax.Array, residual: bool = True
) -> jax.Array:
    """Speculative sampling's decision per row: `draft_ids[i]`, drawn from `q[i]`, is kept
    with probability min(1, p(d) / q(d)); otherwise a token is drawn from the residual
    max(p - q, 0), renormalised (from p itself, were p and q equal). The result is
    distributed as p. `residual=False` draws the replacement from p instead, which is
    biased towards the draft (tests use it to show a test can tell the difference).

    p, q `[S, V]` probabilities; draft_ids `[S]`; keys `[S]` one PRNG key per row.
    """
    rows = jnp.arange(p.shape[0])
    p_d, q_d = p[rows, draft_ids], q[rows, draft_ids]  # [S]
    u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, _ACCEPT_TAG)))(keys)
    accept = u * q_d < p_d  # u < p(d) / q(d), without dividing by a zero q(d)
    weights = jnp.maximum(p - q, 0.0) if residual else p
    weights = jnp.where(jnp.sum(weights, axis=-1, keepdims=True) > 0, weights, p)
    replacement = blocked_race(weights, keys)
    return jnp.where(accept, draft_ids.astype(jnp.int32), replacement)
