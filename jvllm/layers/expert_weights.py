"""Quantized expert weights: the stacked int8 or float8 form of one expert projection
and the arithmetic the grouped matmuls apply to it.

Contract. A `QuantizedExperts` stands where a float `[E, N, K]` expert projection
(`[out, in]` per expert, as the checkpoint stores it) would: `weight` int8 or float8 e4m3
`[E, N, K]`, `scale` float32 `[E, N]` (one per expert and output channel) or `[E, 1]`
(one per expert, a per-tensor scale), so expert e's float weight is
`weight[e] * scale[e][:, None]`. The scale multiplies the output rows after the matmul,
never the weight; with `activations="token"` each input row is first rounded through
float8 at its own scale (`quantize_input_rows`). On the CPU tile loop the tile's own
expert's row of scales multiplies the outputs, under
`ragged_dot` with each sorted row's expert's scales gathered (`scale_rows`). Every shape
is static whatever the routing. Float projections pass through these helpers unchanged,
so the grouped matmuls take either form.

Not owned here: which checkpoint schemes map to this form (`models/expert_quantization.py`),
the grouped matmuls themselves (`layers/grouped_matmul.py`, `layers/moe.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from jvllm.models.quantization import quantize_tokens


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedExperts:
    weight: jax.Array  # [E, N, K] int8 or float8_e4m3fn
    scale: jax.Array  # [E, N] or [E, 1] float32
    # "token": each input row is rounded through float8 e4m3 at its own max|row| / 448
    # before the matmul (FP8 W8A8 with dynamic per-token inputs); None: float inputs.
    activations: str | None = field(default=None, metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        return self.weight.shape


ExpertWeight = jax.Array | QuantizedExperts


def expert_matrix(w: ExpertWeight, e: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Expert `e`'s `[N, K]` weight in `dtype`, unscaled for a quantized one (its scale
    goes on the output rows, `scale_expert_rows`)."""
    stored = w.weight if isinstance(w, QuantizedExperts) else w
    return jax.lax.dynamic_index_in_dim(stored, e, keepdims=False).astype(dtype)


def quantize_input_rows(rows: jax.Array, w: ExpertWeight) -> jax.Array:
    """`rows [M, K]` as `w` takes its inputs: each row rounded through float8 at its own
    scale (and back to the rows' dtype) for per-token FP8 activations, else unchanged.
    Rows are whole tokens (or token-expert pairs), so this is per token as compressed-
    tensors' dynamic quantizer is."""
    if not isinstance(w, QuantizedExperts) or w.activations is None:
        return rows
    xq, x_scale = quantize_tokens(rows)  # [M, K] float8, [M, 1] float32
    return (xq.astype(jnp.float32) * x_scale).astype(rows.dtype)


def scale_expert_rows(y: jax.Array, w: ExpertWeight, e: jax.Array) -> jax.Array:
    """`y [M, N]`, all rows expert `e`'s, times that expert's output-channel scales."""
    if not isinstance(w, QuantizedExperts):
        return y
    scale = jax.lax.dynamic_index_in_dim(w.scale, e, keepdims=False)  # [N] or [1]
    return (y.astype(jnp.float32) * scale).astype(y.dtype)


def stored_weight(w: ExpertWeight, dtype: jnp.dtype) -> jax.Array:
    """The `[E, N, K]` stored values in `dtype` (unscaled), for `ragged_dot`."""
    return (w.weight if isinstance(w, QuantizedExperts) else w).astype(dtype)


def scale_rows(y: jax.Array, w: ExpertWeight, row_experts: jax.Array) -> jax.Array:
    """`y [M, N]` times each row's expert's scales; `row_experts [M]` may hold E for rows
    of no local expert (their values are selected away later), clamped here."""
    if not isinstance(w, QuantizedExperts):
        return y
    last = w.scale.shape[0] - 1
    scale = w.scale[jnp.minimum(row_experts, last)]  # [M, N] or [M, 1]
    return (y.astype(jnp.float32) * scale).astype(y.dtype)


def dequantized(w: ExpertWeight, dtype: jnp.dtype) -> jax.Array:
    """The `[E, N, K]` float weight (tests' dense reference)."""
    if not isinstance(w, QuantizedExperts):
        return w
    return (w.weight.astype(jnp.float32) * w.scale[:, :, None]).astype(dtype)
