"""LLaVA (`LlavaForConditionalGeneration`): a Llama-family language model that takes
image embeddings at its image-token positions, and its vision side.

Owns reading the checkpoint's config (`llava_spec`: the language model's `ModelSpec`),
the language module (`LlavaForConditionalGeneration`: a `CausalLM` whose forward may
replace the embeddings of marked tokens), the checkpoint's language tensor names
(`LanguageModelIndex`), and the vision side (`LlavaVision`: the CLIP or SigLIP tower, the feature
layer(s) and select strategy of the config, the projector) with its loading
(`load_vision`). Not owned: running the encoder per image and caching its outputs
(`runner/encoder_runner.py`), or processing prompts and images (`engine/multimodal.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jvllm.layers.attention import AttentionMetadata, KVCache
from jvllm.layers.rotary import attention_scaling, rotary_cos_sin
from jvllm.models.clip_vision import CLIPVisionSpec, activation, hidden_states, linear
from jvllm.models.llama import CausalLM, DecoderModel, LMHead
from jvllm.models.safetensors_index import SafetensorsIndex
from jvllm.models.spec import ModelSpec, spec_from_hf_config
from jvllm.parallel.mesh import replicated

ARCHITECTURE = "LlavaForConditionalGeneration"
# The text config's model_type -> the causal LM architecture whose config it is.
_TEXT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
# Where checkpoints keep the language model's tensors (Transformers' two layouts).
_LANGUAGE_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."),
)
_VISION_PREFIXES = ("model.vision_tower.", "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


def llava_spec(cfg: dict[str, Any]) -> ModelSpec:
    """The language model's spec, under LLaVA's architecture name."""
    text = dict(cfg.get("text_config") or {})
    model_type = text.get("model_type", "llama")
    if model_type not in _TEXT_ARCHITECTURES:
        raise ValueError(
            f"LLaVA text_config model_type {model_type!r} is not supported "
            f"({', '.join(_TEXT_ARCHITECTURES)})"
        )
    text["architectures"] = [_TEXT_ARCHITECTURES[model_type]]
    text.setdefault("torch_dtype", cfg.get("torch_dtype") or cfg.get("dtype"))
    spec = spec_from_hf_config(text)
    return dataclasses.replace(spec, architecture=ARCHITECTURE)


class LanguageModelIndex:
    """The checkpoint's language tensors under a causal LM's names (`model.*`,
    `lm_head.*`); the vision tower's and projector's are not listed (read apart)."""

    def __init__(self, index: SafetensorsIndex, spec: ModelSpec) -> None:
        self.index = index
        self.by_name: dict[str, str] = {}
        for name in index.names():
            for old, new in _LANGUAGE_PREFIXES:
                if name.startswith(old):
                    self.by_name[new + name.removeprefix(old)] = name
                    break

    def names(self) -> set[str]:
        return set(self.by_name)

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def describe(self, name: str, shape: tuple[int, ...]) -> str:
        return f"{name!r} (shape {shape}; language_model.{name} in LLaVA checkpoints)"

    def file(self, name: str) -> Path:
        return self.index.file(self.by_name[name])

    def array(self, name: str) -> np.ndarray:
        return self.index.array(self.by_name[name])


class LlavaDecoderModel(DecoderModel):
    """`DecoderModel` whose marked tokens take given embeddings instead of their own."""

    def __call__(  # type: ignore[override]
        self,
        token_ids: jax.Array,  # [T] int32
        positions: jax.Array,  # [T] int32
        caches: Sequence[KVCache],
        meta: AttentionMetadata,
        mm_embeds: jax.Array | None = None,  # [T, H]: image embeddings where mm_mask
        mm_mask: jax.Array | None = None,  # [T] bool
    ) -> tuple[jax.Array, list[KVCache]]:
        x = self.embed_tokens(token_ids)  # [T, H]
        if mm_embeds is not None:
            assert mm_mask is not None
            x = jnp.where(mm_mask[:, None], mm_embeds.astype(x.dtype), x)
        cos_sin = self.cos_sin(positions)
        new_caches = []
        for layer, cache in zip(self.layers, caches, strict=True):
            x, cache = layer(x, cos_sin, cache, meta)
            new_caches.append(cache)
        return self.norm(x), new_caches

    def cos_sin(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The rotary cos and sin `[T, D]` of the step's positions."""
        scaling = attention_scaling(self.spec.rope)
        return rotary_cos_sin(positions, self.inv_freq, self.dtype, scaling)


