"""Flax decoders of Gemma 2 (`Gemma2ForCausalLM`) and Gemma 3's text model
(`Gemma3ForCausalLM`), and their config.json reading (`gemma_spec`).

Owns what Gemma does differently from Llama: RMSNorm scaled by `(1 + w)` in float32;
norms before and after both attention and MLP; embeddings scaled by sqrt(hidden) (in
the model's dtype, as Transformers does); GeGLU with tanh-approximated GELU; the softmax
scale `query_pre_attn_scalar ** -0.5`; per-layer sliding windows from `layer_types`;
Gemma 2's attention-logit and final-logit soft-capping; Gemma 3's per-head q/k norms and
its separate rope for local (sliding) layers. Parameter names are the checkpoint's.
Not owned here: the attention block (`layer_attention.py`), the lm_head and the
vocab-parallel projection (`llama.py`), pipeline stages (refused for these models).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jvllm.layers.attention import AttentionMetadata, KVCache
from jvllm.layers.rotary import LENGTH_DEPENDENT, rope_cos_sin
from jvllm.models.kv_groups import layer_kv
from jvllm.models.layer_attention import (
    LayerAttention,
    LayerOptions,
    layer_windows,
    partial_norm,
)
from jvllm.models.llama import LMHead, spec_linear, vocab_projection
from jvllm.models.quantization import param
from jvllm.models.spec import ModelSpec, RopeSpec, rope_from_config

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


@dataclass(frozen=True)
class GemmaOptions:
    """Gemma's options beyond `ModelSpec` (its `variant`)."""

    query_pre_attn_scalar: float
    layer_windows: tuple[int | None, ...]  # per layer; None: full attention
    attn_soft_cap: float | None = None  # Gemma 2's attn_logit_softcapping
    final_soft_cap: float | None = None  # final_logit_softcapping
    qk_norm: bool = False  # Gemma 3
    local_rope: RopeSpec | None = None  # Gemma 3's rope of sliding layers (None: `spec.rope`)

    def layer_options(self, index: int) -> LayerOptions:
        return LayerOptions(
            scale=self.query_pre_attn_scalar**-0.5,
            sliding_window=self.layer_windows[index],
            soft_cap=self.attn_soft_cap,
        )


def _ropes(cfg: dict[str, Any], gemma3: bool) -> tuple[RopeSpec, RopeSpec | None]:
    nested = isinstance((cfg.get("rope_parameters") or {}).get("full_attention"), dict)
    if nested:
        ropes = rope_from_config(cfg, "full_attention"), rope_from_config(cfg, "sliding_attention")
    else:
        local = RopeSpec(theta=float(cfg.get("rope_local_base_freq") or 10000.0))
        ropes = rope_from_config(cfg), local if gemma3 else None
    for rope in ropes:
        if rope is not None and rope.rope_type in LENGTH_DEPENDENT:
            raise ValueError(
                f"config.json: rope type {rope.rope_type!r} is not supported by Gemma; "
                "supported: default, linear, llama3, yarn"
            )
    return ropes


