"""Self-attention whose options differ from layer to layer: the attention block of the
Gemma 2/3 and gpt-oss model classes.

Owns one layer's q/k/v/o projections, an optional per-head q/k norm (Gemma 3), the rotary
embedding of q and k with the cos/sin it is given (local and global layers may use
different ropes), and the paged attention call with this layer's options: softmax scale,
sliding window, logit soft cap and attention sinks (`sinks` `[Hq]`, one learned logit per
head, gpt-oss). On a `tp` mesh each device attends with its own heads (and its heads'
sinks) and its slice of the cache, as the Llama family's attention does. Not owned here:
what each option means in each backend (`layers/attention.py`, docs/attention_variants.md)
and which layer gets which option (the model classes; `layer_windows` reads the windows
from config.json's `layer_types`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jvllm.layers.attention import AttentionMetadata, KVCache, paged_attention
from jvllm.layers.rotary import apply_rotary
from jvllm.models.llama import spec_linear
from jvllm.models.quantization import param
from jvllm.models.spec import ModelSpec
from jvllm.parallel.mesh import AXIS, CACHE, HEADS


@dataclass(frozen=True)
class LayerOptions:
    """What one layer's attention computes beyond plain causal softmax attention."""

    scale: float  # softmax scale
    sliding_window: int | None = None  # None: full attention
    soft_cap: float | None = None  # logits become cap * tanh(logit / cap)
    sinks: bool = False  # a learned `sinks [Hq]` parameter joins the softmax denominator


def layer_windows(cfg: dict[str, Any], pattern: int) -> tuple[int | None, ...]:
    """Each layer's sliding window from `layer_types` (else Transformers' default: every
    `pattern`-th layer full, the others sliding)."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)
    ]
    known = ("sliding_attention", "full_attention")
    if len(types) != n or any(t not in known for t in types):
        raise ValueError(f"config.json: layer_types must list {n} entries of {known}, got {types}")
    window = cfg.get("sliding_window")
    if any(t == "sliding_attention" for t in types) and not window:
        raise ValueError("config.json: sliding_attention layers need a sliding_window")
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


class LayerAttention(nn.Module):
    """`self_attn.*`: q/k/v/o projections (biased where `spec.qkv_bias`/`spec.o_bias`),
    `q_norm`/`k_norm` per head when `qk_norm` builds them, `sinks` when asked."""

    spec: ModelSpec
    dtype: jnp.dtype
    backend: str
    options: LayerOptions
    mesh: Mesh | None = None
    # Builds a per-head norm module given its name (Gemma 3's q/k norm); None: no norm.
    qk_norm: Callable[[str], nn.Module] | None = None

    @nn.compact
    def __call__(
        self,
        x: jax.Array,  # [T, H]
        cos_sin: tuple[jax.Array, jax.Array],  # [T, D] each
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[jax.Array, KVCache]:
        s, o, t = self.spec, self.options, x.shape[0]
        linear = spec_linear(s, self.dtype)
        q = linear(s.num_heads * s.head_dim, s.qkv_bias, name="q_proj")(x)
        k = linear(s.num_kv_heads * s.head_dim, s.qkv_bias, name="k_proj")(x)
        v = linear(s.num_kv_heads * s.head_dim, s.qkv_bias, name="v_proj")(x)
        q = q.reshape(t, s.num_heads, s.head_dim)  # [T, Hq, D]
        k = k.reshape(t, s.num_kv_heads, s.head_dim)  # [T, Hkv, D]
        v = v.reshape(t, s.num_kv_heads, s.head_dim)
        if self.qk_norm is not None:
            q, k = self.qk_norm("q_norm")(q), self.qk_norm("k_norm")(k)
        q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        sinks = None
        if o.sinks:
            init = nn.initializers.zeros
            sinks = param(self, "sinks", init, (s.num_heads,), self.dtype).astype(jnp.float32)
        out, cache = self._attend(q, k, v, cache, meta, sinks)
        out = linear(s.hidden_size, s.o_bias, name="o_proj")(out.reshape(t, -1))
        return out, cache

    def _attend(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        cache: KVCache,
        meta: AttentionMetadata,
        sinks: jax.Array | None,  # [Hq] float32
    ) -> tuple[jax.Array, KVCache]:
        o = self.options

        def attend(q, k, v, cache, meta, *sinks):
            return paged_attention(
                self.backend,
                q,
                k,
                v,
                cache,
                meta,
                o.scale,
                o.sliding_window,
                soft_cap=o.soft_cap,
                sinks=sinks[0] if sinks else None,
            )

        extra = () if sinks is None else (sinks,)
        if self.mesh is None:
            return attend(q, k, v, cache, meta, *extra)
        # Each device attends with its own heads, their sinks and its slice of the cache.
        context = jax.sharding.get_abstract_mesh()
        attend = jax.shard_map(
            attend,
            mesh=context if context.manual_axes else self.mesh,
            in_specs=(HEADS, HEADS, HEADS, (CACHE, CACHE), P()) + (P(AXIS),) * len(extra),
            out_specs=(HEADS, (CACHE, CACHE)),
            check_vma=False,
        )
        return attend(q, k, v, cache, meta, *extra)


def partial_norm(cls: type[nn.Module], **fields: object) -> Callable[[str], nn.Module]:
    """`name -> cls(name=name, **fields)`: a `qk_norm` builder."""
    return lambda name: functools.partial(cls, **fields)(name=name)
