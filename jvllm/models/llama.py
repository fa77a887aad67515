"""Flax decoder for the Llama family: Llama, Mistral, Qwen2 and Qwen3, and their
mixture-of-experts kin Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

Owns the forward pass over a flattened ragged batch and one paged KV cache per
layer. The architectures differ only in switches carried by `ModelSpec`
(q/k/v bias, q/k RMSNorm per head or over the projection, sliding window, tied
embeddings, and `spec.moe`: which layers' MLP is a routed set of experts, see
`layers/moe.py`).
Parameter names mirror the Hugging Face checkpoint (`model.layers_0.self_attn...`)
and weights keep its `[out, in]` layout, so loading never transposes; on a CPU the
float weights are then turned to `[in, out]` (`spec.transposed_weights`, see
`weight_layout.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jvllm.layers.attention import AttentionMetadata, KVCache, paged_attention
from jvllm.layers.expert_weights import ExpertWeight, QuantizedExperts
from jvllm.layers.moe import Routing, grouped_expert_mlp, route, sharded_expert_mlp
from jvllm.layers.rotary import apply_rotary, inverse_frequencies, step_cos_sin
from jvllm.models.expert_quantization import expert_scheme
from jvllm.models.quantization import (
    BlockFloatWeights,
    FloatWeights,
    PackedWeights,
    dequantized_weight,
    float_linear,
    param,
    storage_dtype,
)
from jvllm.models.spec import ModelSpec
from jvllm.parallel.mesh import CACHE, HEADS, pp_size, tp_size, vocab_axes

_init = nn.initializers.normal(0.02)


class Linear(nn.Module):
    """y = x @ W.T (+ b) with W stored `[out, in]` as in the checkpoint; with
    `quantization`, W is int8 or float8 with float32 `weight_scale` per output channel,
    a float8 checkpoint's (FP8 W8A8) form, or a packed or block-scaled checkpoint's form,
    dequantized in the step."""

    features: int
    use_bias: bool
    dtype: jnp.dtype
    quantization: str | PackedWeights | FloatWeights | BlockFloatWeights | None = None
    transposed: bool = False  # a float W held `[in, out]`

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        shape = (self.features, x.shape[-1])
        if self.transposed:
            assert self.quantization is None, "only float weights are transposed"
            w = param(self, "weight", _init, shape[::-1], self.dtype)
            y = jnp.einsum("...i,io->...o", x, w)
        elif self.quantization is None:
            y = jnp.einsum("...i,oi->...o", x, param(self, "weight", _init, shape, self.dtype))
        elif isinstance(self.quantization, (PackedWeights, BlockFloatWeights)):
            w = dequantized_weight(self, self.quantization, self.features, x.shape[-1], self.dtype)
            y = jnp.einsum("...i,oi->...o", x, w)
        elif isinstance(self.quantization, FloatWeights):
            y = float_linear(self, self.quantization, x, self.features, self.dtype)
        else:
            stored = storage_dtype(self.quantization)
            q = param(self, "weight", nn.initializers.zeros, shape, stored)
            scale = param(self, "weight_scale", nn.initializers.ones, (self.features,), jnp.float32)
            y = jnp.einsum("...i,oi->...o", x, q.astype(self.dtype)) * scale.astype(self.dtype)
        if self.use_bias:
            y = y + param(self, "bias", nn.initializers.zeros, (self.features,), self.dtype)
        return y


def spec_linear(spec: ModelSpec, dtype: jnp.dtype) -> Callable[..., Linear]:
    """`Linear` with the spec's quantization and weight layout: call it with features,
    use_bias and name."""
    return functools.partial(
        Linear, dtype=dtype, quantization=spec.quantization, transposed=spec.transposed_weights
    )


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = param(self, "weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        # Normalise in float32, cast back before the scale, as Transformers does.
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return w * x32.astype(x.dtype)


class Attention(nn.Module):
    spec: ModelSpec
    dtype: jnp.dtype
    backend: str
    mesh: Mesh | None = None

    @nn.compact
    def __call__(
        self,
        x: jax.Array,  # [T, H]
        cos_sin: tuple[jax.Array, jax.Array],
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[jax.Array, KVCache]:
        s, t = self.spec, x.shape[0]
        linear = spec_linear(s, self.dtype)
        q = linear(s.num_heads * s.head_dim, s.qkv_bias, name="q_proj")(x)
        k = linear(s.num_kv_heads * s.head_dim, s.qkv_bias, name="k_proj")(x)
        v = linear(s.num_kv_heads * s.head_dim, s.qkv_bias, name="v_proj")(x)
        if s.qk_norm and s.qk_norm_over_projection:  # OLMoE: one norm over all heads
            q = RMSNorm(s.rms_norm_eps, self.dtype, name="q_norm")(q)
            k = RMSNorm(s.rms_norm_eps, self.dtype, name="k_norm")(k)
        q = q.reshape(t, s.num_heads, s.head_dim)  # [T, Hq, D]
        k = k.reshape(t, s.num_kv_heads, s.head_dim)  # [T, Hkv, D]
        v = v.reshape(t, s.num_kv_heads, s.head_dim)
        if s.qk_norm and not s.qk_norm_over_projection:
            q = RMSNorm(s.rms_norm_eps, self.dtype, name="q_norm")(q)
            k = RMSNorm(s.rms_norm_eps, self.dtype, name="k_norm")(k)
        q = apply_rotary(q, *cos_sin)
        k = apply_rotary(k, *cos_sin)
        attend = functools.partial(
            paged_attention,
            self.backend,
            scale=s.head_dim**-0.5,
            sliding_window=s.sliding_window,
        )
        if self.mesh is not None:
            # Each device attends with its own heads and its slice of the cache. Inside a
            # pipeline stage (`pp` already manual) the split is over the context's mesh.
            context = jax.sharding.get_abstract_mesh()
            attend = jax.shard_map(
                attend,
                mesh=context if context.manual_axes else self.mesh,
                in_specs=(HEADS, HEADS, HEADS, (CACHE, CACHE), P()),
                out_specs=(HEADS, (CACHE, CACHE)),
                check_vma=False,
            )
        out, cache = attend(q, k, v, cache, meta)
        out = linear(s.hidden_size, s.o_bias, name="o_proj")(out.reshape(t, -1))
        return out, cache


class MLP(nn.Module):
    spec: ModelSpec
    dtype: jnp.dtype
    intermediate_size: int | None = None  # the spec's when None (a shared expert's own)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        s = self.spec
        inter = self.intermediate_size or s.intermediate_size
        linear = spec_linear(s, self.dtype)
        gate = linear(inter, s.mlp_bias, name="gate_proj")(x)
        up = linear(inter, s.mlp_bias, name="up_proj")(x)
        return linear(s.hidden_size, s.mlp_bias, name="down_proj")(jax.nn.silu(gate) * up)


class GateWeight(nn.Module):
    """`x @ weight.T` in float32, weight `[out, in]` as stored: a router or a shared
    expert's gate, which are never quantized, transposed or split."""

    features: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [T, H] -> [T, out] float32
        w = param(self, "weight", _init, (self.features, x.shape[-1]), self.dtype)
        return jnp.einsum(
            "th,oh->to", x.astype(jnp.float32), w.astype(jnp.float32), precision="highest"
        )


