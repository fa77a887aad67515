"""Which quantized forms a mixture-of-experts model's experts load in, and converting
their checkpoint tensors to the device form.

The device form (`layers/expert_weights.py`) is one per-(expert, output channel) scale
on an int8 or float8 weight, or one scale per expert. It covers:

- `quantization="int8"` / `"fp8"` at load: each expert's `[out, in]` weight quantized on
  the host per output channel, as dense layers are (`quantization.quantize`);
- compressed-tensors pack-quantized 8-bit symmetric per-channel weights (llm-compressor's
  W8A16): `weight_packed` `[out, in / 4]` int32 words of unsigned bytes, unpacked here to
  int8 `[out, in]` (the values minus 128), and `weight_scale` `[out, 1]`;
- compressed-tensors float-quantized float8 weights with float inputs, per channel
  (`weight_scale` `[out, 1]`) or per tensor (`[1]`), or with dynamic per-token float8
  inputs (llm-compressor's FP8_DYNAMIC): each expert's input rows are rounded through
  float8 at their own scale before the matmul (`layers/expert_weights.py`). Their
  down_proj inputs must be whole on a device (a row's scale is its max over all of
  them), so they take expert parallelism or one device, not a tensor-parallel split.

compressed-tensors pack-quantized symmetric 4-bit ints (llm-compressor's W4A16), and
8-bit ints by groups, are dequantized here at load (`dequantized_expert`) to float
experts in the model dtype: `weight_packed` `[out, in * b / 32]` words of unsigned values
offset by 2^(b-1) (unpacked by `packed_tensors.unpack_words`, as dense layers' are) times
`weight_scale` `[out, G]`, one scale per group of `in / G` inputs. Their device form is
float, 4x (bf16) or 8x (f32) the packed bytes.

Other schemes (zero points, activation order, GPTQ/AWQ layouts, block FP8, static
float8 activations) are refused at load with a ValueError naming the scheme; their dense
layers alone would load, which is not what the checkpoint means. The router (which
llm-compressor's recipes leave in float) is never quantized.
Not owned here: reading and stacking the per-expert tensors (`models/expert_tensors.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

from jvllm.models.packed_tensors import unpack_words
from jvllm.models.quantization import FloatWeights, PackedWeights

_SUPPORTED = (
    "quantization='int8' or 'fp8' at load, compressed-tensors pack-quantized 8-bit "
    "symmetric per-channel int weights (W8A16), float-quantized float8 weights per channel "
    "or per tensor with float or dynamic per-token float8 activations, compressed-tensors "
    "pack-quantized symmetric 4-bit (W4A16) or grouped 8-bit int weights (dequantized at load)"
)


@dataclass(frozen=True)
class ExpertScheme:
    """Experts stored as `storage` ("int8" or "fp8") with a float32 scale per output
    channel, or one per expert (`per_tensor`)."""

    storage: str  # "int8", "fp8", or "float": dequantized at load (`dequantized_expert`)
    per_tensor: bool = False
    packed: bool = False  # the checkpoint's int values come packed in int32 words
    bits: int = 8  # of a packed value
    group_size: int | None = None  # inputs per scale of a packed weight (None: a channel)
    activations: str | None = None  # "token": float8 inputs at a per-row scale

    @property
    def dequantized(self) -> bool:
        """The experts are float in the model (their scales applied at load)."""
        return self.storage == "float"

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(jnp.int8 if self.storage == "int8" else jnp.float8_e4m3fn)


def expert_scheme(quantization: Any, architecture: str) -> ExpertScheme | None:
    """The experts' form under the model's quantization scheme; ValueError naming a
    scheme the experts cannot take."""
    if quantization is None:
        return None
    if quantization in ("int8", "fp8"):
        return ExpertScheme(quantization)
    if quantization == PackedWeights(8, None):
        return ExpertScheme("int8", packed=True)
    if (
        isinstance(quantization, PackedWeights)
        and quantization.bits in (4, 8)
        and not (quantization.zero_points or quantization.act_order)
        and quantization.checkpoint_format == "compressed-tensors"
    ):
        return ExpertScheme("float", packed=True, bits=quantization.bits,
                            group_size=quantization.group_size)  # fmt: skip
    if isinstance(quantization, FloatWeights) and quantization.activations in (None, "token"):
        per_tensor = quantization.weight_strategy == "tensor"
        return ExpertScheme("fp8", per_tensor, activations=quantization.activations)
    raise ValueError(
        f"{architecture}: quantized experts in the scheme {quantization!r} are not "
        f"supported; supported: {_SUPPORTED}"
    )


def check_expert_split(
    scheme: ExpertScheme | None, tp: int, expert_parallel: bool, architecture: str
) -> None:
    """ValueError where a tensor-parallel split would cut the rows that one float8 input
    scale covers (down_proj's inputs, split over `tp` devices without expert parallelism)."""
    if scheme is not None and scheme.activations == "token" and tp > 1 and not expert_parallel:
        raise ValueError(
            f"{architecture}: experts with dynamic per-token float8 inputs (FP8_DYNAMIC) "
            f"need each token's whole down_proj input on one device; "
            f"tensor_parallel_size={tp} splits it. Supported: enable_expert_parallel=True "
            "(whole experts per device) or tensor_parallel_size=1"
        )


def expert_weight(array: np.ndarray, scheme: ExpertScheme) -> np.ndarray:
    """One expert's checkpoint weight (`weight_packed` words or float8 `weight`) ->
    its stored `[out, in]` values."""
    if not scheme.packed:
        return array
    return (unpack_words(np.asarray(array), 8) - 128).astype(np.int8)


def dequantized_expert(
    parts: tuple[np.ndarray, np.ndarray], scheme: ExpertScheme, name: str
) -> np.ndarray:
    """One expert's (`weight_packed` `[out, in * b / 32]`, `weight_scale` `[out, G]`) ->
    its float32 weight `[out, in]` (`name`: the tensor, for the error on a bad shape)."""
    words, scale = np.asarray(parts[0]), np.asarray(parts[1], dtype=np.float32)
    values = unpack_words(words, scheme.bits) - (1 << (scheme.bits - 1))  # [out, in]
    out, in_features = values.shape
    groups = 1 if scheme.group_size is None else in_features // scheme.group_size
    if scale.ndim == 1:
        scale = scale[:, None]  # [out] -> [out, 1]
    if scale.shape != (out, groups) or in_features % (scheme.group_size or 1):
        raise ValueError(
            f"tensor {name!r}: weight_packed {words.shape} with weight_scale {scale.shape}; "
            f"expected [out, in * {scheme.bits} / 32] and [out, in / {scheme.group_size}] "
            f"for {scheme.bits}-bit values in groups of {scheme.group_size} inputs"
        )
    per_group = values.reshape(out, groups, -1).astype(np.float32)
    return (per_group * scale[:, :, None]).reshape(out, in_features)


def expert_scale(array: np.ndarray) -> np.ndarray:
    """One expert's `weight_scale` (`[out, 1]`, `[1]` or a scalar) -> `[out]` or `[1]`."""
    return np.asarray(array).reshape(-1)


def scale_name(param: str) -> str:
    """The scale parameter that goes with a quantized weight parameter: `weight` ->
    `weight_scale` (a dense layer), `gate_proj` -> `gate_proj_scale` (stacked experts)."""
    return "weight_scale" if param == "weight" else f"{param}_scale"
