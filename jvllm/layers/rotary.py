"""Rotary position embeddings and their frequency scalings (linear, llama3, dynamic NTK,
YaRN, LongRoPE), equal to Transformers' rope functions.

Owns the inverse frequencies (computed on the host in float32 numpy, as Transformers
computes them, then used as constants), the cos/sin scaling YaRN and LongRoPE apply
(`attention_scaling`), YaRN's extra softmax scale for latent attention
(`yarn_softmax_scale`), and the application to `[T, H, D]` queries and keys in Hugging
Face's half-split layout. Not owned: reading the parameters from config.json
(`jvllm.models.spec.rope_from_config`).

Two scalings depend on the length of the sequence being run, not on the position
alone. Transformers takes that length as `max(position_ids) + 1` of each forward:
dynamic NTK grows the base past `max_position_embeddings`, LongRoPE switches from its
short to its long factors past `original_max_position_embeddings`. `rope_cos_sin`
takes it per token (`rope_lens [T]`); `max(prompt_len, position + 1)` reproduces what a
batch-of-one Transformers generation computes for every token, prompt and output alike,
whatever the chunking of the prefill.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.models.spec import RopeSpec

# Types whose frequencies depend on the sequence length (see the module docstring).
LENGTH_DEPENDENT = ("dynamic", "longrope")


def _exponents(head_dim: int) -> np.ndarray:  # [D / 2] float32
    return np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim)


def rotary_dim(rope: RopeSpec, head_dim: int) -> int:
    """The leading dims of each head that rotate (`partial_rotary_factor`); the rest pass
    through unrotated, as Transformers' `int(head_dim * partial_rotary_factor)`."""
    return int(head_dim * rope.partial_rotary_factor)


def inverse_frequencies(
    rope: RopeSpec, head_dim: int, seq_len: int | None = None
) -> np.ndarray:  # [rotary_dim / 2] float32
    """The rope's inverse frequencies for a sequence of `seq_len` tokens (None: the
    frequencies a model starts with, before any length is seen)."""
    head_dim = rotary_dim(rope, head_dim)
    # float32 throughout, as Transformers computes it, so angles match to the last bit.
    base_inv = np.float32(1.0) / np.float32(rope.theta) ** _exponents(head_dim)
    if rope.rope_type == "linear":
        inv = base_inv / np.float32(rope.factor)
    elif rope.rope_type == "llama3":
        inv = _llama3_scale(base_inv, rope)
    elif rope.rope_type == "dynamic":
        inv = _dynamic_ntk(rope, head_dim, seq_len or rope.max_position_embeddings)
    elif rope.rope_type == "yarn":
        inv = _yarn(rope, head_dim)
    elif rope.rope_type == "longrope":
        long = seq_len is not None and seq_len > rope.original_max_position_embeddings
        inv = _longrope(rope, head_dim, long)
    else:
        inv = base_inv
    return np.asarray(inv, np.float32)


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


def _ntk_base(rope: RopeSpec, head_dim: int, length):  # float, or float32 array [T]
    """Dynamic NTK's base for sequences of `length` >= max_position_embeddings tokens;
    a Python number or a jax array alike."""
    growth = rope.factor * length / rope.max_position_embeddings - (rope.factor - 1)
    return rope.theta * growth ** (head_dim / (head_dim - 2))


def _dynamic_ntk(rope: RopeSpec, head_dim: int, seq_len: int) -> np.ndarray:
    length = max(int(seq_len), rope.max_position_embeddings)  # no change up to it
    base = np.float32(_ntk_base(rope, head_dim, length))
    return np.float32(1.0) / base ** _exponents(head_dim)


def _yarn_correction_range(rope: RopeSpec, head_dim: int) -> tuple[float, float]:
    """The band of dimensions between extrapolation (fast rotations, kept) and
    interpolation (slow rotations, divided by factor)."""

    def dim_of(rotations: float) -> float:
        turns = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(rope.theta))

    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, head_dim - 1)


def _yarn(rope: RopeSpec, head_dim: int) -> np.ndarray:
    pos_freqs = np.float32(rope.theta) ** _exponents(head_dim)
    extrapolated = np.float32(1.0) / pos_freqs
    interpolated = np.float32(1.0) / (np.float32(rope.factor) * pos_freqs)
    low, high = _yarn_correction_range(rope, head_dim)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = (np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low)
    keep = np.float32(1.0) - np.clip(ramp, 0, 1).astype(np.float32)
    return interpolated * (1 - keep) + extrapolated * keep


