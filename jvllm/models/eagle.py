"""EAGLE-1 draft heads for the Llama family: the module and its checkpoint loader.

An EAGLE head drafts from the target's own features instead of from tokens alone. At
position i it takes the embedding of the token at i + 1 and the target's final hidden
state at i, mixes them with `fc` (a Linear over their concatenation, embedding half
first), runs its decoder layers (the first without an input norm) and returns the
predicted feature at i + 1, which the target's lm_head scores: the draft for i + 2.
The head has no embedding, final norm or lm_head of its own; the target's are used.

Checkpoints are the public EAGLE-1 layout, as vLLM's `EagleLlamaForCausalLM` reads
them: a Llama config.json (one layer, the target's hidden size) and safetensors named
`fc.weight` (`fc.bias` where present), `layers.0.self_attn.q_proj.weight`, ... A stored
`embed_tokens`, `lm_head` or layer-0 `input_layernorm` is ignored, as vLLM does. EAGLE-3
heads (fused features of several target layers, their own vocabulary) are
`jvllm.models.eagle3`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jvllm.layers.attention import AttentionMetadata, KVCache
from jvllm.layers.rotary import inverse_frequencies, rotary_cos_sin
from jvllm.models.llama import DecoderLayer, Linear
from jvllm.models.loader import LoadedModel, read_config, read_params, sharded_spec, trace_inputs
from jvllm.models.safetensors_index import SafetensorsIndex
from jvllm.models.spec import ModelSpec, spec_from_hf_config
from jvllm.parallel.mesh import check_divisible

EAGLE_ARCHITECTURES = ("EagleLlamaForCausalLM", "LlamaForCausalLMEagle", "LlamaForCausalLM")
# Tensors an EAGLE-1 checkpoint may carry that the head takes from the target or skips.
_IGNORED = frozenset({"embed_tokens.weight", "lm_head.weight", "layers.0.input_layernorm.weight"})


class EagleHead(nn.Module):
    spec: ModelSpec
    dtype: jnp.dtype
    backend: str = "reference"
    mesh: Mesh | None = None
    fc_bias: bool = False

    def setup(self) -> None:
        s = self.spec
        self.fc = Linear(s.hidden_size, self.fc_bias, self.dtype)
        self.layers = [
            DecoderLayer(s, self.dtype, self.backend, self.mesh, input_norm=i > 0)
            for i in range(s.num_layers)
        ]
        self.inv_freq = inverse_frequencies(s.rope, s.head_dim)

    def __call__(
        self,
        embeds: jax.Array,  # [T, H]: the token at each position + 1
        features: jax.Array,  # [T, H]: the target's final hidden state at each position
        positions: jax.Array,  # [T] int32
        caches: Sequence[KVCache],
        meta: AttentionMetadata,
    ) -> tuple[jax.Array, list[KVCache]]:
        """The predicted next features `[T, H]` and the updated caches."""
        x = self.fc(jnp.concatenate([embeds, features.astype(embeds.dtype)], axis=-1))
        cos_sin = rotary_cos_sin(positions, self.inv_freq, self.dtype)
        new_caches = []
        for layer, cache in zip(self.layers, caches, strict=True):
            x, cache = layer(x, cos_sin, cache, meta)
            new_caches.append(cache)
        return x, new_caches


def load_eagle_head(
    path: str | Path,
    target: LoadedModel,
    backend: str = "reference",
    mesh: Mesh | None = None,
    method: str = "eagle",
) -> LoadedModel:
    """An EAGLE-1 head for `target` (an EAGLE-3 head, `models.eagle3`, with method
    "eagle3"; DeepSeek-V3's MTP layer, `models.deepseek_mtp`, with "deepseek_mtp"), in
    the target's dtype and on its mesh; errors name what does not fit the target."""
    if method == "eagle3":
        from jvllm.models.eagle3 import load_eagle3_head

        return load_eagle3_head(path, target, backend, mesh)
    if method == "deepseek_mtp":
        from jvllm.models.deepseek_mtp import load_mtp_layer

        return load_mtp_layer(path, target, backend, mesh)
    path = Path(path)
    config = read_config(path)
    arch = (config.get("architectures") or ["?"])[0]
    where = f"speculative_config model {str(path)!r}"
    if "eagle3" in arch.lower() or "eagle_config" in config or "draft_vocab_size" in config:
        raise ValueError(f"{where}: EAGLE-3 heads are read with method 'eagle3', not 'eagle'")
    if arch not in EAGLE_ARCHITECTURES:
        raise ValueError(
            f"{where}: architecture {arch!r} is not an EAGLE-1 Llama head; "
            f"supported: {', '.join(EAGLE_ARCHITECTURES)}"
        )
    if config.get("add_para_norm"):
        raise ValueError(f"{where}: heads with add_para_norm (HASS) are not supported")
    spec = spec_from_hf_config({**config, "architectures": ["LlamaForCausalLM"]})
    for field in ("hidden_size", "vocab_size"):
        ours, theirs = getattr(spec, field), getattr(target.spec, field)
        if ours != theirs:
            raise ValueError(
                f"{where}: {field}={ours}, the target's is {theirs}; an EAGLE head must be "
                "trained for the target model"
            )
    tp = 1 if mesh is None else mesh.devices.size
    if mesh is not None:
        check_divisible(spec, tp)
    built = sharded_spec(spec, tp)
    fc_bias = "fc.bias" in SafetensorsIndex(path).entries
    module = EagleHead(built, target.dtype, backend, mesh, fc_bias)
    caches, meta = trace_inputs(built, target.dtype)
    x = jnp.zeros((1, built.hidden_size), target.dtype)
    positions = jnp.zeros(1, jnp.int32)
    init = lambda: module.init(jax.random.key(0), x, x, positions, caches, meta)
    abstract = jax.eval_shape(init)["params"]
    params = read_params(path, abstract, spec, mesh, ignored=_IGNORED)
    return LoadedModel(built, module, params, target.dtype, config)
