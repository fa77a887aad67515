"""DeepSeek-V3's multi-token prediction (MTP) layer as a draft head: module and loader.

A DeepSeek-V3 checkpoint carries `num_nextn_predict_layers` MTP layers after its decoder
layers, as `model.layers.{num_hidden_layers}.*` (the target's loader skips them). The
layer at position i reads the embedding of token i + 1 and the target's final hidden
state (after its norm) at i: `enorm` and `hnorm` normalise each, `eh_proj` `[2H -> H]`
projects their concatenation `[embedding; hidden]`, and one decoder layer (latent
attention, and a MoE or dense MLP as the target's layer of that index would have) runs
on it. Its output (before any norm) is fed back as the hidden state of the next draft,
so one layer drafts any number of tokens; `shared_head.norm` then the head score it.
As vLLM's `DeepSeekMultiTokenPredictorLayer`, the embedding at position 0 is zeroed.
GLM-4.5 (`models.glm4_moe`) stores its MTP layer the same way; its block is the
target's own decoder layer (grouped-query attention, DeepSeek's MoE).

Tensors read from the checkpoint: `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, the
decoder layer's own (`self_attn.*`, `mlp.*`, both layer norms), and, where the
checkpoint has them, the layer's `embed_tokens` and `shared_head.head` (else the
target's embedding and lm_head are used). Only the first MTP layer is used; a
checkpoint with more is refused. Not the proposing (`runner.drafter.MTPDrafter`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jvllm.layers.attention import AttentionMetadata, KVCache
from jvllm.layers.rotary import attention_scaling, inverse_frequencies, rotary_cos_sin
from jvllm.models.deepseek import DeepseekDecoderLayer
from jvllm.models.llama import DecoderLayer, Linear, LMHead, RMSNorm
from jvllm.models.loader import LoadedModel, read_params, trace_inputs
from jvllm.models.safetensors_index import SafetensorsIndex
from jvllm.models.spec import ModelSpec

# GLM-4.5's MTP layer has the DeepSeek layout around its own decoder layer (grouped-query
# attention, `models.glm4_moe`); vLLM calls it "glm4_moe_mtp".
MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")


class SharedHead(nn.Module):
    """`shared_head.norm` and, when the checkpoint has its own, `shared_head.head`."""

    vocab_size: int
    eps: float
    dtype: jnp.dtype
    own_head: bool

    def setup(self) -> None:
        self.norm = RMSNorm(self.eps, self.dtype)
        if self.own_head:
            self.head = LMHead(self.vocab_size, self.dtype)


class DeepseekMTP(nn.Module):
    spec: ModelSpec  # the target's, one layer: `moe.sparse_layers` (0,) for a MoE MLP
    dtype: jnp.dtype
    own_embedding: bool = False
    own_head: bool = False
    backend: str = "reference"

    def setup(self) -> None:
        s = self.spec
        self.enorm = RMSNorm(s.rms_norm_eps, self.dtype)
        self.hnorm = RMSNorm(s.rms_norm_eps, self.dtype)
        self.eh_proj = Linear(s.hidden_size, False, self.dtype)
        block = DeepseekDecoderLayer if s.mla is not None else DecoderLayer  # GLM-4.5's
        self.mtp_block = block(s, self.dtype, self.backend, layer_index=0)
        self.shared_head = SharedHead(s.vocab_size, s.rms_norm_eps, self.dtype, self.own_head)
        if self.own_embedding:
            self.embed_tokens = nn.Embed(
                s.vocab_size, s.hidden_size, dtype=self.dtype, param_dtype=self.dtype
            )
        rope_dims = s.head_dim if s.mla is None else s.mla.qk_rope_head_dim
        self.inv_freq = inverse_frequencies(s.rope, rope_dims, s.rope_seq_len)

    def __call__(
        self,
        embeds: jax.Array,  # [T, H]: the token at each position + 1
        hidden: jax.Array,  # [T, H]: the target's final hidden states, or the layer's own
        positions: jax.Array,  # [T] int32
        caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> tuple[jax.Array, list[KVCache]]:
        """The layer's output `[T, H]` (before `shared_head.norm`) and the caches."""
        embeds = jnp.where((positions == 0)[:, None], jnp.zeros_like(embeds), embeds)
        both = [self.enorm(embeds.astype(self.dtype)), self.hnorm(hidden.astype(self.dtype))]
        x = self.eh_proj(jnp.concatenate(both, axis=-1))
        scaling = attention_scaling(self.spec.rope)
        cos_sin = rotary_cos_sin(positions, self.inv_freq, self.dtype, scaling)
        x, cache = self.mtp_block(x, cos_sin, caches[0], meta)
        return x, [cache]

    def embed(self, token_ids: jax.Array) -> jax.Array:  # [T] -> [T, H]
        return self.embed_tokens(token_ids)

    def head_norm(self, x: jax.Array) -> jax.Array:  # [R, H]
        return self.shared_head.norm(x)

    def logits(self, normed: jax.Array) -> jax.Array:  # [R, H] -> [R, V] float32
        return self.shared_head.head(normed)

    def trace(
        self,
        token_ids: jax.Array,
        hidden: jax.Array,
        positions: jax.Array,
        caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> jax.Array:
        """Every parameter used once (to trace their shapes)."""
        embeds = self.embed(token_ids) if self.own_embedding else hidden
        x, _ = self(embeds, hidden, positions, caches, meta)
        x = self.head_norm(x)
        return self.logits(x) if self.own_head else x


def mtp_spec(target: LoadedModel, where: str) -> tuple[ModelSpec, int]:
    """The MTP layer's spec (the target's, one layer, its own MLP kind, weights as the
    checkpoint holds them) and its checkpoint index, num_hidden_layers."""
    config, spec = target.hf_config, target.spec
    arch = (config.get("architectures") or ["?"])[0]
    if arch not in MTP_ARCHITECTURES:
        raise ValueError(
            f"{where}: method 'deepseek_mtp' needs a DeepSeek-V3 or GLM-4.5 target with MTP "
            "layers; "
            f"{arch!r} is not one of {MTP_ARCHITECTURES}"
        )
    n_predict = int(config.get("num_nextn_predict_layers") or 0)
    if n_predict != 1:
        raise ValueError(
            f"{where}: num_nextn_predict_layers={n_predict}; checkpoints with one MTP "
            "layer are supported"
        )
    index = int(config["num_hidden_layers"])
    moe = spec.moe
    if moe is not None:
        sparse = index >= int(config.get("first_k_dense_replace") or 0)
        moe = dataclasses.replace(moe, sparse_layers=(0,) if sparse else ())
    one = dataclasses.replace(spec, num_layers=1, moe=moe, transposed_weights=False)
    return one, index


def _checkpoint_path(path: tuple[str, ...], index: int) -> tuple[str, ...]:
    """A parameter's path as the target checkpoint names it (`model.layers.{index}.*`;
    the decoder layer's own tensors sit directly under it)."""
    rest = path[1:] if path[0] == "mtp_block" else path
    return ("model", f"layers_{index}", *rest)


def load_mtp_layer(
    path: str | Path,
    target: LoadedModel,
    backend: str = "reference",
    mesh: Mesh | None = None,
) -> LoadedModel:
    """The first MTP layer of the DeepSeek-V3 or GLM-4.5 checkpoint at `path` (the target's own
    directory), in the target's dtype; errors name what is missing."""
    path = Path(path)
    where = f"speculative_config model {str(path)!r}"
    if mesh is not None and mesh.devices.size > 1:
        raise ValueError(f"{where}: the MTP layer runs without tensor parallelism")
    spec, index = mtp_spec(target, where)
    names = SafetensorsIndex(path).names()
    prefix = f"model.layers.{index}."
    if f"{prefix}eh_proj.weight" not in names:
        raise ValueError(
            f"{where}: the checkpoint has no MTP layer tensors ({prefix}eh_proj.weight)"
        )
    module = DeepseekMTP(
        spec,
        target.dtype,
        own_embedding=f"{prefix}embed_tokens.weight" in names,
        own_head=f"{prefix}shared_head.head.weight" in names,
        backend=backend,
    )
    caches, meta = trace_inputs(spec, target.dtype)
    hidden = jnp.zeros((1, spec.hidden_size), target.dtype)
    args = (jnp.zeros(1, jnp.int32), hidden, jnp.zeros(1, jnp.int32), caches, meta)
    init = lambda: module.init(jax.random.key(0), *args, method="trace")
    abstract = jax.eval_shape(init)["params"]
    flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
    renamed: dict[str, Any] = {}
    for keys, leaf in flat:
        node = renamed
        full = _checkpoint_path(tuple(k.key for k in keys), index)
        for key in full[:-1]:
            node = node.setdefault(key, {})
        node[full[-1]] = leaf
    load_spec = spec
    if spec.moe is not None and spec.moe.sparse_layers:  # experts stacked for layer `index`
        load_spec = dataclasses.replace(
            spec, moe=dataclasses.replace(spec.moe, sparse_layers=(index,))
        )
    ignored = frozenset(n for n in names if not n.startswith(prefix))
    read = read_params(path, renamed, load_spec, None, ignored=ignored)
    params: dict[str, Any] = {}
    for key, value in read["model"][f"layers_{index}"].items():
        if key in ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens"):
            params[key] = value
        else:
            params.setdefault("mtp_block", {})[key] = value
    return LoadedModel(spec, module, params, target.dtype, target.hf_config)