def _longrope(rope: RopeSpec, head_dim: int, long: bool) -> np.ndarray:
    factors = rope.long_factor if long else rope.short_factor
    if len(factors) != head_dim // 2:
        which = "long_factor" if long else "short_factor"
        partial = rope.partial_rotary_factor != 1.0
        dims = f"{head_dim} rotary dims" if partial else f"head_dim {head_dim}"
        raise ValueError(
            f"config.json: longrope {which} has {len(factors)} values; {dims} needs {head_dim // 2}"
        )
    ext = np.asarray(factors, np.float32)
    return np.float32(1.0) / (ext * np.float32(rope.theta) ** _exponents(head_dim))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction `0.1 * mscale * ln(scale) + 1` (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_scaling(rope: RopeSpec) -> float:
    """The factor Transformers multiplies cos and sin by (1 but for yarn and longrope)."""
    if rope.attention_factor is not None and rope.rope_type in ("yarn", "longrope"):
        return rope.attention_factor
    if rope.rope_type == "yarn":
        if rope.mscale and rope.mscale_all_dim:
            ratio = yarn_mscale(rope.factor, rope.mscale)
            return ratio / yarn_mscale(rope.factor, rope.mscale_all_dim)
        return yarn_mscale(rope.factor)
    if rope.rope_type == "longrope" and rope.factor > 1.0:
        return math.sqrt(
            1 + math.log(rope.factor) / math.log(rope.original_max_position_embeddings)
        )
    return 1.0


def yarn_softmax_scale(rope: RopeSpec, scale: float) -> float:
    """`scale` times mscale(factor, mscale_all_dim)^2 where the rope sets mscale_all_dim:
    the softmax scale of DeepSeek's latent attention (Transformers' `yarn_apply_mscale`)."""
    if rope.rope_type != "default" and rope.mscale_all_dim:
        return scale * yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


def rotary_cos_sin(
    positions: jax.Array, inv_freq: np.ndarray, dtype: jnp.dtype, scaling: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """cos and sin `[T, D]` for each position, computed in float32, times `scaling`
    (`attention_scaling`), cast to dtype. inv_freq is `[D / 2]`, or `[T, D / 2]`."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)  # [T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    if scaling == 1.0:
        return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)
    return (jnp.cos(emb) * scaling).astype(dtype), (jnp.sin(emb) * scaling).astype(dtype)


def rope_cos_sin(
    rope: RopeSpec,
    head_dim: int,
    positions: jax.Array,  # [T] int32
    dtype: jnp.dtype,
    rope_lens: jax.Array | None = None,  # [T] int32; the length each token's rope sees
) -> tuple[jax.Array, jax.Array]:
    """cos and sin `[T, D]` of any rope type. Length-dependent types need rope_lens
    (see the module docstring); the others ignore it."""
    scaling = attention_scaling(rope)
    if rope.rope_type not in LENGTH_DEPENDENT:
        return rotary_cos_sin(positions, inverse_frequencies(rope, head_dim), dtype, scaling)
    head_dim = rotary_dim(rope, head_dim)  # the dynamic base's exponents
    if rope_lens is None:
        raise ValueError(f"rope type {rope.rope_type!r} needs each token's rope_lens")
    if rope.rope_type == "longrope":
        short = inverse_frequencies(rope, head_dim)
        long = inverse_frequencies(rope, head_dim, rope.original_max_position_embeddings + 1)
        is_long = (rope_lens > rope.original_max_position_embeddings)[:, None]
        inv = jnp.where(is_long, jnp.asarray(long), jnp.asarray(short))  # [T, D/2]
    else:
        lens = jnp.maximum(rope_lens, rope.max_position_embeddings).astype(jnp.float32)
        base = _ntk_base(rope, head_dim, lens)  # [T] float32
        inv = 1.0 / base[:, None] ** jnp.asarray(_exponents(head_dim))[None, :]
    return rotary_cos_sin(positions, inv, dtype, scaling)


def token_seq_lens(
    query_start_loc: jax.Array,  # [S + 1] int32
    seq_lens: jax.Array,  # [S] int32
    num_tokens: int,
) -> jax.Array:  # [T] int32
    """Each token's sequence length once this step's tokens are in (its row's seq_len;
    a padding token's is its padding row's, 0, or the last row's)."""
    row = jnp.searchsorted(query_start_loc, jnp.arange(num_tokens), side="right") - 1
    return seq_lens[jnp.clip(row, 0, seq_lens.shape[0] - 1)]


def step_cos_sin(
    rope: RopeSpec,
    head_dim: int,
    positions: jax.Array,  # [T] int32
    query_start_loc: jax.Array,  # [S + 1] int32
    seq_lens: jax.Array,  # [S] int32
    inv_freq: np.ndarray,  # [D / 2]: `inverse_frequencies`, for the other types
    dtype: jnp.dtype,
) -> tuple[jax.Array, jax.Array]:
    """cos and sin `[T, D]` of a step of the Llama-family models. Dynamic NTK takes each
    token's rope length from its sequence's length after this step: Transformers'
    `max(position_ids) + 1` of a batch-of-one generation when the prompt runs in one
    step (the whole prompt's length for every prompt token, position + 1 for each
    decoded one). A prompt prefilled in several chunks, or recomputed after preemption,
    takes each chunk's end instead. Every other type uses `inv_freq`."""
    if rope.rope_type == "dynamic":
        lens = token_seq_lens(query_start_loc, seq_lens, positions.shape[0])
        return rope_cos_sin(rope, head_dim, positions, dtype, lens)
    return rotary_cos_sin(positions, inv_freq, dtype, attention_scaling(rope))


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x `[T, H, D]` rotated by position; cos/sin `[T, Dr]`: the first Dr dims of each
    head rotate, the rest (a partial rotary factor's) pass through."""
    if cos.shape[-1] < x.shape[-1]:
        dr = cos.shape[-1]
        return jnp.concatenate([apply_rotary(x[..., :dr], cos, sin), x[..., dr:]], axis=-1)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
