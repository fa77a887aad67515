"""Weight quantization at load (`quantization="int8"` or `"fp8"`, vLLM's argument).

Owns the per-output-channel symmetric quantization of a float `[out, in]` linear weight
on the host, before it reaches the device (so no float copy of a quantized layer is ever
in device memory): int8 with scale max|w| / 127, or float8 e4m3 with scale max|w| / 448.
The model's `Linear` keeps the quantized weight and its `[out]` float32 scales and
computes `(x @ q.T) * scale` inside the jitted step. Embeddings, lm_head and norms stay
in the model dtype. Quantized checkpoint formats (GPTQ, AWQ, compressed-tensors) are not
read here.
"""

from __future__ import annotations

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
