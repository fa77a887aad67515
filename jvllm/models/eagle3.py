"""EAGLE-3 draft heads for the Llama family: the module and its checkpoint loader.

An EAGLE-3 head drafts from three of the target's hidden states at once: the inputs of
target layers low/mid/high (vLLM's aux hidden states; layer N is the last layer's output
before the final norm), concatenated in ascending layer order and fused by `fc`
`[3H -> H]`. Its one decoder layer normalises the token embedding (`input_layernorm`)
and the fused feature (`hidden_norm`) separately, attends over their concatenation (q,
k and v read 2H), adds the attention output to the feature (the residual) and runs its
MLP; the sum before the final `norm` is the head's output feature, fed back in place of
the fused feature for later drafts. The normed output is scored by the head's own
`lm_head` over a draft vocabulary of `draft_vocab_size` tokens; draft id d is target id
d + d2t[d], and `logits` returns target-vocabulary logits with -inf for tokens outside
the draft vocabulary.

Checkpoints are the public EAGLE-3 layout vLLM's `Eagle3LlamaForCausalLM` reads: a Llama
config.json (one layer, `draft_vocab_size`, optionally `eagle_aux_hidden_state_layer_ids`
at the top or in `eagle_config`, `norm_before_residual`), tensors `fc.weight`,
`midlayer.*` (or `layers.0.*`), `norm.weight`, `lm_head.weight`, `d2t` (`t2d` ignored) and
optionally `embed_tokens.weight` (else the target's embedding is used). Variants vLLM also
reads (`norm_before_fc`, `fc_norm`, `norm_output`, several layers, a target hidden size
of its own, parallel drafting) are refused by name. Not the proposing
(`runner.drafter.Eagle3Drafter`) nor the target's aux outputs (`models.llama`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jvllm.layers.attention import AttentionMetadata, KVCache
from jvllm.layers.rotary import inverse_frequencies, rotary_cos_sin
from jvllm.models.llama import MLP, Attention, Linear, RMSNorm
from jvllm.models.loader import LoadedModel, read_config, read_params, trace_inputs
from jvllm.models.safetensors_index import SafetensorsIndex
from jvllm.models.spec import ModelSpec, spec_from_hf_config

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# Config switches of vLLM's head this module does not implement.
_REFUSED = ("norm_before_fc", "fc_norm", "norm_output", "parallel_drafting")


class Eagle3Layer(nn.Module):
    """The head's decoder layer: attention over [norm(embedding), norm(feature)]."""

    spec: ModelSpec
    dtype: jnp.dtype
    backend: str
    norm_before_residual: bool = False

    @nn.compact
    def __call__(
        self,
        embeds: jax.Array,  # [T, H]
        hidden: jax.Array,  # [T, H]
        cos_sin: tuple[jax.Array, jax.Array],
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[jax.Array, KVCache]:
        eps = self.spec.rms_norm_eps
        embeds = RMSNorm(eps, self.dtype, name="input_layernorm")(embeds)
        normed = RMSNorm(eps, self.dtype, name="hidden_norm")(hidden)
        residual = normed if self.norm_before_residual else hidden
        attn = Attention(self.spec, self.dtype, self.backend, name="self_attn")
        h, cache = attn(jnp.concatenate([embeds, normed], axis=-1), cos_sin, cache, meta)
        x = residual + h
        mlp = MLP(self.spec, self.dtype, name="mlp")
        x = x + mlp(RMSNorm(eps, self.dtype, name="post_attention_layernorm")(x))
        return x, cache  # [T, H], before the final norm


class Eagle3Head(nn.Module):
    spec: ModelSpec  # the head's (vocab_size: the target's)
    dtype: jnp.dtype
    draft_vocab_size: int
    aux_layers: tuple[int, ...]  # the target layers whose inputs are fused, ascending
    own_embedding: bool = False
    layer_name: str = "midlayer"
    norm_before_residual: bool = False
    backend: str = "reference"

    def setup(self) -> None:
        s = self.spec
        self.fc = Linear(s.hidden_size, False, self.dtype)
        # Named as the checkpoint names it ("midlayer" or "layers_0").
        layer = Eagle3Layer(s, self.dtype, self.backend, self.norm_before_residual)
        setattr(self, self.layer_name, layer)
        self.norm = RMSNorm(s.rms_norm_eps, self.dtype)
        self.lm_head = Linear(self.draft_vocab_size, False, self.dtype)
        if self.own_embedding:
            self.embed_tokens = nn.Embed(
                s.vocab_size, s.hidden_size, dtype=self.dtype, param_dtype=self.dtype
            )
        arange = lambda key, shape, dtype: jnp.arange(shape[0], dtype=dtype)
        self.draft_ids = self.param("draft_ids", arange, (self.draft_vocab_size,), jnp.int32)
        self.inv_freq = inverse_frequencies(s.rope, s.head_dim)

    def __call__(
        self,
        embeds: jax.Array,  # [T, H]: the token at each position + 1
        hidden: jax.Array,  # [T, H]: fused target features, or the head's own outputs
        positions: jax.Array,  # [T] int32
        caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> tuple[jax.Array, list[KVCache]]:
        """The head's output features `[T, H]` (before its norm) and the caches."""
        cos_sin = rotary_cos_sin(positions, self.inv_freq, self.dtype)
        x, cache = getattr(self, self.layer_name)(
            embeds, hidden.astype(self.dtype), cos_sin, caches[0], meta
        )
        return x, [cache]

    def fuse(self, aux: jax.Array) -> jax.Array:  # [T, 3H] -> [T, H]
        return self.fc(aux.astype(self.dtype))

    def embed(self, token_ids: jax.Array) -> jax.Array:  # [T] -> [T, H]
        return self.embed_tokens(token_ids)

    def logits(self, x: jax.Array) -> jax.Array:  # [R, H] -> [R, V] float32
        draft = self.lm_head(self.norm(x)).astype(jnp.float32)  # [R, Vd]
        full = jnp.full((x.shape[0], self.spec.vocab_size), -jnp.inf, jnp.float32)
        return full.at[:, self.draft_ids].set(draft)

    def trace(
        self,
        token_ids: jax.Array,  # [T]
        aux: jax.Array,  # [T, 3H]
        positions: jax.Array,
        caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> jax.Array:
        """Every parameter used once (to trace their shapes): the logits `[T, V]`."""
        fused = self.fuse(aux)
        embeds = self.embed(token_ids) if self.own_embedding else fused
        x, _ = self(embeds, fused, positions, caches, meta)
        return self.logits(x)


def aux_layer_ids(config: dict[str, Any], num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs the head fuses, as vLLM picks them: the config's
    `eagle_aux_hidden_state_layer_ids` (top level or in `eagle_config`), else (2, N // 2,
    N - 3); sorted, without repeats."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    n = num_target_layers
    return tuple(sorted(set(ids or (2, n // 2, n - 3))))


def _check_config(config: dict[str, Any], where: str) -> None:
    arch = (config.get("architectures") or ["?"])[0]
    if arch not in EAGLE3_ARCHITECTURES:
        raise ValueError(
            f"{where}: architecture {arch!r} is not an EAGLE-3 Llama head; "
            f"supported: {', '.join(EAGLE3_ARCHITECTURES)}"
        )
    eagle_config = config.get("eagle_config") or {}
    for key in _REFUSED:
        if config.get(key) or eagle_config.get(key):
            raise ValueError(f"{where}: EAGLE-3 heads with {key} are not supported")
    if eagle_config.get("use_aux_hidden_state") is False:
        raise ValueError(f"{where}: EAGLE-3 heads without aux hidden states are not supported")
    if config.get("num_hidden_layers", 1) != 1:
        raise ValueError(
            f"{where}: num_hidden_layers={config['num_hidden_layers']}; EAGLE-3 heads of "
            "one layer are supported"
        )


def _check_fit(config: dict[str, Any], spec: ModelSpec, target: LoadedModel, where: str) -> None:
    theirs = target.spec
    if config.get("target_hidden_size", spec.hidden_size) != spec.hidden_size:
        raise ValueError(f"{where}: target_hidden_size differing from hidden_size is not supported")
    for field in ("hidden_size", "vocab_size"):
        if getattr(spec, field) != getattr(theirs, field):
            raise ValueError(
                f"{where}: {field}={getattr(spec, field)}, the target's is "
                f"{getattr(theirs, field)}; an EAGLE-3 head must be trained for the target model"
            )


def _draft_ids(index: SafetensorsIndex, draft_vocab: int, vocab: int, where: str) -> np.ndarray:
    """Target ids of the draft vocabulary `[Vd]`: d + d2t[d], checked."""
    if "d2t" not in index:
        if draft_vocab != vocab:
            raise ValueError(
                f"{where}: draft_vocab_size={draft_vocab} differs from the target's "
                f"vocab_size={vocab} but the checkpoint has no 'd2t' tensor mapping them"
            )
        return np.arange(vocab, dtype=np.int32)
    d2t = index.array("d2t").astype(np.int64)
    if d2t.shape != (draft_vocab,):
        raise ValueError(f"{where}: d2t has shape {d2t.shape}, expected ({draft_vocab},)")
    ids = np.arange(draft_vocab) + d2t
    if ids.min() < 0 or ids.max() >= vocab or len(np.unique(ids)) != draft_vocab:
        raise ValueError(
            f"{where}: d2t maps draft ids outside the target's vocabulary of {vocab} "
            "tokens or onto one token twice"
        )
    return ids.astype(np.int32)


def load_eagle3_head(
    path: str | Path,
    target: LoadedModel,
    backend: str = "reference",
    mesh: Mesh | None = None,
) -> LoadedModel:
    """An EAGLE-3 head for `target`, in the target's dtype; errors name what does not
    fit the target. Its weights are replicated; tensor parallelism is refused."""
    path = Path(path)
    where = f"speculative_config model {str(path)!r}"
    config = read_config(path)
    _check_config(config, where)
    if mesh is not None and mesh.devices.size > 1:
        raise ValueError(f"{where}: EAGLE-3 heads run without tensor parallelism")
    spec = spec_from_hf_config({**config, "architectures": ["LlamaForCausalLM"]})
    _check_fit(config, spec, target, where)
    n = target.spec.num_layers
    aux = aux_layer_ids(config, n)
    if len(aux) != 3 or aux[0] < 0 or aux[-1] > n:
        raise ValueError(
            f"{where}: aux hidden state layers {list(aux)} for a target of {n} layers; "
            "three distinct layers in [0, num_layers] are needed (set "
            "eagle_aux_hidden_state_layer_ids in the head's config.json)"
        )
    index = SafetensorsIndex(path)
    draft_vocab = config.get("draft_vocab_size") or spec.vocab_size
    draft_ids = _draft_ids(index, draft_vocab, spec.vocab_size, where)
    layer_name = "midlayer" if any(k.startswith("midlayer.") for k in index.names()) else None
    module = Eagle3Head(
        spec,
        target.dtype,
        draft_vocab,
        aux,
        own_embedding="embed_tokens.weight" in index,
        layer_name=layer_name or "layers_0",
        norm_before_residual=bool(config.get("norm_before_residual")),
        backend=backend,
    )
    caches, meta = trace_inputs(spec, target.dtype)
    aux_in = jnp.zeros((1, 3 * spec.hidden_size), target.dtype)
    args = (jnp.zeros(1, jnp.int32), aux_in, jnp.zeros(1, jnp.int32), caches, meta)
    init = lambda: module.init(jax.random.key(0), *args, method="trace")
    abstract = dict(jax.eval_shape(init)["params"])
    del abstract["draft_ids"]  # from d2t, below
    params = read_params(path, abstract, spec, None, ignored=frozenset({"d2t", "t2d"}))
    params = {**params, "draft_ids": jnp.asarray(draft_ids)}
    return LoadedModel(spec, module, params, target.dtype, config)
