"""A packed checkpoint's tensors, named and shaped as the device layout wants them.

Owns `PackedCheckpoint`, which reads a GPTQ, AWQ or compressed-tensors checkpoint
(layouts in `packed_formats.py`) through the same calls as `SafetensorsIndex` (`names`,
`in`, `array`, `file`), so the loader places its tensors like any other. Each device
parameter comes from one checkpoint tensor, converted on the host when it is read:
a transpose, or unpacking and repacking int32 words; nothing is dequantized. A
checkpoint tensor of the wrong shape is a ValueError that names it, its shape and the
shape config.json implies. Tensors the scheme does not use (GPTQ's qzeros when
symmetric, g_idx without desc_act) are left out, as vLLM leaves them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jvllm.models.quantization import PackedWeights
from jvllm.models.safetensors_index import SafetensorsIndex

# A packed layer's device parameters (see quantization.packed_weight).
_PACKED_PARAMS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx")
# Device parameter -> the checkpoint tensor it is read from, per checkpoint layout.
_GPTQ_SOURCES = {
    "weight_packed": "qweight",
    "weight_scale": "scales",
    "weight_zero_point": "qzeros",
    "weight_g_idx": "g_idx",
}
_SOURCES = {
    "compressed-tensors": {},
    "gptq": _GPTQ_SOURCES,
    "gptq_v2": _GPTQ_SOURCES,
    "awq": {"weight_packed": "qweight", "weight_scale": "scales", "weight_zero_point": "qzeros"},
}
# AWQ's word slot i holds column AWQ_ORDER[i] of its 8; column k sits in slot REVERSE[k].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_REVERSE = np.argsort(AWQ_ORDER)


def unpack_words(words: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned `bits`-bit values packed low bits first along the last axis of int32
    words: `[..., n]` -> `[..., n * 32 / bits]` int32."""
    shifts = bits * np.arange(32 // bits, dtype=np.uint32)
    values = (words.view(np.uint32)[..., None] >> shifts) & ((1 << bits) - 1)
    return values.reshape(*words.shape[:-1], -1).astype(np.int32)


def pack_words(values: np.ndarray, bits: int) -> np.ndarray:
    """The inverse of `unpack_words`: `[..., m]` unsigned values -> `[..., m * bits / 32]`."""
    per_word = 32 // bits
    grouped = values.astype(np.uint32).reshape(*values.shape[:-1], -1, per_word)
    shifts = bits * np.arange(per_word, dtype=np.uint32)
    return np.bitwise_or.reduce(grouped << shifts, axis=-1).view(np.int32)


class PackedCheckpoint:
    """`index`'s tensors under device parameter names; `shapes` holds each device
    parameter's shape (the checkpoint's own, before any KV-head replication)."""

    def __init__(
        self, index: SafetensorsIndex, scheme: PackedWeights, shapes: dict[str, tuple[int, ...]]
    ) -> None:
        self.index, self.scheme, self.shapes = index, scheme, shapes
        self._sources = _SOURCES[scheme.checkpoint_format]
        targets = {source: param for param, source in self._sources.items()}
        unused = {"weight_zero_point"} if not scheme.zero_points else set()
        unused |= {"weight_g_idx"} if not scheme.act_order else set()
        self._origin: dict[str, str] = {}  # device parameter name -> checkpoint tensor name
        for name in index.names():
            prefix, _, leaf = name.rpartition(".")
            param = targets.get(leaf, leaf)
            if param not in unused:
                self._origin[f"{prefix}.{param}"] = name

    def names(self) -> set[str]:
        return set(self._origin)

    def __contains__(self, name: str) -> bool:
        return name in self._origin

    def describe(self, name: str, shape: tuple[int, ...]) -> str:
        """The checkpoint tensor a device parameter of `shape` comes from, and its shape."""
        prefix, _, param = name.rpartition(".")
        source = f"{prefix}.{self._sources.get(param, param)}"
        if param not in _PACKED_PARAMS or f"{prefix}.weight_packed" not in self.shapes:
            return f"{source!r} (shape {shape})"
        out, in_features = self._dims(prefix)
        return f"{source!r} (shape {self._expected(param, out, in_features)})"

    def file(self, name: str) -> Path:
        return self.index.file(self._origin[name])

    def array(self, name: str) -> np.ndarray:
        """The device parameter `name` from its checkpoint tensor, in the device layout."""
        source, (prefix, _, param) = self._origin[name], name.rpartition(".")
        raw = self.index.array(source)
        layout = self.scheme.checkpoint_format
        if f"{prefix}.weight_packed" not in self.shapes or param not in _PACKED_PARAMS:
            return raw  # not a packed layer's parameter
        if layout == "compressed-tensors" and param in ("weight_packed", "weight_scale"):
            return raw  # already the device layout (the loader checks its shape)
        out, in_features = self._dims(prefix)
        expected = self._expected(param, out, in_features)
        if raw.shape != expected:
            raise ValueError(
                f"{self.file(name)}: tensor {source!r} has shape {raw.shape}, expected "
                f"{expected} for {out} outputs and {in_features} inputs ({self._grouping()})"
            )
        groups = self.scheme.num_groups(in_features)
        if param == "weight_g_idx" and (raw.min() < 0 or raw.max() >= groups):
            raise ValueError(
                f"{self.file(name)}: tensor {source!r} holds group indices "
                f"{raw.min()}..{raw.max()}, expected 0..{groups - 1}"
            )
        return self._convert(param, raw, out)

    def _dims(self, prefix: str) -> tuple[int, int]:
        """(out, in) features of the packed layer at `prefix`."""
        out, words = self.shapes[f"{prefix}.weight_packed"]
        return out, words * 32 // self.scheme.bits

    def _grouping(self) -> str:
        q = self.scheme
        per = f"groups of {q.group_size}" if q.group_size else "one group per channel"
        return f"{q.bits} bits, {per}, {q.checkpoint_format} layout"

    def _expected(self, param: str, out: int, in_features: int) -> tuple[int, ...]:
        q, layout = self.scheme, self.scheme.checkpoint_format
        groups = q.num_groups(in_features)
        out_words, in_words = -(-out * q.bits // 32), in_features * q.bits // 32
        return {
            "weight_packed": (in_features, out_words) if layout == "awq" else (in_words, out),
            "weight_scale": (groups, out),
            # compressed-tensors packs its zero points along the output dimension.
            "weight_zero_point": (
                (out_words, groups) if layout == "compressed-tensors" else (groups, out_words)
            ),
            "weight_g_idx": (in_features,),
        }[param]

    def _convert(self, param: str, raw: np.ndarray, out: int) -> np.ndarray:
        """A checkpoint tensor of the expected shape -> its device parameter."""
        q, layout = self.scheme, self.scheme.checkpoint_format
        offset = 1 << (q.bits - 1)  # unsigned stored value -> the signed one of the layout
        if param == "weight_g_idx":
            return raw.astype(np.int32)
        # GPTQ and AWQ scales [G, out]; GPTQ words [in * bits / 32, out], packed by input.
        if param == "weight_scale" or (param == "weight_packed" and layout != "awq"):
            return np.ascontiguousarray(raw.T)
        if layout == "compressed-tensors":  # zero points: [out words, G] -> [out, G]
            zeros = unpack_words(np.ascontiguousarray(raw.T), q.bits)[:, :out]  # [G, out]
            return (zeros - offset).T.astype(np.int8)
        values = unpack_words(raw, q.bits)  # packed by output: [in or G, out (rounded up)]
        if layout == "awq":
            values = values.reshape(*raw.shape, -1)[..., _AWQ_REVERSE].reshape(raw.shape[0], -1)
        values = values[:, :out]
        if param == "weight_packed":  # AWQ: [in, out] -> packed by input
            return pack_words(np.ascontiguousarray(values.T), q.bits)
        zeros = values + (1 if layout == "gptq" else 0)  # GPTQ v1 stores zero - 1
        return (zeros - offset).T.astype(np.int8)
