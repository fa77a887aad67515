"""The draft model of speculative decoding, on the device.

Owns the two programs a draft model adds to a step, both traced into the runner's
jitted functions:
- `write_kv`: the draft runs the target's own packed batch (same tokens, positions,
  slots, block tables) over its own KV layers, so its cache covers every position the
  target's does, in the same blocks (copy-on-write, swaps and the prefix cache's host
  tier move both, as one list of layers);
- `propose`: from each row's newest token (position p), k decode steps of the draft
  alone, each writing its K/V at p + i (slots the scheduler allocated ahead) and
  drawing the next draft token from q = softmax(logits / temperature) (one-hot at the
  argmax for greedy rows) with the request's seed at that output index. The drafts
  go to the host, the q rows stay on the device for the target's rejection sampler.
The draft's cache must share the target's block size and block count; its own layer,
head and dimension counts are free.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jvllm.layers.attention import AttentionMetadata, KVCache
from jvllm.models.loader import LoadedModel
from jvllm.runner.input_batch import ModelInput
from jvllm.sampling_params import SAMPLING_EPS

# Folded into the request's key at an output index for the draft's own draw, which must
# not repeat the target's draw at the same index.
_DRAFT_TAG = 0xD1AF


class ProposalInputs(NamedTuple):
    """One proposal call's rows, padded to a row bucket (numpy on the host)."""

    tokens: Any  # i32[S]: each row's newest token
    positions: Any  # i32[S]: its position p
    tables: Any  # i32[S, W]: block tables covering p + k - 1 where limits allow
    limits: Any  # i32[S]: draft tokens wanted (0 for padding rows), at most k
    seeds: Any  # u32[S]
    steps: Any  # i32[S]: output tokens before the newest one's successor
    temperature: Any  # f32[S]


class Drafter:
    def __init__(self, loaded: LoadedModel, num_speculative_tokens: int, block_size: int) -> None:
        self.model = loaded
        self.k = num_speculative_tokens
        self.block_size = block_size

    def write_kv(self, params: Any, caches: list[KVCache], inp: ModelInput) -> list[KVCache]:
        """The draft's K/V for the target's batch (its hidden states are not used)."""
        _, caches = self.model.module.apply(
            {"params": params}, inp.token_ids, inp.positions, caches, inp.attn
        )
        return caches

    def propose(
        self, params: Any, caches: list[KVCache], rows: ProposalInputs
    ) -> tuple[jax.Array, jax.Array, list[KVCache]]:
        """k draft tokens per row `[S, k]`, their distributions `[S * k, V]` (row r's
        i-th at r * k + i) and the updated cache. Steps past a row's limit write into
        the null block and their tokens are ignored."""
        module, bs = self.model.module, self.block_size
        num_rows = rows.tokens.shape[0]
        greedy = rows.temperature < SAMPLING_EPS
        temperature = jnp.where(greedy, 1.0, rows.temperature)[:, None]
        qsl = jnp.arange(num_rows + 1, dtype=jnp.int32)
        token = rows.tokens
        drafts, dists = [], []
        for i in range(self.k):
            valid = i < rows.limits
            # Past the limit, re-read position p: finite values, nothing written but
            # the null block.
            pos = jnp.where(valid, rows.positions + i, rows.positions)
            blocks = jnp.take_along_axis(rows.tables, (pos // bs)[:, None], axis=1)[:, 0]
            slots = jnp.where(valid, blocks * bs + pos % bs, 0)
            attn = AttentionMetadata(slots, qsl, pos + 1, rows.tables)
            hidden, caches = module.apply({"params": params}, token, pos, caches, attn)
            logits = module.apply({"params": params}, hidden, method=module.logits)
            logits = logits.astype(jnp.float32)
            argmax = jnp.argmax(logits, axis=-1)
            q = jax.nn.softmax(logits / temperature, axis=-1)
            q = jnp.where(greedy[:, None], jax.nn.one_hot(argmax, q.shape[-1]), q)
            token = jax.vmap(_draw)(rows.seeds, rows.steps + i, q).astype(jnp.int32)
            drafts.append(token)
            dists.append(q)
        q_rows = jnp.stack(dists, axis=1).reshape(num_rows * self.k, -1)
        return jnp.stack(drafts, axis=1), q_rows, caches


def _draw(seed: jax.Array, step: jax.Array, probs: jax.Array) -> jax.Array:
    """One row's draft token from `probs`, keyed by the request's seed and output index."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), _DRAFT_TAG)
    return jax.random.categorical(key, jnp.log(probs))
