"""Medusa draft heads: the module and its checkpoint loader.

A Medusa head reads the target's final (post-norm) hidden state at the position that
sampled a token and predicts the token after it: head i, from the feature at position t,
predicts the token at t + 2 + i. Each head is a stack of residual blocks
`x <- x + SiLU(W x + b)` and a vocabulary projection of its own (or one shared
`lm_head` with `original_lm_head`). Drafts are each head's argmax, as vLLM proposes them
(top-1 only, no tree), so their distribution q is one-hot and the rejection sampler keeps
outputs distributed as the target's.

Checkpoints are the layout vLLM's `Medusa` model reads: a config.json with `num_heads`
and `num_hidden_layers` (FasterDecoding's `medusa_num_heads` / `medusa_num_layers` too),
`hidden_size`, `vocab_size`, optional `medusa_fc_bias`, `original_lm_head` and
`truncated_vocab_size`; tensors `blocks.{h}.layers.{l}.weight` (`.bias`),
`lm_heads.{h}.weight` (or `lm_head.weight`), or FasterDecoding's older names
`{h}.{l}.linear.weight` and `{h}.{L}.weight`. A truncated draft vocabulary (a
`token_map`) is refused. The heads' weights are replicated over a mesh. Not the
proposing (`runner.drafter.MedusaDrafter`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jvllm.models.loader import LoadedModel, read_config
from jvllm.models.safetensors_index import SafetensorsIndex
from jvllm.parallel.mesh import replicated

MEDUSA_ARCHITECTURES = ("MedusaModel",)


class MedusaHeads(nn.Module):
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_layers: int
    fc_bias: bool
    shared_lm_head: bool
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, features: jax.Array) -> jax.Array:
        """Each head's logits `[S, num_heads, V]` (float32) from features `[S, H]`."""
        h, v, k, n = self.hidden_size, self.vocab_size, self.num_heads, self.num_layers
        zeros = nn.initializers.zeros
        w = self.param("weight", zeros, (k, n, h, h), self.dtype)  # [head, layer, out, in]
        b = self.param("bias", zeros, (k, n, h), self.dtype) if self.fc_bias else None
        lm = self.param("lm_head", zeros, (1 if self.shared_lm_head else k, v, h), self.dtype)
        x = jnp.broadcast_to(features.astype(self.dtype)[:, None, :], (features.shape[0], k, h))
        for layer in range(n):
            y = jnp.einsum("ski,koi->sko", x, w[:, layer])
            if b is not None:
                y = y + b[:, layer]
            x = x + jax.nn.silu(y)
        lm = jnp.broadcast_to(lm, (k, v, h))
        return jnp.einsum("ski,kvi->skv", x, lm, preferred_element_type=jnp.float32)


def load_medusa_heads(
    path: str | Path, target: LoadedModel, num_drafts: int, mesh: Mesh | None = None
) -> LoadedModel:
    """Medusa heads for `target`, in the target's dtype, for `num_drafts` drafts a row (at
    most one per head); errors name what does not fit."""
    path = Path(path)
    config = read_config(path)
    where = f"speculative_config model {str(path)!r}"
    arch = (config.get("architectures") or ["MedusaModel"])[0]
    if arch not in MEDUSA_ARCHITECTURES:
        raise ValueError(f"{where}: architecture {arch!r} is not a Medusa model ('MedusaModel')")
    num_heads = int(config.get("num_heads", config.get("medusa_num_heads", 0)))
    num_layers = int(config.get("num_hidden_layers", config.get("medusa_num_layers", 1)))
    if num_heads < 1 or num_layers < 1:
        raise ValueError(f"{where}: needs num_heads >= 1 and num_hidden_layers >= 1")
    if num_drafts > num_heads:
        raise ValueError(
            f"{where}: num_speculative_tokens={num_drafts} exceeds the checkpoint's "
            f"{num_heads} Medusa heads (one draft per head)"
        )
    for field in ("hidden_size", "vocab_size"):
        ours, theirs = config.get(field), getattr(target.spec, field)
        if ours != theirs:
            raise ValueError(
                f"{where}: {field}={ours}, the target's is {theirs}; Medusa heads must be "
                "trained for the target model"
            )
    truncated = config.get("truncated_vocab_size")
    if truncated is not None and truncated < target.spec.vocab_size:
        raise ValueError(
            f"{where}: truncated_vocab_size={truncated} (a token_map) is not supported"
        )
    shared = bool(config.get("original_lm_head", False))
    module = MedusaHeads(
        target.spec.hidden_size,
        target.spec.vocab_size,
        num_heads,
        num_layers,
        bool(config.get("medusa_fc_bias", False)),
        shared,
        target.dtype,
    )
    arrays = _stacked_tensors(SafetensorsIndex(path), module, where)
    sharding = replicated(mesh) if mesh is not None else jax.devices()[0]
    params = {k: jax.device_put(jnp.asarray(a, target.dtype), sharding) for k, a in arrays.items()}
    spec = dataclasses.replace(target.spec, num_layers=0)  # no KV layers of its own
    return LoadedModel(spec, module, params, target.dtype, config)


def _stacked_tensors(index: SafetensorsIndex, m: MedusaHeads, where: str) -> dict[str, Any]:
    """The checkpoint's tensors stacked as the module's parameters (numpy, float32)."""
    old = "0.0.linear.weight" in index
    block = (
        (lambda h, j, p: f"{h}.{j}.linear.{p}")
        if old
        else (lambda h, j, p: f"blocks.{h}.layers.{j}.{p}")
    )

    def read(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in index:
            raise ValueError(f"{where}: tensor {index.describe(name, shape)} is missing")
        a = index.array(name)
        if a.shape != shape:
            raise ValueError(f"{where}: tensor {name!r} has shape {a.shape}, expected {shape}")
        return a.astype(np.float32)

    h, v, k, n = m.hidden_size, m.vocab_size, m.num_heads, m.num_layers
    out = {
        "weight": np.stack(
            [np.stack([read(block(i, j, "weight"), (h, h)) for j in range(n)]) for i in range(k)]
        )
    }
    if m.fc_bias:
        out["bias"] = np.stack(
            [np.stack([read(block(i, j, "bias"), (h,)) for j in range(n)]) for i in range(k)]
        )
    if m.shared_lm_head:
        out["lm_head"] = read("lm_head.weight", (v, h))[None]
    else:
        names = [f"{i}.{n}.weight" if old else f"lm_heads.{i}.weight" for i in range(k)]
        out["lm_head"] = np.stack([read(name, (v, h)) for name in names])
    return out
