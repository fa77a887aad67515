"""Quantized weights: int8/fp8 quantization at load, and packed-int checkpoints.

`quantization="int8"` or `"fp8"` (vLLM's argument) quantizes a float checkpoint:

Owns the per-output-channel symmetric quantization of a float `[out, in]` linear weight
on the host, before it reaches the device (so no float copy of a quantized layer is ever
in device memory): int8 with scale max|w| / 127, or float8 e4m3 with scale max|w| / 448.
The model's `Linear` keeps the quantized weight and its `[out]` float32 scales and
computes `(x @ q.T) * scale` inside the jitted step. Embeddings, lm_head and norms stay
in the model dtype.

Packed-int checkpoints (compressed-tensors pack-quantized, GPTQ, AWQ) share one device
layout, compressed-tensors': `weight_packed` int32 words (4- or 8-bit values, offset by
2**(bits-1), packed densely along the input dimension), `weight_scale` per group of
inputs (or per channel), with zero points `weight_zero_point` (int8, signed like the
values) and with activation order `weight_g_idx` (each input's group). `packed_weight`
declares those parameters and dequantizes them inside the step; `packed_formats.py`
converts the other layouts to this one on the host. `packed_weights(config)` reads and
checks a compressed-tensors quantization_config.

Float-quantized checkpoints (compressed-tensors FP8 W8A8) keep float8 weights with a
scale per output channel or one per tensor; `float_linear` rounds the inputs through
float8 first where the scheme says (per token, or at a calibrated per-tensor scale).

Block-scaled float8 checkpoints (`quant_method: "fp8"`) keep their float8 weights and
per-tile scales as stored; `block_float_weight` multiplies them out in the step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

QUANTIZATIONS = ("int8", "fp8")
# compressed-tensors activation orders that pack-quantized weights may carry.
_ACT_ORDERS = ("group", "dynamic", "weight", "static")
# The largest magnitude each storage type holds.
_QMAX = {"int8": 127.0, "fp8": float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)}
# The linear layers that are quantized: every projection of attention and the MLP.
QUANTIZED_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def param(module: nn.Module, name: str, init: Any, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """`module.param`, without Flax's shape check on every apply (an `eval_shape` of the
    initializer per parameter and trace: 0.5-0.8 s of the bench cpu preset's 10.5 s warm
    start). The loader checks every tensor's shape against the module's abstract
    parameters instead."""
    if not module.is_initializing() and module.has_variable("params", name):
        return module.get_variable("params", name)
    return module.param(name, init, shape, dtype)


def check_quantization(quantization: str | None) -> None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be None or one of {', '.join(QUANTIZATIONS)} (weights "
            f"quantized at load, per output channel); got {quantization!r}"
        )


def storage_dtype(quantization: str) -> jnp.dtype:
    return jnp.dtype(jnp.int8 if quantization == "int8" else jnp.float8_e4m3fn)


def quantize(weight: np.ndarray, quantization: str) -> tuple[np.ndarray, np.ndarray]:
    """`[..., out, in]` float -> (`[..., out, in]` int8 or float8_e4m3fn, `[..., out]`
    float32 scales): per output channel (of each expert, for stacked experts)."""
    w = np.asarray(weight, np.float32)
    peak = np.max(np.abs(w), axis=-1)
    scale = np.where(peak > 0, peak / _QMAX[quantization], 1.0).astype(np.float32)
    scaled = w / scale[..., None]
    if quantization == "int8":
        return np.clip(np.rint(scaled), -127, 127).astype(np.int8), scale
    return scaled.astype(ml_dtypes.float8_e4m3fn), scale


def dequantize(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The float32 weight a quantized one stands for (tests' references)."""
    return q.astype(np.float32) * scale[:, None]


