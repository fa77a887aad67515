"""Fused projections of a checkpoint, served as the separate tensors the model holds.

Phi-3 stores attention's q, k and v projections as one `self_attn.qkv_proj.weight`
`[(Hq + 2 Hkv) * D, H]` (q rows, then k, then v) and the MLP's gate and up projections
as one `mlp.gate_up_proj.weight` `[2 I, H]` (gate rows first). The model holds them apart
(`q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj`), so tensor-parallel placement
splits each by heads or by the intermediate axis as for Llama; each part is a row view
of the memory-mapped fused tensor, so no copy is made before placement. Not owned here:
the other tensors (passed through from the wrapped index) and where each slice goes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jvllm.models.expert_tensors import TensorIndex
from jvllm.models.spec import ModelSpec

# Architectures whose checkpoints fuse q/k/v and gate/up.
FUSED_ARCHITECTURES = ("Phi3ForCausalLM",)


class FusedProjections:
    """The wrapped index, with each layer's fused tensors replaced by their parts."""

    def __init__(self, index: TensorIndex, spec: ModelSpec) -> None:
        self.index = index
        # model name -> (fused checkpoint name, first row, end row)
        self._parts: dict[str, tuple[str, int, int]] = {}
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        inter = spec.intermediate_size
        for layer in range(spec.num_layers):
            attn, mlp = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
            rows = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
            for part, (lo, hi) in rows.items():
                self._parts[f"{attn}{part}.weight"] = (f"{attn}qkv_proj.weight", lo, hi)
            for part, (lo, hi) in {"gate_proj": (0, inter), "up_proj": (inter, 2 * inter)}.items():
                self._parts[f"{mlp}{part}.weight"] = (f"{mlp}gate_up_proj.weight", lo, hi)
        self._sizes = {fused: 0 for fused, _, _ in self._parts.values()}
        for fused, _, hi in self._parts.values():
            self._sizes[fused] = max(self._sizes[fused], hi)

    def names(self) -> set[str]:
        present = {n for n, (fused, _, _) in self._parts.items() if fused in self.index}
        consumed = {self._parts[n][0] for n in present}
        return (self.index.names() - consumed) | present

    def __contains__(self, name: str) -> bool:
        part = self._parts.get(name)
        return name in self.index if part is None else part[0] in self.index

    def describe(self, name: str, shape: tuple[int, ...]) -> str:
        part = self._parts.get(name)
        if part is None:
            return self.index.describe(name, shape)
        return f"{part[0]!r} of {self._sizes[part[0]]} rows (holding {name!r} of shape {shape})"

    def file(self, name: str) -> Path:
        part = self._parts.get(name)
        return self.index.file(name if part is None else part[0])

    def array(self, name: str) -> np.ndarray:
        part = self._parts.get(name)
        if part is None:
            return self.index.array(name)
        fused, lo, hi = part
        whole = self.index.array(fused)
        if whole.shape[0] != self._sizes[fused]:
            raise ValueError(
                f"{self.index.file(fused)}: tensor {fused!r} has {whole.shape[0]} rows, "
                f"expected {self._sizes[fused]} from config.json"
            )
        return whole[lo:hi]