class Experts(nn.Module):
    """`experts.{gate,up,down}_proj`: every expert's weights stacked `[E, out, in]`;
    quantized (`models/expert_quantization.py`), int8 or float8 with float32 scales
    `experts.{gate,up,down}_proj_scale` `[E, out]` (or `[E, 1]`)."""

    spec: ModelSpec
    dtype: jnp.dtype
    mesh: Mesh | None = None
    backend: str = "reference"  # "triton": the grouped-matmul kernel

    @nn.compact
    def __call__(self, x: jax.Array, routing: Routing) -> jax.Array:  # [T, H] -> [T, H]
        s, m = self.spec, self.spec.moe
        e, i, h = m.num_experts, m.intermediate_size, s.hidden_size
        scheme = expert_scheme(s.quantization, s.architecture)

        def weight(name: str, shape: tuple[int, int, int]) -> ExpertWeight:
            if scheme is None or scheme.dequantized:
                return param(self, name, _init, shape, self.dtype)
            q = param(self, name, nn.initializers.zeros, shape, scheme.dtype)
            scale_shape = (shape[0], 1 if scheme.per_tensor else shape[1])  # [E, out or 1]
            scale = param(self, f"{name}_scale", nn.initializers.ones, scale_shape, jnp.float32)
            return QuantizedExperts(q, scale, scheme.activations)

        w_gate, w_up = weight("gate_proj", (e, i, h)), weight("up_proj", (e, i, h))
        w_down = weight("down_proj", (e, h, i))
        if self.mesh is None:
            return grouped_expert_mlp(x, routing, w_gate, w_up, w_down, 0, self.backend)
        return sharded_expert_mlp(
            x, routing, w_gate, w_up, w_down, self.mesh, s.expert_parallel, self.backend
        )