@dataclass(frozen=True)
class PackedWeights:
    """Packed `bits`-bit int linear weights: one scale per `group_size` inputs (None: one
    per output channel); `zero_points`: asymmetric, w = (q - zero) * scale; `act_order`:
    input i belongs to group g_idx[i] rather than i // group_size."""

    bits: int
    group_size: int | None
    zero_points: bool = False
    act_order: bool = False
    # The checkpoint's layout, converted at load: compressed-tensors, gptq, gptq_v2, awq.
    checkpoint_format: str = "compressed-tensors"

    def num_groups(self, in_features: int) -> int:
        return 1 if self.group_size is None else in_features // self.group_size


# compressed-tensors float8 weight strategies, and (dynamic, strategy) of float8 inputs.
FLOAT_WEIGHT_STRATEGIES = ("channel", "tensor")
FLOAT_ACTIVATIONS = {(True, "token"): "token", (False, "tensor"): "tensor"}


@dataclass(frozen=True)
class FloatWeights:
    """compressed-tensors float-quantized linear weights (FP8 W8A8): float8 e4m3 weights
    with `weight_scale` per output channel ([out, 1], "FP8_DYNAMIC") or per tensor ([1],
    "FP8"). `activations`: None keeps inputs float; "token" rounds each token through
    float8 at its own max|x| / 448; "tensor" at the layer's calibrated `input_scale` [1]."""

    weight_strategy: str = "channel"
    activations: str | None = None
    # Float8 inputs meet the float8 weights in a float8 matmul (`with_fp8_matmul`: on a
    # GPU); otherwise both are cast up first, as compressed-tensors computes.
    fp8_matmul: bool = False

    def __post_init__(self) -> None:
        assert self.weight_strategy in FLOAT_WEIGHT_STRATEGIES, self.weight_strategy
        assert self.activations in (None, *FLOAT_ACTIVATIONS.values()), self.activations


def with_fp8_matmul(scheme: Any, device: jax.Device) -> Any:
    """`scheme` as the model is built for `device`: FP8 W8A8 layers with float8 inputs
    multiply in float8 on a GPU (XLA:GPU lowers a float8 dot to a float8 GEMM on Hopper
    and casts up where the hardware has none); elsewhere they keep compressed-tensors'
    cast-up arithmetic, which the CPU tests compare with Transformers exactly."""
    if isinstance(scheme, FloatWeights) and scheme.activations and device.platform == "gpu":
        return dataclasses.replace(scheme, fp8_matmul=True)
    return scheme


@dataclass(frozen=True)
class BlockFloatWeights:
    """`quant_method: "fp8"` checkpoints (DeepSeek-V3, Qwen3-FP8): float8 e4m3 weights
    with one float32 scale, `weight_scale_inv` (multiplied, despite its name), per
    `block` = (outputs, inputs) tile. Activations stay in the model dtype."""

    block: tuple[int, int]


