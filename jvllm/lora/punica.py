"""The forward's LoRA products over a batch whose tokens use different adapters.

Owns `lora_delta` (punica's shrink then expand, for every token with its own adapter)
and `applying_lora`, which adds each target layer's delta to its output while a model
is applied, so that the model's own code (`models/llama.py`) knows nothing of adapters.

The adapters are stacked per target layer, A `[N, in, R]` and B `[N, R, out]` for the
`N = max_loras` device slots, zero-padded to `R = max_lora_rank`, the scaling folded
into B. A token's slot index is 0 for the base model, s for slot s (A[s - 1], B[s - 1]).
Rather than gather each token's matrices (BGMV) or sort tokens into segments (SGMV),
the shrink runs every slot at once as one matmul `[T, in] @ [in, N * R]`, a one-hot
mask keeps each token's own slot's R columns, and the expand is one matmul
`[T, N * R] @ [N * R, out]`: dense XLA matmuls, no gather, no data-dependent shape, so
mixing, loading and evicting adapters never recompiles. Its cost grows with N: at
N * R = 64 the two products are about 3% of a 4096 x 4096 layer's FLOPs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

# Per target layer "layer.module" (e.g. "0.q_proj"): (A [N, in, R], B [N, R, out]).
LoRAWeights = dict[str, tuple[jax.Array, jax.Array]]


def lora_delta(
    x: jax.Array,  # [T, in]
    a: jax.Array,  # [N, in, R]
    b: jax.Array,  # [N, R, out]
    slots: jax.Array,  # [T] int32: 0 the base model, s >= 1 slot s
) -> jax.Array:  # [T, out]
    """Each token's `x @ A[slot] @ B[slot]`, zero for the base model's tokens."""
    mask = jax.nn.one_hot(slots - 1, a.shape[0], dtype=x.dtype)  # [T, N]; slot 0: zeros
    shrunk = jnp.einsum("ti,nir->tnr", x, a.astype(x.dtype))  # [T, N, R]
    shrunk = shrunk * mask[:, :, None]
    return jnp.einsum("tnr,nro->to", shrunk, b.astype(x.dtype))


def target_name(module: nn.Module) -> str | None:
    """ "layer.module" of a decoder layer's attention or MLP projection
    (`model/layers_3/self_attn/q_proj` -> "3.q_proj"), else None."""
    path = module.path
    if len(path) != 4 or path[0] != "model" or not path[1].startswith("layers_"):
        return None
    if path[2] not in ("self_attn", "mlp"):
        return None
    return f"{path[1].removeprefix('layers_')}.{path[3]}"


@contextlib.contextmanager
def applying_lora(weights: LoRAWeights, slots: jax.Array) -> Iterator[None]:
    """Within it, every target projection's output gains its tokens' LoRA deltas
    (`slots` `[T]`: each token's slot). Traced code only: it acts while jit traces."""

    def interceptor(next_fun: Any, args: tuple, kwargs: dict, context: Any) -> Any:
        out = next_fun(*args, **kwargs)
        if context.method_name != "__call__":
            return out
        name = target_name(context.module)
        if name is None or name not in weights:
            return out
        a, b = weights[name]
        return out + lora_delta(args[0], a, b, slots).astype(out.dtype)

    with nn.intercept_methods(interceptor):
        yield
