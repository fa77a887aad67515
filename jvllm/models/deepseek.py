"""Flax DeepSeek-V2/V3 decoder: latent attention, DeepSeek's router, shared experts.

Owns the decoder around `models/mla.py`'s attention: the first `first_k_dense_replace`
layers keep a dense MLP, the others route each token to `num_experts_per_tok` of the
stacked experts (`layers/moe.py`'s grouped matmuls, the `Experts` of `models/llama.py`)
and add `shared_experts`, a dense MLP every token runs. The router (`deepseek_route`):

- scores: softmax (V2) or sigmoid (V3) of the float32 router logits;
- with groups (V3's `noaux_tc`, V2's `group_limited_greedy`): each group is scored (V3:
  the sum of its best two scores plus `e_score_correction_bias`; V2: its best score),
  the best `topk_group` groups are kept and the others' experts cannot be chosen;
- the top-k experts by score (V3: plus the correction bias, which only chooses); their
  weights are the scores without it;
- V3 renormalises the k weights when `norm_topk_prob` and then multiplies them by
  `routed_scaling_factor`; V2 (as DeepSeek's own code) either renormalises (when
  `norm_topk_prob` and k > 1) or scales. Transformers' V2 class always scales and never
  renormalises: the two agree on every released V2 checkpoint (norm_topk_prob false).

GLM-4.5 (`models/glm4_moe.py`) runs `DeepseekMoE` in its Llama-family decoder layers, its
router in `spec.variant` (`routing_of`). Not owned: the config fields
(`models/deepseek_spec.py`), reading the expert tensors
(`models/expert_tensors.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jvllm.layers.attention import AttentionMetadata, KVCache
from jvllm.layers.moe import Routing
from jvllm.layers.rotary import attention_scaling, inverse_frequencies, rotary_cos_sin
from jvllm.models.deepseek_spec import DeepseekRouting
from jvllm.models.llama import MLP, Experts, LMHead, RMSNorm, vocab_projection
from jvllm.models.mla import MLAttention
from jvllm.models.quantization import param
from jvllm.models.spec import ModelSpec


def deepseek_route(
    logits: jax.Array,  # [T, E] float32
    bias: jax.Array | None,  # [E] float32: e_score_correction_bias
    r: DeepseekRouting,
    top_k: int,
    norm_topk_prob: bool,
) -> Routing:
    """Each token's top-k experts and their weights (module docstring)."""
    t, e = logits.shape
    if r.scoring_func == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        scores = jax.nn.softmax(logits, axis=-1)
    choice = scores if bias is None else scores + bias[None, :]
    if r.n_group > 1:
        grouped = choice.reshape(t, r.n_group, e // r.n_group)
        if r.correction_bias:  # V3: a group's best two
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
        else:
            group_scores = grouped.max(-1)
        _, groups = jax.lax.top_k(group_scores, r.topk_group)  # [T, topk_group]
        keep = jax.nn.one_hot(groups, r.n_group, dtype=jnp.bool_).any(axis=1)  # [T, G]
        masked = -jnp.inf if r.correction_bias else 0.0
        choice = jnp.where(keep[..., None], grouped, masked).reshape(t, e)
    _, experts = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)  # [T, k]
    renormalise = norm_topk_prob and (r.correction_bias or top_k > 1)
    if renormalise:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    if r.correction_bias or not renormalise:
        weights = weights * r.routed_scaling_factor
    return Routing(weights, experts.astype(jnp.int32))


def routing_of(spec: ModelSpec) -> DeepseekRouting:
    """The router of a DeepSeek spec (in `mla`) or of a GLM-4.5 one (in `variant`)."""
    return spec.mla.routing if spec.mla is not None else spec.variant.routing


