"""A mixture-of-experts checkpoint's expert tensors, served under the model's names.

The model holds each sparse layer's experts stacked, `model.layers.L.mlp.experts.
{gate,up,down}_proj` `[E, out, in]`, and its router as `model.layers.L.mlp.gate.weight`.
Checkpoints spell them two ways, both read here:

- per expert, as the Hub stores them (and Transformers 5's `save_pretrained` writes
  them): `mlp.experts.N.{gate,up,down}_proj.weight`, or Mixtral's
  `block_sparse_moe.experts.N.{w1,w3,w2}.weight` with its router `block_sparse_moe.gate`;
- fused, as Transformers 5 holds them in memory: `mlp.experts.gate_up_proj` `[E, 2I, H]`
  (gate rows first) and `mlp.experts.down_proj` `[E, H, I]`.

A stacked tensor is a `StackedExperts` view: indexing it reads only the experts (and
rows) asked for from the memory maps, so placing it expert-parallel copies each device's
slice alone and no host buffer holds a second full copy. Not owned here: the other
tensors (passed through from the wrapped index) and where each slice goes
(`parallel/loading.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np

from jvllm.models.expert_quantization import (
    ExpertScheme,
    dequantized_expert,
    expert_scale,
    expert_scheme,
    expert_weight,
)
from jvllm.models.spec import ModelSpec

# The model's projection name -> Mixtral's per-expert name.
_MIXTRAL_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


class TensorIndex(Protocol):
    def names(self) -> set[str]: ...
    def __contains__(self, name: str) -> bool: ...
    def describe(self, name: str, shape: tuple[int, ...]) -> str: ...
    def file(self, name: str) -> Path: ...
    def array(self, name: str) -> np.ndarray: ...


class StackedExperts:
    """`[E, ...]` made of per-expert arrays (or row slices of a fused one), read lazily;
    `convert` (a quantized checkpoint's unpacking or scale reshape) maps each part read
    to its stacked form, `part_shape`."""

    def __init__(
        self,
        parts: list[np.ndarray],
        convert: Callable[[np.ndarray], np.ndarray] | None = None,
        part_shape: tuple[int, ...] | None = None,
    ) -> None:
        self.parts = parts  # E arrays (memory maps or views of one), all one shape
        self.convert = convert
        first = convert(parts[0]) if convert is not None else parts[0]
        self.shape = (len(parts), *(part_shape or first.shape))
        self.dtype = first.dtype

    def __getitem__(self, index: tuple[slice, ...] | slice) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        experts = range(*index[0].indices(len(self.parts)))
        if self.convert is None:
            return np.stack([np.asarray(self.parts[e][index[1:]]) for e in experts])
        return np.stack([self.convert(self.parts[e])[index[1:]] for e in experts])

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        whole = self[:]
        return whole if dtype is None else whole.astype(dtype)


class ExpertCheckpoint:
    """The wrapped index, plus every sparse layer's stacked experts and router under the
    model's names; per-expert and fused tensors are consumed by the stacked names."""

    def __init__(self, index: TensorIndex, spec: ModelSpec) -> None:
        assert spec.moe is not None
        self.index = index
        self.spec = spec
        scheme = expert_scheme(spec.quantization, spec.architecture)
        # A checkpoint's own quantized experts (quantization at load reads float ones).
        self.scheme: ExpertScheme | None = None if isinstance(spec.quantization, str) else scheme
        # model name -> the checkpoint tensors it is made of
        self._sources: dict[str, list[str]] = {}
        # model name -> the per-expert scales a dequantized scheme folds into its weight
        self._scales: dict[str, list[str]] = {}
        for layer in spec.moe.sparse_layers:
            self._add_layer(f"model.layers.{layer}.")

    def _add_layer(self, prefix: str) -> None:
        e = self.spec.moe.num_experts
        for block in ("mlp", "block_sparse_moe"):
            if f"{prefix}{block}.gate.weight" in self.index:
                self._sources[f"{prefix}mlp.gate.weight"] = [f"{prefix}{block}.gate.weight"]
        # What a quantized checkpoint stores per expert: its weight and scale tensors.
        q = self.scheme
        stored = {"": "weight_packed" if q and q.packed else "weight"}
        stored |= {"_scale": "weight_scale"} if q else {}
        for proj, mixtral in _MIXTRAL_NAMES.items():
            model = f"{prefix}mlp.experts.{proj}"
            # llm-compressor writes Mixtral's experts under the names of its linearised
            # modules, `block_sparse_moe.experts.N.gate_proj`.
            for block, leaf in (
                ("mlp", proj),
                ("block_sparse_moe", mixtral),
                ("block_sparse_moe", proj),
            ):
                for suffix, tensor in stored.items():
                    names = [f"{prefix}{block}.experts.{n}.{leaf}.{tensor}" for n in range(e)]
                    if any(n in self.index for n in names):
                        if q is not None and q.dequantized and suffix:
                            self._scales[model] = names  # folded into the weight
                        else:
                            self._sources[model + suffix] = names
            fused = f"{prefix}mlp.experts.gate_up_proj"
            if proj != "down_proj" and fused in self.index:
                self._sources[model] = [fused]
            if proj == "down_proj" and model in self.index:
                self._sources[model] = [model]

    def names(self) -> set[str]:
        everything = [*self._sources.values(), *self._scales.values()]
        consumed = {n for names in everything for n in names}
        return (self.index.names() - consumed) | set(self._sources)

    def __contains__(self, name: str) -> bool:
        return name in self._sources or name in self.index

    def describe(self, name: str, shape: tuple[int, ...]) -> str:
        if ".mlp.experts." in name:
            forms = "per-expert `experts.N.*.weight` (quantized: `weight_packed` or float8 "
            forms += "`weight`, and `weight_scale`) or fused `experts.gate_up_proj`"
            return f"{name!r} of shape {shape} ({forms})"
        return self.index.describe(name, shape)

    def file(self, name: str) -> Path:
        return self.index.file(self._sources.get(name, [name])[0])

    def array(self, name: str) -> np.ndarray | StackedExperts:
        sources = self._sources.get(name)
        if sources is None:
            return self.index.array(name)
        if len(sources) > 1:  # one tensor per expert
            missing = [n for n in sources if n not in self.index]
            if missing:
                raise ValueError(
                    f"checkpoint lacks expert tensor {missing[0]!r} "
                    f"({len(missing)} of {len(sources)} experts of {name!r} missing)"
                )
            parts = [self.index.array(n) for n in sources]
            if self.scheme is None:
                return StackedExperts(parts)
            if self.scheme.dequantized:
                return self._dequantized(name, sources, parts)
            if name.endswith("_scale"):
                return StackedExperts(parts, expert_scale)
            scheme = self.scheme
            out, cols = parts[0].shape
            shape = (out, cols * 4) if scheme.packed else (out, cols)
            return StackedExperts(parts, lambda a: expert_weight(a, scheme), shape)
        return self._fused(name, sources[0])

    def _dequantized(
        self, name: str, sources: list[str], packed: list[np.ndarray]
    ) -> StackedExperts:
        """Packed int experts and their group scales -> a float32 `[E, out, in]` view."""
        scales = self._scales.get(name, [])
        missing = [n for n in scales if n not in self.index] or ([] if scales else [name])
        if missing:
            raise ValueError(f"checkpoint lacks expert tensor {missing[0]!r} (the scale)")
        read = [self.index.array(n) for n in scales]
        parts = list(zip(packed, read, sources, strict=True))  # per expert: words, scale, name
        scheme = self.scheme
        assert scheme is not None
        out, words = packed[0].shape
        return StackedExperts(
            parts,  # type: ignore[arg-type]
            lambda p: dequantized_expert(p[:2], scheme, p[2]),
            (out, words * 32 // scheme.bits),
        )

    def _fused(self, name: str, source: str) -> np.ndarray | StackedExperts:
        """A fused tensor (`gate_up_proj`'s half, or `down_proj`) as `[E, out, in]`."""
        whole = self.index.array(source)
        if not source.endswith(".gate_up_proj"):
            return whole
        half = self.spec.moe.intermediate_size
        if whole.shape[1] != 2 * half:
            raise ValueError(
                f"{self.index.file(source)}: tensor {source!r} has shape "
                f"{whole.shape}, expected [E, {2 * half}, H] from config.json"
            )
        rows = slice(0, half) if name.endswith(".gate_proj") else slice(half, 2 * half)
        return StackedExperts([whole[e, rows] for e in range(whole.shape[0])])