class SparseMoeBlock(nn.Module):
    """A sparse layer's `mlp`: router `gate`, routed `experts`, and (Qwen2-MoE) a
    `shared_expert` MLP scaled by `sigmoid(shared_expert_gate(x))`."""

    spec: ModelSpec
    dtype: jnp.dtype
    mesh: Mesh | None = None
    backend: str = "reference"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [T, H]
        m = self.spec.moe
        logits = GateWeight(m.num_experts, self.dtype, name="gate")(x)  # [T, E] float32
        routing = route(logits, m.top_k, m.norm_topk_prob)
        experts = Experts(self.spec, self.dtype, self.mesh, self.backend, name="experts")
        out = experts(x, routing)
        if m.shared_expert_intermediate_size:
            shared = MLP(
                self.spec, self.dtype, m.shared_expert_intermediate_size, name="shared_expert"
            )
            scale = jax.nn.sigmoid(GateWeight(1, self.dtype, name="shared_expert_gate")(x))
            out = out + (scale * shared(x).astype(jnp.float32)).astype(out.dtype)
        return out


class DecoderLayer(nn.Module):
    spec: ModelSpec
    dtype: jnp.dtype
    backend: str
    mesh: Mesh | None = None
    input_norm: bool = True  # an EAGLE head's first layer has none
    layer_index: int = 0  # which MLP it has: `spec.is_sparse_layer`

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        cos_sin: tuple[jax.Array, jax.Array],
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[jax.Array, KVCache]:
        eps = self.spec.rms_norm_eps
        normed = RMSNorm(eps, self.dtype, name="input_layernorm")(x) if self.input_norm else x
        h, cache = Attention(self.spec, self.dtype, self.backend, self.mesh, name="self_attn")(
            normed, cos_sin, cache, meta
        )
        x = x + h
        if self.spec.is_sparse_layer(self.layer_index):
            block = getattr(self.spec.variant, "sparse_block", SparseMoeBlock)  # GLM-4.5's
            mlp = block(self.spec, self.dtype, self.mesh, self.backend, name="mlp")
        else:
            mlp = MLP(self.spec, self.dtype, name="mlp")
        x = x + mlp(RMSNorm(eps, self.dtype, name="post_attention_layernorm")(x))
        return x, cache


class DecoderModel(nn.Module):
    """`model.*` in the checkpoint: embeddings, layers and the final norm."""

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
            DecoderLayer(s, self.dtype, self.backend, self.mesh, layer_index=i)
            for i in range(s.num_layers)
        ]
        self.norm = RMSNorm(s.rms_norm_eps, self.dtype)
        self.inv_freq = inverse_frequencies(s.rope, s.head_dim, s.rope_seq_len)

    def __call__(
        self,
        token_ids: jax.Array,  # [T] int32
        positions: jax.Array,  # [T] int32
        caches: Sequence[KVCache],
        meta: AttentionMetadata,
    ) -> tuple[jax.Array, list[KVCache]]:
        x = self.embed_tokens(token_ids)  # [T, H]
        s, q = self.spec, (meta.query_start_loc, meta.seq_lens)  # dynamic NTK's lengths
        cos_sin = step_cos_sin(s.rope, s.head_dim, positions, *q, self.inv_freq, self.dtype)
        new_caches = []
        for i, (layer, cache) in enumerate(zip(self.layers, caches, strict=True)):
            # Layer i's input, for an EAGLE-3 head (vLLM's aux hidden state i); a no-op
            # unless `apply` is given mutable=["intermediates"].
            self.sow("intermediates", f"aux_{i}", x)
            x, cache = layer(x, cos_sin, cache, meta)
            new_caches.append(cache)
        self.sow("intermediates", f"aux_{len(self.layers)}", x)  # before the final norm
        return self.norm(x), new_caches

    def embedding(self) -> jax.Array:  # [V, H]
        return self.embed_tokens.embedding