class LlavaForConditionalGeneration(CausalLM):
    """The language side of LLaVA; `checkpoint_index` finds its tensors."""

    checkpoint_index = LanguageModelIndex
    supports_pipeline = False
    decoder: ClassVar[type[LlavaDecoderModel]] = LlavaDecoderModel  # Qwen2.5-VL: M-RoPE's

    def setup(self) -> None:
        self.model = self.decoder(self.spec, self.dtype, self.backend, self.mesh)
        if not self.spec.tie_word_embeddings:
            self.lm_head = LMHead(
                self.spec.vocab_size, self.dtype, self.mesh, self.spec.transposed_weights
            )

    def __call__(  # type: ignore[override]
        self,
        token_ids: jax.Array,
        positions: jax.Array,
        caches: Sequence[KVCache],
        meta: AttentionMetadata,
        mm_embeds: jax.Array | None = None,
        mm_mask: jax.Array | None = None,
    ) -> tuple[jax.Array, list[KVCache]]:
        return self.model(token_ids, positions, caches, meta, mm_embeds, mm_mask)


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity, as jit needs
class LlavaVision:
    """The CLIP tower, the config's feature layer(s) and select strategy, and the
    projector: `encode` maps `[N, 3, H, W]` pixels to `[N, L, H_text]` embeddings."""

    spec: CLIPVisionSpec
    feature_layers: tuple[int, ...]  # Transformers' hidden_states indices, may be < 0
    select_strategy: str  # "default" drops the class token, "full" keeps it
    projector_act: str
    dtype: jnp.dtype

    def tokens_per_image(self) -> int:
        patches = (self.spec.image_size // self.spec.patch_size) ** 2
        return patches + self.spec.has_class_token - (self.select_strategy == "default")

    def encode(self, params: dict[str, Any], pixels: jax.Array) -> jax.Array:
        """`[N, 3, H, W]` float pixels -> `[N, L, H_text]` embeddings."""
        n = self.spec.num_layers
        wanted = [i % (n + 1) for i in self.feature_layers]
        states = hidden_states(params["vision"], self.spec, pixels.astype(self.dtype), max(wanted))
        x = jnp.concatenate([states[i] for i in wanted], axis=-1)  # [N, T, D * layers]
        if self.select_strategy == "default":
            x = x[:, 1:]
        p = params["projector"]
        h = activation(self.projector_act, linear(p, "linear_1", x))
        return linear(p, "linear_2", h)


def _strip(name: str, prefixes: Sequence[str]) -> str | None:
    for prefix in prefixes:
        if name.startswith(prefix):
            return name.removeprefix(prefix).removeprefix("vision_model.")
    return None


def load_vision(
    model_dir: str | Path, cfg: dict[str, Any], dtype: jnp.dtype, place: Any = None
) -> tuple[LlavaVision, dict[str, Any]]:
    """The vision side and its parameters (`{"vision": ..., "projector": ...}`), each
    tensor through `place` (device placement; default: this process's first device)."""
    strategy = cfg.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(
            f"vision_feature_select_strategy {strategy!r} is not supported (default, full)"
        )
    layer = cfg.get("vision_feature_layer", -2)
    layers = tuple(layer) if isinstance(layer, list) else (int(layer),)
    vision = LlavaVision(
        CLIPVisionSpec.from_config(cfg.get("vision_config") or {}),
        layers,
        strategy,
        cfg.get("projector_hidden_act", "gelu"),
        jnp.dtype(dtype),
    )
    place = place or jax.device_put
    index = SafetensorsIndex(Path(model_dir))
    params: dict[str, dict[str, Any]] = {"vision": {}, "projector": {}}
    for name in sorted(index.names()):
        for part, prefixes in (("vision", _VISION_PREFIXES), ("projector", _PROJECTOR_PREFIXES)):
            key = _strip(name, prefixes)
            if key is not None and not key.startswith(("post_layernorm", "head.")):
                params[part][key] = place(np.asarray(index.array(name)).astype(dtype))
    if not params["vision"] or not params["projector"]:
        raise ValueError(f"{model_dir}: no vision_tower or multi_modal_projector tensors")
    return vision, params


def vision_for(
    model_dir: str | Path, spec: ModelSpec, cfg: dict[str, Any], dtype: jnp.dtype, mesh: Mesh | None
) -> tuple[LlavaVision, dict[str, Any]] | None:
    """A LLaVA checkpoint's vision side, replicated over `mesh` when given; None for a
    text-only model."""
    if spec.architecture != ARCHITECTURE:
        return None
    place = None if mesh is None else (lambda x: jax.device_put(x, replicated(mesh)))
    return load_vision(model_dir, cfg, dtype, place)