class Router(nn.Module):
    """`mlp.gate`: `weight` `[E, H]` and (V3) `e_score_correction_bias` `[E]`."""

    spec: ModelSpec
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> Routing:  # [T, H]
        s, r = self.spec, routing_of(self.spec)
        e = s.moe.num_experts
        w = param(self, "weight", nn.initializers.normal(0.02), (e, s.hidden_size), self.dtype)
        logits = jnp.einsum(
            "th,eh->te", x.astype(jnp.float32), w.astype(jnp.float32), precision="highest"
        )
        bias = None
        if r.correction_bias:
            bias = param(self, "e_score_correction_bias", nn.initializers.zeros, (e,), jnp.float32)
        return deepseek_route(logits, bias, r, s.moe.top_k, s.moe.norm_topk_prob)


class DeepseekMoE(nn.Module):
    """A sparse layer's `mlp`: router `gate`, routed `experts`, `shared_experts`."""

    spec: ModelSpec
    dtype: jnp.dtype
    mesh: Mesh | None = None
    backend: str = "reference"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [T, H]
        s = self.spec
        routing = Router(s, self.dtype, name="gate")(x)
        out = Experts(s, self.dtype, self.mesh, self.backend, name="experts")(x, routing)
        shared = routing_of(s).num_shared_experts * s.moe.intermediate_size
        if shared:
            out = out + MLP(s, self.dtype, shared, name="shared_experts")(x)
        return out


class DeepseekDecoderLayer(nn.Module):
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
        s, eps = self.spec, self.spec.rms_norm_eps
        normed = RMSNorm(eps, self.dtype, name="input_layernorm")(x)
        attention = MLAttention(s, self.dtype, self.backend, self.mesh, name="self_attn")
        h, cache = attention(normed, cos_sin, cache, meta)
        x = x + h
        if s.is_sparse_layer(self.layer_index):
            mlp = DeepseekMoE(s, self.dtype, self.mesh, self.backend, name="mlp")
        else:
            mlp = MLP(s, self.dtype, name="mlp")
        x = x + mlp(RMSNorm(eps, self.dtype, name="post_attention_layernorm")(x))
        return x, cache


class DeepseekModel(nn.Module):
    """`model.*`: embeddings, layers, the final norm; the rope of the shared key."""

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
            DeepseekDecoderLayer(s, self.dtype, self.backend, self.mesh, layer_index=i)
            for i in range(s.num_layers)
        ]
        self.norm = RMSNorm(s.rms_norm_eps, self.dtype)
        self.inv_freq = inverse_frequencies(s.rope, s.mla.qk_rope_head_dim, s.rope_seq_len)

    def __call__(
        self,
        token_ids: jax.Array,  # [T] int32
        positions: jax.Array,  # [T] int32
        caches: Sequence[KVCache],
        meta: AttentionMetadata,
    ) -> tuple[jax.Array, list[KVCache]]:
        x = self.embed_tokens(token_ids)  # [T, H]
        scaling = attention_scaling(self.spec.rope)  # yarn's cos/sin factor
        cos_sin = rotary_cos_sin(positions, self.inv_freq, self.dtype, scaling)
        new_caches = []
        for layer, cache in zip(self.layers, caches, strict=True):
            x, cache = layer(x, cos_sin, cache, meta)
            new_caches.append(cache)
        return self.norm(x), new_caches


class DeepseekForCausalLM(nn.Module):
    """The whole checkpoint: `model.*` plus `lm_head` (absent when tied); the same
    methods as `models.llama.CausalLM`, which the runner calls."""

    spec: ModelSpec
    dtype: jnp.dtype
    backend: str = "reference"
    mesh: Mesh | None = None

    def setup(self) -> None:
        self.model = DeepseekModel(self.spec, self.dtype, self.backend, self.mesh)
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
        """Final-norm hidden states `[T, H]` of every token, and the updated caches."""
        return self.model(token_ids, positions, caches, meta)

    def embed(self, token_ids: jax.Array) -> jax.Array:  # [...] -> [..., H]
        return self.model.embed_tokens(token_ids)

    def final_norm(self, x: jax.Array) -> jax.Array:
        return self.model.norm(x)

    def logits(self, hidden: jax.Array) -> jax.Array:  # [R, H] -> [R, V] float32
        if self.spec.tie_word_embeddings:
            return vocab_projection(hidden, self.model.embed_tokens.embedding, self.mesh)
        return self.lm_head(hidden)