class CausalLM(nn.Module):
    """The whole checkpoint: `model.*` plus `lm_head` (absent when tied)."""

    spec: ModelSpec
    dtype: jnp.dtype
    backend: str = "reference"
    mesh: Mesh | None = None

    def setup(self) -> None:
        self.model = DecoderModel(self.spec, self.dtype, self.backend, self.mesh)
        if self.spec.num_labels:  # a sequence classifier: `score.weight` [L, H], no lm_head
            self.score = Linear(self.spec.num_labels, False, self.dtype)
        elif not self.spec.tie_word_embeddings:
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
        """Final-norm hidden states `[T, H]` of every token, and the updated caches."""
        return self.model(token_ids, positions, caches, meta)

    def embed(self, token_ids: jax.Array) -> jax.Array:  # [...] -> [..., H]
        return self.model.embed_tokens(token_ids)

    def final_norm(self, x: jax.Array) -> jax.Array:
        return self.model.norm(x)

    def logits(self, hidden: jax.Array) -> jax.Array:  # [R, H] -> [R, V] (or [R, L]) float32
        if self.spec.num_labels:
            return self.score(hidden).astype(jnp.float32)
        if self.spec.tie_word_embeddings:
            return vocab_projection(hidden, self.model.embedding(), self.mesh)
        return self.lm_head(hidden)


def stage_forward(
    module: CausalLM,
    layer_params: Sequence[Any],
    caches: Sequence[KVCache],
    x: jax.Array,
    inputs: tuple[jax.Array, AttentionMetadata],
) -> tuple[jax.Array, list[KVCache]]:
    """One pipeline stage: the decoder layers whose parameters are `layer_params`
    (`model.layers_j` trees) over `x` `[T, H]`; `inputs` are the micro-batch's
    positions and attention metadata. Every stage's layer j has the same kind of MLP
    (dense or sparse; the loader checks it), so stage 0's layer j stands for all."""
    s = module.spec
    positions, meta = inputs
    inv_freq = inverse_frequencies(s.rope, s.head_dim, s.rope_seq_len)
    q = (meta.query_start_loc, meta.seq_lens)  # dynamic NTK's lengths
    cos_sin = step_cos_sin(s.rope, s.head_dim, positions, *q, inv_freq, module.dtype)
    new_caches = []
    for j, (params, cache) in enumerate(zip(layer_params, caches, strict=True)):
        layer = DecoderLayer(s, module.dtype, module.backend, module.mesh, layer_index=j)
        x, cache = layer.apply({"params": params}, x, cos_sin, cache, meta)
        new_caches.append(cache)
    return x, new_caches


class LMHead(nn.Module):
    """`lm_head.weight` `[V, H]` (`[H, V]` when `transposed`, on one device only),
    vocab-parallel on a mesh when V divides."""

    vocab_size: int
    dtype: jnp.dtype
    mesh: Mesh | None = None
    transposed: bool = False

    @nn.compact
    def __call__(self, hidden: jax.Array) -> jax.Array:  # [R, H] -> [R, V] float32
        shape = (self.vocab_size, hidden.shape[-1])
        if self.transposed:
            assert self.mesh is None, "a transposed lm_head is not split over a mesh"
            w = param(self, "weight", _init, shape[::-1], self.dtype)  # [H, V]
            return jnp.einsum("rh,hv->rv", hidden, w, preferred_element_type=jnp.float32)
        w = param(self, "weight", _init, shape, self.dtype)
        return vocab_projection(hidden, w, self.mesh)


def vocab_projection(hidden: jax.Array, weight: jax.Array, mesh: Mesh | None) -> jax.Array:
    """`hidden [R, H] @ weight [V, H].T` in float32; on a mesh, replicated logits."""
    project = functools.partial(jnp.einsum, "rh,vh->rv", preferred_element_type=jnp.float32)
    if mesh is None:
        return project(hidden, weight)
    axes = vocab_axes(weight.shape[0], tp_size(mesh), pp_size(mesh))
    if axes:
        # Each device scores its slice of the vocabulary, so only the [R, V] logits cross
        # devices, never the [V, H] weight (which sharding propagation would gather).
        project = jax.shard_map(
            project,
            mesh=mesh,
            in_specs=(P(), P(axes, None)),
            out_specs=P(None, axes),
            check_vma=False,
        )
    # Gather the logits once here, not inside every sampler op.
    return jax.lax.with_sharding_constraint(project(hidden, weight), NamedSharding(mesh, P()))
