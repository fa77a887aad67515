"""The hybrid KV layout of a model with sliding-window and full-attention layers.

Owns whether a model's cache is laid out in two KV cache groups (`hybrid_sliding_window`:
layers alternating one-for-one between full attention and one window, as in Gemma 2
and gpt-oss), how many cache arrays that takes (`num_kv_arrays`: full layer j and
sliding layer j share array j), and, inside the traced step, which array and which
attention metadata each layer gets (`layer_kv`). The step's block-table array then holds
each row's full-group table in its first half of columns and its sliding-group table in
the second; the sliding layers' slots are computed here from their table.
Not owned: the block accounting (`jvllm.engine.kv.hybrid_kv_cache_manager`), the
attention itself (every backend already takes a window).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jvllm.layers.attention import AttentionMetadata, KVCache


def hybrid_sliding_window(
    spec: Any, enable_prefix_caching: bool, has_draft: bool, pp: int
) -> int | None:
    """The sliding group's window when `spec` (a `ModelSpec`) gets the hybrid layout,
    else None: its layers alternate one-for-one between full attention and a single
    window, and nothing the hybrid manager refuses is asked for (prefix caching, a
    draft model's lookahead slots, pipeline stages)."""
    windows = getattr(spec.variant, "layer_windows", None)
    if not windows or enable_prefix_caching or has_draft or pp > 1:
        return None
    sliding = [w for w in windows if w is not None]
    if len(set(sliding)) != 1 or 2 * len(sliding) != len(windows):
        return None
    return sliding[0]


def num_kv_arrays(spec: Any, hybrid: bool) -> int:
    """Cache arrays (K and V pairs) the target model needs."""
    return spec.num_layers // 2 if hybrid else spec.num_layers


def cache_indices(windows: Sequence[int | None]) -> list[int]:
    """Each layer's cache array in the hybrid layout: the j-th full layer and the j-th
    sliding layer share array j."""
    counts = {True: 0, False: 0}
    out = []
    for window in windows:
        sliding = window is not None
        out.append(counts[sliding])
        counts[sliding] += 1
    return out


def layer_kv(
    windows: Sequence[int | None],
    caches: Sequence[KVCache],
    meta: AttentionMetadata,
    positions: jax.Array,  # [T] int32
) -> tuple[list[int], list[AttentionMetadata]]:
    """Each layer's cache index and attention metadata. One array per layer (today's
    layout): layer i, and the step's metadata unchanged."""
    if len(caches) == len(windows):
        return list(range(len(windows))), [meta] * len(windows)
    assert 2 * len(caches) == len(windows), (len(caches), len(windows))
    full, sliding = group_metadata(meta, positions, caches[0][0].shape[1])
    metas = [full if w is None else sliding for w in windows]
    return cache_indices(windows), metas


def group_metadata(
    meta: AttentionMetadata,
    positions: jax.Array,  # [T] int32
    block_size: int,
) -> tuple[AttentionMetadata, AttentionMetadata]:
    """The full group's and the sliding group's metadata from a step whose tables hold
    both groups' (`[S, 2W]`). The packed slots are the full group's; a sliding slot
    comes from the token's row of the sliding table, padding (slot 0) staying 0."""
    tables = meta.block_tables  # [S, 2W]
    width = tables.shape[1] // 2
    full_tables, sliding_tables = tables[:, :width], tables[:, width:]  # [S, W] each
    num_tokens = meta.slot_mapping.shape[0]
    row = jnp.searchsorted(meta.query_start_loc, jnp.arange(num_tokens), side="right") - 1
    row = jnp.clip(row, 0, tables.shape[0] - 1)  # [T]
    block = sliding_tables[row, positions // block_size]  # [T]
    slots = jnp.where(meta.slot_mapping == 0, 0, block * block_size + positions % block_size)
    full = dataclasses.replace(meta, block_tables=full_tables)
    sliding = dataclasses.replace(
        meta, slot_mapping=slots.astype(jnp.int32), block_tables=sliding_tables
    )
    return full, sliding
