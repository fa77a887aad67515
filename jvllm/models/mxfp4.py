"""gpt-oss's expert tensors, float or MXFP4, served under the model's names.

The model holds each layer's experts as `mlp.experts.{gate,up}_proj [E, I, H]`,
`down_proj [E, H, I]`, `{gate,up}_proj_bias [E, I]` and `down_proj_bias [E, H]`.
Checkpoints store them two ways, both read here:

- float, as Transformers writes them: `experts.gate_up_proj [E, H, 2I]`, gate and up
  interleaved on the last axis (gate at even columns), `experts.gate_up_proj_bias
  [E, 2I]` interleaved alike, `experts.down_proj [E, I, H]`;
- MXFP4, as the released checkpoints (`quantization_config.quant_method: "mxfp4"`):
  `experts.gate_up_proj_blocks uint8 [E, 2I, H / 32, 16]` and `_scales uint8 [E, 2I,
  H / 32]` (already `[out, in]`), the same for `down_proj` `[E, H, I / 32, ...]`. Each
  byte holds two E2M1 codes (low nibble first); each group of 32 values shares the scale
  `2 ** (scale - 127)`. They are dequantized here, at load, to float32.

Not owned here: where each array goes (`parallel/loading.py`) and its dtype
(`loader.py`); other tensors pass through unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from jvllm.models.expert_tensors import TensorIndex
from jvllm.models.spec import ModelSpec

# E2M1 code -> value (sign bit 3, then two exponent bits and one mantissa bit).
FP4_VALUES = np.array(
    [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32
)
MXFP4_GROUP = 32


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks `uint8 [..., G, 16]`, scales `uint8 [..., G]` -> float32 `[..., G * 32]`."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_GROUP // 2:
        raise ValueError(
            f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not match "
            f"([..., G, {MXFP4_GROUP // 2}] and [..., G])"
        )
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [..., G, 16, 2]
    values = FP4_VALUES[codes].reshape(*scales.shape, MXFP4_GROUP)  # [..., G, 32]
    exponent = scales.astype(np.int32) - 127
    values = np.ldexp(values, exponent[..., None])
    return values.reshape(*scales.shape[:-1], -1)


class GptOssCheckpoint:
    """The wrapped index, plus every layer's experts under the model's names."""

    def __init__(self, index: TensorIndex, spec: ModelSpec) -> None:
        self.index = index
        # model name -> (checkpoint tensors it is read from, how)
        self._sources: dict[str, tuple[list[str], Callable[..., np.ndarray]]] = {}
        for layer in range(spec.num_layers):
            self._add_layer(f"model.layers.{layer}.mlp.experts.")

    def _add_layer(self, p: str) -> None:
        gate, up = slice(0, None, 2), slice(1, None, 2)
        packed = f"{p}gate_up_proj_blocks" in self.index
        for name, rows in (("gate_proj", gate), ("up_proj", up)):
            if packed:
                sources = [f"{p}gate_up_proj_blocks", f"{p}gate_up_proj_scales"]
                read = lambda b, s, rows=rows: dequantize_mxfp4(b, s)[:, rows]  # noqa: E731
            else:  # [E, H, 2I] -> [E, I, H]
                sources = [f"{p}gate_up_proj"]
                read = lambda w, rows=rows: np.swapaxes(w[:, :, rows], 1, 2)  # noqa: E731
            self._sources[f"{p}{name}"] = (sources, read)
            bias = lambda b, rows=rows: np.asarray(b)[:, rows]  # noqa: E731
            self._sources[f"{p}{name}_bias"] = ([f"{p}gate_up_proj_bias"], bias)
        if f"{p}down_proj_blocks" in self.index:
            down = [f"{p}down_proj_blocks", f"{p}down_proj_scales"]
            self._sources[f"{p}down_proj"] = (down, dequantize_mxfp4)
        else:  # [E, I, H] -> [E, H, I]
            self._sources[f"{p}down_proj"] = ([f"{p}down_proj"], lambda w: np.swapaxes(w, 1, 2))

    def names(self) -> set[str]:
        consumed = {n for names, _ in self._sources.values() for n in names}
        return (self.index.names() - consumed) | set(self._sources)

    def __contains__(self, name: str) -> bool:
        return name in self._sources or name in self.index

    def describe(self, name: str, shape: tuple[int, ...]) -> str:
        if name in self._sources:
            return f"{name!r} of shape {shape} (read from {self._sources[name][0]})"
        return self.index.describe(name, shape)

    def file(self, name: str) -> Path:
        return self.index.file(self._sources[name][0][0] if name in self._sources else name)

    def array(self, name: str) -> np.ndarray:
        if name not in self._sources:
            return self.index.array(name)
        sources, read = self._sources[name]
        missing = [n for n in sources if n not in self.index]
        if missing:
            raise ValueError(f"checkpoint has no tensor {missing[0]!r} (for {name!r})")
        return np.ascontiguousarray(read(*(np.asarray(self.index.array(n)) for n in sources)))
