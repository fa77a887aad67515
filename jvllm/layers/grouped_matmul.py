"""The experts' MLP on expert-sorted rows as a loop over row tiles, one expert per tile:
the grouped matmul for backends without a grouped-GEMM kernel (the CPU).

Contract. `rows [M, H]` are sorted by expert: the first `group_sizes[0]` rows go to
expert 0, the next `group_sizes[1]` to expert 1, and so on; rows past `sum(group_sizes)`
belong to no group here (pairs routed to another device's experts). Returns `[M, H]`:
each grouped row through its expert's SiLU-gated MLP (weights `[E, out, in]`); what the
rows past the groups hold is unspecified (the caller selects them away).

Why a loop. JAX expands `jax.lax.ragged_dot_general` on a CPU into a masked dense
product over every expert (`lax._ragged_dot_general_impl`), so it reads and multiplies
every expert for every row. Here each group is cut into `ceil(size / tile)` tiles of
`tile` rows; tile j multiplies its `[tile, H]` rows by its own expert's weights only and
writes them back. A `while_loop` runs exactly the non-empty tiles (its trip count is
traced), so an empty expert costs nothing and its weights are never read; every shape is
static (at most `ceil(M / tile) + E` tiles), so no routing compiles a new program. The
rows are padded by one tile so that a group's last tile never runs off the end; the part
of a tile that runs into the next group is overwritten when that group's tiles run
(tiles run in group order), and past the last group it is the unspecified tail.

Not owned here: sorting pairs by expert and combining them (`layers/moe.py`), choosing
this path or `ragged_dot` (`layers/moe.py`), the GPU's Triton kernel (`kernels/`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jvllm.layers.expert_weights import (
    ExpertWeight,
    expert_matrix,
    quantize_input_rows,
    scale_expert_rows,
)


def silu_and_mul(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


def swiglu_oai(
    gate: jax.Array, up: jax.Array, alpha: float = 1.702, limit: float = 7.0
) -> jax.Array:
    """gpt-oss's clamped SwiGLU: the gate clamped from above, up to [-limit, limit],
    `(up + 1) * gate * sigmoid(alpha * gate)`."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


# The experts' gated activations by vLLM's names: (gate [.., I], up [.., I]) -> [.., I].
ACTIVATIONS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "silu": silu_and_mul,
    "swigluoai": swiglu_oai,
}


class ExpertBiases(NamedTuple):
    """Per-expert biases of the gate and up projections (gpt-oss), added before the
    activation; the down projection's bias is the caller's (it is routing-weighted)."""

    gate: jax.Array  # [E, I]
    up: jax.Array  # [E, I]


# rows [tile, K] x one expert's [N, K] (the checkpoint's [out, in]) -> [tile, N].
_ROWS_BY_OUT_IN = (((1,), (1,)), ((), ()))


class TilePlan(NamedTuple):
    count: jax.Array  # [] int32: how many tiles are non-empty (the loop's trip count)
    expert: jax.Array  # [max_tiles] int32: each tile's expert (valid below `count`)
    first_row: jax.Array  # [max_tiles] int32: each tile's first row in the sorted rows


def plan_tiles(group_sizes: jax.Array, num_rows: int, tile: int) -> TilePlan:
    """`group_sizes [E]` (summing to at most `num_rows`) -> the tiles, in group order."""
    num_groups = group_sizes.shape[0]
    max_tiles = -(-num_rows // tile) + num_groups  # each group wastes at most one tile
    tiles = (group_sizes + tile - 1) // tile  # [E]
    tiles_end = jnp.cumsum(tiles)  # [E]
    group_start = jnp.cumsum(group_sizes) - group_sizes  # [E]
    j = jnp.arange(max_tiles, dtype=jnp.int32)  # [max_tiles]
    expert = jnp.minimum(jnp.searchsorted(tiles_end, j, side="right"), num_groups - 1)
    within = j - (tiles_end - tiles)[expert]  # tile index inside its group
    first_row = group_start[expert] + within * tile
    return TilePlan(
        tiles_end[-1].astype(jnp.int32), expert.astype(jnp.int32), first_row.astype(jnp.int32)
    )


def tiled_expert_mlp(
    rows: jax.Array,  # [M, H], sorted by expert
    w_gate: ExpertWeight,  # [E, I, H]
    w_up: ExpertWeight,  # [E, I, H]
    w_down: ExpertWeight,  # [E, H, I]
    group_sizes: jax.Array,  # [E] int32
    tile: int,
    biases: ExpertBiases | None = None,
    activation: str = "silu",
) -> jax.Array:  # [M, H]
    """Each grouped row through its own expert's MLP, reading only non-empty experts
    (quantized ones in their stored width, each tile's outputs times its expert's
    output-channel scales)."""
    if tile < 1:
        raise ValueError(f"tile must be a positive number of rows, got {tile}")
    num_rows, hidden = rows.shape
    plan = plan_tiles(group_sizes, num_rows, tile)
    padded = jnp.concatenate([rows, jnp.zeros((tile, hidden), rows.dtype)])  # [M + tile, H]

    def body(state: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        j, out = state
        e, start = plan.expert[j], plan.first_row[j]
        block = jax.lax.dynamic_slice_in_dim(padded, start, tile)  # [tile, H]

        def mm(a: jax.Array, w: ExpertWeight) -> jax.Array:  # [tile, K] -> [tile, N]
            a = quantize_input_rows(a, w)
            y = jax.lax.dot_general(a, expert_matrix(w, e, a.dtype), _ROWS_BY_OUT_IN)
            return scale_expert_rows(y, w, e)

        gate, up = mm(block, w_gate), mm(block, w_up)  # [tile, I]
        if biases is not None:
            gate, up = gate + biases.gate[e], up + biases.up[e]
        hid = ACTIVATIONS[activation](gate, up)  # [tile, I]
        y = mm(hid, w_down).astype(out.dtype)  # [tile, H]
        return j + 1, jax.lax.dynamic_update_slice_in_dim(out, y, start, axis=0)

    out = jnp.zeros_like(padded)  # [M + tile, H]
    _, out = jax.lax.while_loop(lambda s: s[0] < plan.count, body, (jnp.int32(0), out))
    return out[:num_rows]
