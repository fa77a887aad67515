"""Flax decoder of gpt-oss (`GptOssForCausalLM`) and its config.json reading
(`gpt_oss_spec`).

Owns what gpt-oss does beyond the Llama family: attention sinks (a learned logit per
head in the softmax denominator) on every layer, sliding and full layers alternating as
`layer_types` says, YaRN rope (cos/sin times its attention factor), biased q/k/v/o, and
a mixture of experts whose router has a bias, whose experts have biases and whose
activation is the clamped SwiGLU (`layers/grouped_matmul.py`'s "swigluoai"); the down
projection's bias is added here, weighted by the routing. The checkpoint's experts are
`experts.gate_up_proj [E, H, 2I]` (gate and up interleaved along the last axis) and
`experts.down_proj [E, I, H]`, or the same in MXFP4 (`*_blocks`, `*_scales`); both are
read by `jvllm.models.mxfp4.GptOssCheckpoint` into the model's `[E, out, in]` stacks.
Not owned here: the attention block (`layer_attention.py`), routing and the grouped
matmuls (`layers/moe.py`), the lm_head (`llama.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jvllm.layers.attention import AttentionMetadata, KVCache
from jvllm.layers.grouped_matmul import ExpertBiases
from jvllm.layers.moe import Routing, grouped_expert_mlp, route, sharded_expert_mlp
from jvllm.layers.rotary import LENGTH_DEPENDENT, rope_cos_sin
from jvllm.models.kv_groups import layer_kv
from jvllm.models.layer_attention import LayerAttention, LayerOptions, layer_windows
from jvllm.models.llama import LMHead, vocab_projection
from jvllm.models.mxfp4 import GptOssCheckpoint
from jvllm.models.quantization import param
from jvllm.models.spec import ModelSpec, MoESpec, rope_from_config

_init = nn.initializers.normal(0.02)
SWIGLU_LIMIT = 7.0  # the limit "swigluoai" clamps to (gpt-oss's swiglu_limit)


@dataclass(frozen=True)
class GptOssOptions:
    """gpt-oss's options beyond `ModelSpec` (its `variant`)."""

    layer_windows: tuple[int | None, ...]  # per layer; None: full attention

    def layer_options(self, index: int, head_dim: int) -> LayerOptions:
        return LayerOptions(head_dim**-0.5, self.layer_windows[index], sinks=True)


def gpt_oss_spec(cfg: dict[str, Any]) -> ModelSpec:
    """The ModelSpec of a gpt-oss config.json."""
    limit = float(cfg.get("swiglu_limit") or SWIGLU_LIMIT)
    if limit != SWIGLU_LIMIT:
        raise ValueError(f"config.json: swiglu_limit={limit} is not supported ({SWIGLU_LIMIT})")
    rope = rope_from_config(cfg)
    if rope.rope_type in LENGTH_DEPENDENT:
        raise ValueError(f"config.json: rope type {rope.rope_type!r} is not supported by gpt-oss")
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    layers, inter = int(cfg["num_hidden_layers"]), int(cfg["intermediate_size"])
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if experts < 1:
        raise ValueError("config.json: gpt-oss needs num_local_experts >= 1")
    top_k = int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 4)
    bias = bool(cfg.get("attention_bias", True))
    eos = cfg.get("eos_token_id")
    return ModelSpec(
        architecture=cfg["architectures"][0],
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-5),
        rope=rope,
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 131072),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bias,
        o_bias=bias,
        # Top-k of the logits then a softmax over the k: a softmax renormalised over the k.
        moe=MoESpec(experts, top_k, inter, norm_topk_prob=True, sparse_layers=tuple(range(layers))),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        variant=GptOssOptions(layer_windows(cfg, 2)),
    )


