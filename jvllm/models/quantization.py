"""Quantized weights: int8/fp8 quantization at load, and compressed-tensors checkpoints.

`quantization="int8"` or `"fp8"` (vLLM's argument) quantizes a float checkpoint:

Owns the per-output-channel symmetric quantization of a float `[out, in]` linear weight
on the host, before it reaches the device (so no float copy of a quantized layer is ever
in device memory): int8 with scale max|w| / 127, or float8 e4m3 with scale max|w| / 448.
The model's `Linear` keeps the quantized weight and its `[out]` float32 scales and
computes `(x @ q.T) * scale` inside the jitted step. Embeddings, lm_head and norms stay
in the model dtype.

A compressed-tensors checkpoint (`quant_method: "compressed-tensors"`, format
`pack-quantized`, as llm-compressor and compressed-tensors write W4A16 / W8A16) keeps
its `weight_packed` int32 words (4- or 8-bit values, offset by 2**(bits-1), packed
densely along the input dimension) and `weight_scale` per group of inputs (or per
channel); the step unpacks and scales them before the matmul. `packed_weights(config)`
reads and checks its quantization_config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

QUANTIZATIONS = ("int8", "fp8")
# The largest magnitude each storage type holds.
_QMAX = {"int8": 127.0, "fp8": float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)}
# The linear layers that are quantized: every projection of attention and the MLP.
QUANTIZED_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def check_quantization(quantization: str | None) -> None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be None or one of {', '.join(QUANTIZATIONS)} (weights "
            f"quantized at load, per output channel); got {quantization!r}"
        )


def storage_dtype(quantization: str) -> jnp.dtype:
    return jnp.dtype(jnp.int8 if quantization == "int8" else jnp.float8_e4m3fn)


def quantize(weight: np.ndarray, quantization: str) -> tuple[np.ndarray, np.ndarray]:
    """`[out, in]` float -> (`[out, in]` int8 or float8_e4m3fn, `[out]` float32 scales)."""
    w = np.asarray(weight, np.float32)
    peak = np.max(np.abs(w), axis=1)
    scale = np.where(peak > 0, peak / _QMAX[quantization], 1.0).astype(np.float32)
    scaled = w / scale[:, None]
    if quantization == "int8":
        return np.clip(np.rint(scaled), -127, 127).astype(np.int8), scale
    return scaled.astype(ml_dtypes.float8_e4m3fn), scale


def dequantize(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The float32 weight a quantized one stands for (tests' references)."""
    return q.astype(np.float32) * scale[:, None]


@dataclass(frozen=True)
class PackedWeights:
    """compressed-tensors pack-quantized linear weights: symmetric `bits`-bit integers,
    one scale per `group_size` inputs (None: one per output channel)."""

    bits: int
    group_size: int | None

    def num_groups(self, in_features: int) -> int:
        return 1 if self.group_size is None else in_features // self.group_size


@dataclass(frozen=True)
class FloatWeights:
    """compressed-tensors float-quantized linear weights (FP8 W8A8, "FP8_DYNAMIC"):
    float8 e4m3 weights with a scale per output channel; with `dynamic_activations`
    each token's input is quantized to float8 too, by its own max|x| / 448."""

    dynamic_activations: bool


def fake_quantize_tokens(x: jax.Array) -> jax.Array:
    """Each row of x rounded through float8 e4m3 at scale max|row| / 448 (what a
    dynamic per-token FP8 activation quantizer computes before the matmul)."""
    qmax = _QMAX["fp8"]
    x32 = x.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(x32), axis=-1, keepdims=True) / qmax, 1e-12)
    q = jnp.clip(x32 / scale, -qmax, qmax).astype(jnp.float8_e4m3fn)
    return (q.astype(jnp.float32) * scale).astype(x.dtype)


def packed_weights(config: dict[str, Any], where: str) -> PackedWeights | FloatWeights:
    """The scheme of a compressed-tensors quantization_config; ValueError naming what is
    not supported (and what is)."""
    supported = (
        "pack-quantized int weights of 4 or 8 bits, symmetric, by group or channel, with "
        "float activations; float-quantized float8 weights per channel with float or "
        "dynamic per-token float8 activations"
    )

    def refuse(what: str) -> ValueError:
        return ValueError(f"{where}: compressed-tensors {what} is not supported ({supported})")

    fmt = config.get("format")
    schemes: dict[str, PackedWeights | FloatWeights] = {}
    for name, group in (config.get("config_groups") or {}).items():
        if group.get("output_activations"):
            raise refuse(f"output activation quantization in config group {name!r}")
        group_format = group.get("format") or fmt
        if group_format == "float-quantized":
            schemes[name] = _float_scheme(group, refuse)
            continue
        if group.get("input_activations"):
            raise refuse(f"activation quantization with {group_format!r} weights")
        if group_format != "pack-quantized":
            raise refuse(f"format {group_format!r}")
        w = group.get("weights") or {}
        if w.get("type") != "int" or w.get("num_bits") not in (4, 8):
            raise refuse(f"{w.get('type')} weights of {w.get('num_bits')} bits")
        if not w.get("symmetric", True):
            raise refuse("asymmetric weights (zero points)")
        if w.get("strategy") not in ("group", "channel") or w.get("actorder"):
            raise refuse(f"strategy {w.get('strategy')!r} (actorder {w.get('actorder')!r})")
        group_size = w.get("group_size") if w["strategy"] == "group" else None
        schemes[name] = PackedWeights(int(w["num_bits"]), group_size)
    if len(set(schemes.values())) != 1:
        raise refuse(f"{len(set(schemes.values()))} different weight schemes")
    return next(iter(schemes.values()))


def _float_scheme(group: dict[str, Any], refuse: Any) -> FloatWeights:
    w, a = group.get("weights") or {}, group.get("input_activations")
    if w.get("type") != "float" or w.get("num_bits") != 8 or w.get("strategy") != "channel":
        raise refuse(f"float weights of {w.get('num_bits')} bits by {w.get('strategy')!r}")
    if a and not (a.get("type") == "float" and a.get("dynamic") and a.get("strategy") == "token"):
        raise refuse(
            f"{'dynamic' if a.get('dynamic') else 'static'} activations by {a.get('strategy')!r}"
        )
    return FloatWeights(dynamic_activations=bool(a))


def unpack(packed: jax.Array, bits: int, in_features: int) -> jax.Array:
    """`[out, in * bits / 32]` int32 -> `[out, in]` int32 in [-2**(bits-1), 2**(bits-1))."""
    per_word = 32 // bits
    shifts = bits * jnp.arange(per_word, dtype=jnp.int32)  # element e of a word: bits e*b..
    values = (packed[:, :, None] >> shifts) & ((1 << bits) - 1)  # [out, words, per_word]
    return values.reshape(packed.shape[0], -1)[:, :in_features] - (1 << (bits - 1))
