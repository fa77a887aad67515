"""Rotary position embeddings (default, linear and llama3 frequency scaling).

Owns the inverse frequencies (computed once on the host in float32 numpy, then
used as a constant) and their application to `[T, H, D]` queries and keys in
Hugging Face's half-split layout.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.models.spec import RopeSpec


def inverse_frequencies(rope: RopeSpec, head_dim: int) -> np.ndarray:  # [D / 2] float32
    # float32 throughout, as Transformers computes it, so angles match to the last bit.
    exponents = np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim)
    inv = np.float32(1.0) / np.float32(rope.theta) ** exponents
    if rope.rope_type == "linear":
        inv = inv / rope.factor
    elif rope.rope_type == "llama3":
        inv = _llama3_scale(inv, rope)
    return inv.astype(np.float32)


def _llama3_scale(inv: np.ndarray, rope: RopeSpec) -> np.ndarray:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated smoothly (Llama 3.1's long-context recipe).
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * inv / rope.factor + smooth * inv
    scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def rotary_cos_sin(
    positions: jax.Array, inv_freq: np.ndarray, dtype: jnp.dtype
) -> tuple[jax.Array, jax.Array]:
    """cos and sin `[T, D]` for each position, computed in float32, cast to dtype."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x `[T, H, D]` rotated by position; cos/sin `[T, D]`."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