def quantize_tokens(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row of x as float8 e4m3 at scale max|row| / 448, and the scales `[..., 1]`
    float32 (a dynamic per-token FP8 activation quantizer)."""
    qmax = _QMAX["fp8"]
    x32 = x.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(x32), axis=-1, keepdims=True) / qmax, 1e-12)
    return jnp.clip(x32 / scale, -qmax, qmax).astype(jnp.float8_e4m3fn), scale


def quantize_static(x: jax.Array, scale: jax.Array) -> jax.Array:
    """x as float8 e4m3 at one calibrated `scale` [1], values beyond 448 * scale clamped
    (a static per-tensor FP8 input quantizer)."""
    qmax = _QMAX["fp8"]
    return jnp.clip(x.astype(jnp.float32) / scale, -qmax, qmax).astype(jnp.float8_e4m3fn)


def float_linear(
    module: nn.Module, q: FloatWeights, x: jax.Array, features: int, dtype: jnp.dtype
) -> jax.Array:
    """Declares an FP8 W8A8 layer's parameters on `module` and returns x @ W.T, the
    inputs rounded through float8 first where `q` quantizes them (per token, or at the
    calibrated `input_scale`). With `q.fp8_matmul` both float8 operands go to the matmul
    as they are, accumulated in float32 and scaled after; otherwise they are cast up to
    `dtype` (scales applied) first."""
    zeros, ones = nn.initializers.zeros, nn.initializers.ones
    w = param(module, "weight", zeros, (features, x.shape[-1]), jnp.float8_e4m3fn)
    if q.weight_strategy == "tensor":
        scale = param(module, "weight_scale", ones, (1,), jnp.float32)
    else:
        scale = param(module, "weight_scale", ones, (features, 1), dtype)[:, 0]  # [out]
    if q.activations is None:
        return jnp.einsum("...i,oi->...o", x, w.astype(dtype)) * scale.astype(dtype)
    if q.activations == "token":
        xq, x_scale = quantize_tokens(x)
    else:
        x_scale = param(module, "input_scale", ones, (1,), jnp.float32)
        xq = quantize_static(x, x_scale)
    if not q.fp8_matmul:
        x = (xq.astype(jnp.float32) * x_scale).astype(x.dtype)
        return jnp.einsum("...i,oi->...o", x, w.astype(dtype)) * scale.astype(dtype)
    contract = (((x.ndim - 1,), (1,)), ((), ()))
    y = jax.lax.dot_general(xq, w, contract, preferred_element_type=jnp.float32)
    return (y * x_scale * scale.astype(jnp.float32)).astype(dtype)


def packed_weights(config: dict[str, Any], where: str) -> PackedWeights | FloatWeights:
    """The scheme of a compressed-tensors quantization_config; ValueError naming what is
    not supported (and what is)."""
    supported = (
        "pack-quantized int weights of 4 or 8 bits, symmetric or with zero points, by group "
        "(activation order 'group', 'weight' or none) or channel, with float activations; "
        "float-quantized (or naive-quantized) float8 weights per channel or per tensor, with "
        "float, dynamic "
        "per-token or static per-tensor float8 activations"
    )

    def refuse(what: str) -> ValueError:
        return ValueError(f"{where}: compressed-tensors {what} is not supported ({supported})")

    fmt = config.get("format")
    schemes: dict[str, PackedWeights | FloatWeights] = {}
    for name, group in (config.get("config_groups") or {}).items():
        if group.get("output_activations"):
            raise refuse(f"output activation quantization in config group {name!r}")
        group_format = group.get("format") or fmt
        # naive-quantized float8 weights (llm-compressor's weight-only float8) are stored
        # as float-quantized ones are: float8 `weight` and its `weight_scale`.
        naive_float = (group.get("weights") or {}).get("type") == "float"
        if group_format == "float-quantized" or (group_format == "naive-quantized" and naive_float):
            schemes[name] = _float_scheme(group, refuse)
            continue
        if group.get("input_activations"):
            raise refuse(f"activation quantization with {group_format!r} weights")
        if group_format != "pack-quantized":
            raise refuse(f"format {group_format!r}")
        schemes[name] = _int_scheme(group.get("weights") or {}, refuse)
    if len(set(schemes.values())) != 1:
        raise refuse(f"{len(set(schemes.values()))} different weight schemes")
    return next(iter(schemes.values()))


def _int_scheme(w: dict[str, Any], refuse: Any) -> PackedWeights:
    if w.get("type") != "int" or w.get("num_bits") not in (4, 8):
        raise refuse(f"{w.get('type')} weights of {w.get('num_bits')} bits")
    strategy, actorder = w.get("strategy"), w.get("actorder")
    # 'weight' (or 'static') order was applied while quantizing and needs no g_idx at
    # run time; 'group' (or 'dynamic') stores each input's group in weight_g_idx.
    if strategy not in ("group", "channel") or actorder not in (None, *_ACT_ORDERS):
        raise refuse(f"strategy {strategy!r} (actorder {actorder!r})")
    group_size = int(w["group_size"]) if strategy == "group" else None
    act_order = actorder in ("group", "dynamic") and group_size is not None
    return PackedWeights(
        int(w["num_bits"]),
        group_size,
        zero_points=not w.get("symmetric", True),
        act_order=act_order,
    )


def _float_scheme(group: dict[str, Any], refuse: Any) -> FloatWeights:
    w, a = group.get("weights") or {}, group.get("input_activations")
    strategy = w.get("strategy")
    float8 = ("float", 8)
    if (w.get("type"), w.get("num_bits")) != float8 or strategy not in FLOAT_WEIGHT_STRATEGIES:
        raise refuse(f"float weights of {w.get('num_bits')} bits by {strategy!r}")
    if not a:
        return FloatWeights(strategy)
    kind = "dynamic" if a.get("dynamic") else "static"
    activations = FLOAT_ACTIVATIONS.get((bool(a.get("dynamic")), a.get("strategy")))
    if (a.get("type"), a.get("num_bits")) != float8 or activations is None:
        what = f"{a.get('type')} activations of {a.get('num_bits')} bits"
        raise refuse(f"{kind} {what} by {a.get('strategy')!r}")
    if not a.get("symmetric", True):
        raise refuse("asymmetric float8 activations (with zero points)")
    return FloatWeights(strategy, activations)


def unpack(packed: jax.Array, bits: int, in_features: int) -> jax.Array:
    """`[out, in * bits / 32]` int32 -> `[out, in]` int32 in [-2**(bits-1), 2**(bits-1))."""
    per_word = 32 // bits
    shifts = bits * jnp.arange(per_word, dtype=jnp.int32)  # element e of a word: bits e*b..
    values = (packed[:, :, None] >> shifts) & ((1 << bits) - 1)  # [out, words, per_word]
    return values.reshape(packed.shape[0], -1)[:, :in_features] - (1 << (bits - 1))


def packed_weight(
    module: nn.Module, q: PackedWeights, features: int, in_features: int, dtype: jnp.dtype
) -> jax.Array:
    """Declares a packed layer's parameters on `module` and returns its `[out, in]`
    weight in `dtype`, dequantized inside the step (XLA fuses it into the matmul)."""
    words = (features, in_features * q.bits // 32)
    packed = param(module, "weight_packed", nn.initializers.zeros, words, jnp.int32)
    groups = q.num_groups(in_features)
    # Scales in the model dtype, as checkpoints store them.
    scale = param(module, "weight_scale", nn.initializers.ones, (features, groups), dtype)
    values = unpack(packed, q.bits, in_features)  # [out, in]
    zero = None
    if q.zero_points:
        zero = param(module, "weight_zero_point", nn.initializers.zeros, scale.shape, jnp.int8)
    if q.act_order:
        g_idx = param(module, "weight_g_idx", nn.initializers.zeros, (in_features,), jnp.int32)
        if zero is not None:
            values = values - zero[:, g_idx]  # [out, in]
        return values.astype(dtype) * scale[:, g_idx]
    grouped = values.reshape(features, groups, -1)  # [out, groups, group_size]
    if zero is not None:
        grouped = grouped - zero[:, :, None]
    return (grouped.astype(dtype) * scale[:, :, None]).reshape(features, in_features)


def block_float_weight(
    module: nn.Module, q: BlockFloatWeights, features: int, in_features: int, dtype: jnp.dtype
) -> jax.Array:
    """Declares a block-scaled float8 layer's parameters on `module` and returns its
    `[out, in]` weight in `dtype`, each tile times its scale (edge tiles may be partial)."""
    rows, cols = q.block
    w = param(module, "weight", nn.initializers.zeros, (features, in_features), jnp.float8_e4m3fn)
    tiles = (-(-features // rows), -(-in_features // cols))
    scale = param(module, "weight_scale_inv", nn.initializers.ones, tiles, jnp.float32)
    full = jnp.repeat(jnp.repeat(scale, rows, axis=0), cols, axis=1)  # [tiles * block]
    return (w.astype(jnp.float32) * full[:features, :in_features]).astype(dtype)


def dequantized_weight(
    module: nn.Module,
    q: PackedWeights | BlockFloatWeights,
    features: int,
    in_features: int,
    dtype: jnp.dtype,
) -> jax.Array:
    """The `[out, in]` weight of a layer whose checkpoint form is dequantized in the step."""
    if isinstance(q, BlockFloatWeights):
        return block_float_weight(module, q, features, in_features, dtype)
    return packed_weight(module, q, features, in_features, dtype)