def gemma_spec(cfg: dict[str, Any]) -> ModelSpec:
    """The ModelSpec of a Gemma 2 or Gemma 3 (text) config.json."""
    arch = cfg["architectures"][0]
    gemma3 = arch == "Gemma3ForCausalLM"
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _ACTIVATIONS:
        raise ValueError(f"config.json: hidden_activation {act!r} is not supported {_ACTIVATIONS}")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("config.json: use_bidirectional_attention=true is not supported")
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    rope, local_rope = _ropes(cfg, gemma3)
    cap = lambda key: float(cfg[key]) if cfg.get(key) else None  # noqa: E731
    options = GemmaOptions(
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or head_dim),
        layer_windows=layer_windows(cfg, 6 if gemma3 else 2),
        attn_soft_cap=cap("attn_logit_softcapping"),
        final_soft_cap=cap("final_logit_softcapping"),
        qk_norm=gemma3,
        local_rope=local_rope,
    )
    eos = cfg.get("eos_token_id")
    bias = bool(cfg.get("attention_bias", False))
    return ModelSpec(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
        rope=rope,
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 8192),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qkv_bias=bias,
        o_bias=bias,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        variant=options,
    )


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), all in float32, cast back at the end (Gemma's order)."""

    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = param(self, "weight", nn.initializers.zeros, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


class GemmaMLP(nn.Module):
    spec: ModelSpec
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [T, H]
        s = self.spec
        linear = spec_linear(s, self.dtype)
        gate = linear(s.intermediate_size, False, name="gate_proj")(x)
        up = linear(s.intermediate_size, False, name="up_proj")(x)
        return linear(s.hidden_size, False, name="down_proj")(
            jax.nn.gelu(gate, approximate=True) * up
        )


class GemmaDecoderLayer(nn.Module):
    spec: ModelSpec
    dtype: jnp.dtype
    backend: str
    mesh: Mesh | None = None
    layer_index: int = 0

    @nn.compact
    def __call__(
        self,
        x: jax.Array,  # [T, H]
        cos_sin: tuple[jax.Array, jax.Array],
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[jax.Array, KVCache]:
        s, options = self.spec, self.spec.variant
        norm = lambda name: GemmaRMSNorm(s.rms_norm_eps, self.dtype, name=name)  # noqa: E731
        qk_norm = None
        if options.qk_norm:
            qk_norm = partial_norm(GemmaRMSNorm, eps=s.rms_norm_eps, dtype=self.dtype)
        attn = LayerAttention(
            s,
            self.dtype,
            self.backend,
            options.layer_options(self.layer_index),
            self.mesh,
            qk_norm,
            name="self_attn",
        )
        h, cache = attn(norm("input_layernorm")(x), cos_sin, cache, meta)
        x = x + norm("post_attention_layernorm")(h)
        h = GemmaMLP(s, self.dtype, name="mlp")(norm("pre_feedforward_layernorm")(x))
        return x + norm("post_feedforward_layernorm")(h), cache


class GemmaModel(nn.Module):
    """`model.*`: scaled embeddings, layers, final norm."""

    spec: ModelSpec
    dtype: jnp.dtype
    backend: str
    mesh: Mesh | None = None

    def setup(self) -> None:
        s = self.spec
        self.embed_tokens = nn.Embed(
            s.vocab_size, s.hidden_size, dtype=self.dtype, param_dtype=self.dtype
        )
        self.layers = [
            GemmaDecoderLayer(s, self.dtype, self.backend, self.mesh, layer_index=i)
            for i in range(s.num_layers)
        ]
        self.norm = GemmaRMSNorm(s.rms_norm_eps, self.dtype)

    def embed(self, token_ids: jax.Array) -> jax.Array:  # [...] -> [..., H]
        # The normaliser is rounded to the model's dtype first, as Transformers does.
        scale = jnp.asarray(math.sqrt(self.spec.hidden_size), self.dtype)
        return self.embed_tokens(token_ids) * scale

    def __call__(
        self,
        token_ids: jax.Array,  # [T] int32
        positions: jax.Array,  # [T] int32
        caches: Sequence[KVCache],
        meta: AttentionMetadata,
    ) -> tuple[jax.Array, list[KVCache]]:
        s, options = self.spec, self.spec.variant
        x = self.embed(token_ids)  # [T, H]
        global_cs = rope_cos_sin(s.rope, s.head_dim, positions, self.dtype)
        local_cs = global_cs
        if options.local_rope is not None:
            local_cs = rope_cos_sin(options.local_rope, s.head_dim, positions, self.dtype)
        # One cache array per layer, or one per full/sliding pair (`kv_groups`).
        index, metas = layer_kv(options.layer_windows, caches, meta, positions)
        new_caches = list(caches)
        for i, layer in enumerate(self.layers):
            local = options.layer_windows[i] is not None
            cs, j = local_cs if local else global_cs, index[i]
            x, new_caches[j] = layer(x, cs, new_caches[j], metas[i])
        return self.norm(x), new_caches


class GemmaForCausalLM(nn.Module):
    """The whole checkpoint: `model.*` plus `lm_head` (absent when tied, as usual)."""

    spec: ModelSpec
    dtype: jnp.dtype
    backend: str = "reference"
    mesh: Mesh | None = None
    supports_pipeline = False

    def setup(self) -> None:
        self.model = GemmaModel(self.spec, self.dtype, self.backend, self.mesh)
        if not self.spec.tie_word_embeddings:
            self.lm_head = LMHead(
                self.spec.vocab_size, self.dtype, self.mesh, self.spec.transposed_weights
            )

    def __call__(
        self,
        token_ids: jax.Array,
        positions: jax.Array,
        caches: Sequence[KVCache],
        meta: AttentionMetadata,
    ) -> tuple[jax.Array, list[KVCache]]:
        return self.model(token_ids, positions, caches, meta)

    def embed(self, token_ids: jax.Array) -> jax.Array:
        return self.model.embed(token_ids)

    def final_norm(self, x: jax.Array) -> jax.Array:
        return self.model.norm(x)

    def logits(self, hidden: jax.Array) -> jax.Array:  # [R, H] -> [R, V] float32
        if self.spec.tie_word_embeddings:
            logits = vocab_projection(hidden, self.model.embed_tokens.embedding, self.mesh)
        else:
            logits = self.lm_head(hidden)
        cap = self.spec.variant.final_soft_cap
        return logits if cap is None else cap * jnp.tanh(logits / cap)