class GptOssRMSNorm(nn.Module):
    """x / rms(x) * w in float32, cast back after the scale (gpt-oss's order)."""

    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = param(self, "weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (w.astype(jnp.float32) * x32).astype(x.dtype)


class GptOssExperts(nn.Module):
    """`mlp.experts.*`: gate, up `[E, I, H]`, down `[E, H, I]`, and their biases."""

    spec: ModelSpec
    dtype: jnp.dtype
    mesh: Mesh | None = None
    backend: str = "reference"

    @nn.compact
    def __call__(self, x: jax.Array, routing: Routing) -> jax.Array:  # [T, H] -> [T, H]
        s, m = self.spec, self.spec.moe
        e, i, h = m.num_experts, m.intermediate_size, s.hidden_size
        w_gate = param(self, "gate_proj", _init, (e, i, h), self.dtype)
        w_up = param(self, "up_proj", _init, (e, i, h), self.dtype)
        w_down = param(self, "down_proj", _init, (e, h, i), self.dtype)
        biases = ExpertBiases(
            param(self, "gate_proj_bias", nn.initializers.zeros, (e, i), self.dtype),
            param(self, "up_proj_bias", nn.initializers.zeros, (e, i), self.dtype),
        )
        down_bias = param(self, "down_proj_bias", nn.initializers.zeros, (e, h), self.dtype)
        weights = (w_gate, w_up, w_down)
        if self.mesh is None:
            out = grouped_expert_mlp(
                x, routing, *weights, 0, self.backend, None, biases, "swigluoai"
            )
        else:
            out = sharded_expert_mlp(
                x, routing, *weights, self.mesh, s.expert_parallel, self.backend, biases,
                "swigluoai",
            )  # fmt: skip
        # Each routed expert's down bias, weighted as its output is.
        routed_bias = down_bias[routing.experts].astype(jnp.float32)  # [T, k, H]
        bias = jnp.einsum("tk,tkh->th", routing.weights, routed_bias)
        return (out.astype(jnp.float32) + bias).astype(x.dtype)


class GptOssRouter(nn.Module):
    """`mlp.router`: expert logits `x @ weight.T + bias` in float32."""

    num_experts: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [T, H] -> [T, E] float32
        w = param(self, "weight", _init, (self.num_experts, x.shape[-1]), self.dtype)
        b = param(self, "bias", nn.initializers.zeros, (self.num_experts,), self.dtype)
        x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
        return jnp.einsum("th,eh->te", x32, w32, precision="highest") + b.astype(jnp.float32)


class GptOssDecoderLayer(nn.Module):
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
        s = self.spec
        norm = lambda name: GptOssRMSNorm(s.rms_norm_eps, self.dtype, name=name)  # noqa: E731
        options = s.variant.layer_options(self.layer_index, s.head_dim)
        attn = LayerAttention(s, self.dtype, self.backend, options, self.mesh, name="self_attn")
        h, cache = attn(norm("input_layernorm")(x), cos_sin, cache, meta)
        x = x + h
        h = norm("post_attention_layernorm")(x)
        mlp = GptOssMoE(s, self.dtype, self.mesh, self.backend, name="mlp")
        return x + mlp(h), cache


class GptOssMoE(nn.Module):
    """`mlp`: the biased `router`, top-k then a softmax over the k, and the `experts`."""

    spec: ModelSpec
    dtype: jnp.dtype
    mesh: Mesh | None = None
    backend: str = "reference"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [T, H]
        m = self.spec.moe
        logits = GptOssRouter(m.num_experts, self.dtype, name="router")(x)  # [T, E]
        routing = route(logits, m.top_k, m.norm_topk_prob)
        experts = GptOssExperts(self.spec, self.dtype, self.mesh, self.backend, name="experts")
        return experts(x, routing)


class GptOssModel(nn.Module):
    """`model.*`: embeddings, layers, final norm."""

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
            GptOssDecoderLayer(s, self.dtype, self.backend, self.mesh, layer_index=i)
            for i in range(s.num_layers)
        ]
        self.norm = GptOssRMSNorm(s.rms_norm_eps, self.dtype)

    def __call__(
        self,
        token_ids: jax.Array,  # [T] int32
        positions: jax.Array,  # [T] int32
        caches: Sequence[KVCache],
        meta: AttentionMetadata,
    ) -> tuple[jax.Array, list[KVCache]]:
        s = self.spec
        x = self.embed_tokens(token_ids)  # [T, H]
        cos_sin = rope_cos_sin(s.rope, s.head_dim, positions, self.dtype)  # YaRN-scaled
        # One cache array per layer, or one per full/sliding pair (`kv_groups`).
        index, metas = layer_kv(s.variant.layer_windows, caches, meta, positions)
        new_caches = list(caches)
        for i, layer in enumerate(self.layers):
            x, new_caches[index[i]] = layer(x, cos_sin, new_caches[index[i]], metas[i])
        return self.norm(x), new_caches


class GptOssForCausalLM(nn.Module):
    """The whole checkpoint: `model.*` and `lm_head`."""

    spec: ModelSpec
    dtype: jnp.dtype
    backend: str = "reference"
    mesh: Mesh | None = None
    supports_pipeline = False
    reads_quant = ("mxfp4",)  # experts dequantized at load (`models/mxfp4.py`)
    checkpoint_index = GptOssCheckpoint

    def setup(self) -> None:
        self.model = GptOssModel(self.spec, self.dtype, self.backend, self.mesh)
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
        return self.model.embed_tokens(token_ids)

    def final_norm(self, x: jax.Array) -> jax.Array:
        return self.model.norm(x)

    def logits(self, hidden: jax.Array) -> jax.Array:  # [R, H] -> [R, V] float32
        if self.spec.tie_word_embeddings:
            return vocab_projection(hidden, self.model.embed_tokens.embedding, self.mesh)
        return self.lm_head(hidden)
