"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): a Qwen2 language model with
M-RoPE that takes image embeddings at its image-token positions, and its vision side.

Owns reading the checkpoint's config (`qwen2_5_vl_spec`: the language model's
`ModelSpec`, its `mrope_section` in `spec.variant`), the language module (rotary
positions `[3, T]`: temporal, height, width, each rotating its share of the frequencies),
the checkpoint's language tensor names, the vision side (`QwenVision`: the tower of
`models/qwen_vision.py` run per image grid) with its loading, and the host-side M-RoPE
positions of a step's row (`mrope_positions`: Transformers' `get_rope_index`, sliced).
Not owned: running the encoder per image and caching its outputs
(`runner/encoder_runner.py`), or processing prompts and images (`engine/multimodal.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jvllm.layers.rotary import attention_scaling
from jvllm.models import qwen_vision
from jvllm.models.llava import LanguageModelIndex, LlavaDecoderModel, LlavaForConditionalGeneration
from jvllm.models.safetensors_index import SafetensorsIndex
from jvllm.models.spec import ModelSpec, spec_from_hf_config
from jvllm.parallel.mesh import replicated

if TYPE_CHECKING:
    from jvllm.engine.step_io import MultiModalFeature

ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"
# Where checkpoints keep the language model's tensors (the original and Transformers'
# later layout); `visual.` / `model.visual.` hold the tower.
_LANGUAGE_PREFIXES = (
    ("model.language_model.", "model."),
    ("model.visual.", None),
    ("model.", "model."),
    ("lm_head.", "lm_head."),
)
_VISION_PREFIXES = ("model.visual.", "visual.")


@dataclasses.dataclass(frozen=True)
class MRopeOptions:
    """`spec.variant` of Qwen2.5-VL: how the rotary half-dims split among t, h, w."""

    mrope_section: tuple[int, ...]


def qwen2_5_vl_spec(cfg: dict[str, Any]) -> ModelSpec:
    """The language model's spec (a Qwen2), under Qwen2.5-VL's architecture name."""
    text = dict(cfg.get("text_config") or cfg)
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    section = tuple(int(s) for s in rope.pop("mrope_section", (16, 24, 24)))
    if rope.get("rope_type", rope.get("type")) in ("mrope", None):
        rope["rope_type"] = "default"
    rope.pop("type", None)
    text["rope_parameters"] = rope
    text.pop("rope_scaling", None)
    text["architectures"] = ["Qwen2ForCausalLM"]
    text.setdefault("torch_dtype", cfg.get("torch_dtype") or cfg.get("dtype"))
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    spec = spec_from_hf_config(text)
    if 2 * sum(section) != spec.head_dim:
        raise ValueError(
            f"mrope_section {list(section)} must sum to head_dim / 2 = {spec.head_dim // 2}"
        )
    return dataclasses.replace(spec, architecture=ARCHITECTURE, variant=MRopeOptions(section))


class QwenLanguageIndex(LanguageModelIndex):
    """The checkpoint's language tensors under a causal LM's names."""

    def __init__(self, index: SafetensorsIndex, spec: ModelSpec) -> None:
        self.index = index
        self.by_name: dict[str, str] = {}
        for name in index.names():
            for old, new in _LANGUAGE_PREFIXES:
                if name.startswith(old):
                    if new is not None:
                        self.by_name[new + name.removeprefix(old)] = name
                    break

    def describe(self, name: str, shape: tuple[int, ...]) -> str:
        return f"{name!r} (shape {shape}; a Qwen2.5-VL language tensor)"


def mrope_cos_sin(
    positions: jax.Array,  # [3, T] int32: t, h, w
    inv_freq: np.ndarray,  # [D / 2]
    section: Sequence[int],
    dtype: jnp.dtype,
    scaling: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """cos and sin `[T, D]`: frequency j turns with the row of `positions` its
    `section` chunk names (chunk i: row i % 3), as Transformers' Qwen2.5-VL rotary."""
    rows = np.repeat(np.arange(len(section)) % 3, section)  # [D / 2]
    chosen = positions[rows].astype(jnp.float32)  # [D / 2, T]
    freqs = chosen.T * jnp.asarray(inv_freq)  # [T, D / 2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return (jnp.cos(emb) * scaling).astype(dtype), (jnp.sin(emb) * scaling).astype(dtype)


class QwenVLDecoderModel(LlavaDecoderModel):
    """LLaVA's decoder (image tokens take given embeddings) with M-RoPE: positions
    `[T]` or `[3, T]` int32 (a text-only step: 3 equal rows)."""

    def cos_sin(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        if positions.ndim == 1:
            positions = jnp.broadcast_to(positions, (3, positions.shape[0]))
        section = self.spec.variant.mrope_section
        scaling = attention_scaling(self.spec.rope)
        return mrope_cos_sin(positions, self.inv_freq, section, self.dtype, scaling)


class Qwen2_5_VLForConditionalGeneration(LlavaForConditionalGeneration):
    """The language side of Qwen2.5-VL; `checkpoint_index` finds its tensors."""

    checkpoint_index = QwenLanguageIndex
    decoder = QwenVLDecoderModel


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity, as jit needs
class QwenVision:
    """The vision tower: `encode` maps one image's patches to its embeddings; one
    program per patch grid (`static_argnames`)."""

    spec: qwen_vision.QwenVisionSpec
    dtype: jnp.dtype
    static_argnames = ("grid",)

    def encode(self, params: dict[str, Any], pixels: jax.Array, grid: tuple) -> jax.Array:
        """`[1, P, C * tps * patch^2]` patches of a `grid` (t, h, w) image ->
        `[1, P / merge^2, H_text]` embeddings."""
        return qwen_vision.encode(params, self.spec, pixels[0].astype(self.dtype), grid)[None]

    def encoder_grid(self, token_grid: tuple[int, int, int]) -> tuple[int, int, int]:
        """The patch grid of an image whose merged token grid is `token_grid`."""
        t, h, w = token_grid
        m = self.spec.spatial_merge_size
        return (t, h * m, w * m)

    def mrope_positions(
        self, features: Sequence[MultiModalFeature], start: int, num_tokens: int
    ) -> np.ndarray:
        return mrope_positions(features, start, num_tokens)


def mrope_positions(
    features: Sequence[MultiModalFeature], start: int, num_tokens: int
) -> np.ndarray:  # [3, num_tokens] int32
    """M-RoPE positions of prompt/output tokens [start, start + num_tokens) of a request
    whose images are `features` (Transformers' `get_rope_index`, then position + delta):
    a text token sits at its index plus the shift of the images before it, an image's
    tokens at (t, h, w) over its merged grid from the position its first token would
    have, and each image shifts what follows by max(h, w) - its token count."""
    out = np.broadcast_to(np.arange(start, start + num_tokens), (3, num_tokens)).copy()
    shift = 0  # the images' shift so far: the next position minus the next index
    for f in sorted(features, key=lambda f: f.offset):
        assert f.token_grid is not None, "an M-RoPE image needs its token grid"
        t, h, w = f.token_grid
        end = f.offset + f.length
        lo, hi = max(start, f.offset), min(start + num_tokens, end)
        if lo < hi:  # the image's tokens in this slice
            k = np.arange(lo, hi) - f.offset
            grid_pos = np.stack([k // (h * w), (k // w) % h, k % w])  # [3, n]
            out[:, lo - start : hi - start] = f.offset + shift + grid_pos
        # Every token after the image moves by its shift (image tokens of later images
        # are written over with their own grid above).
        out[:, max(end - start, 0) :] += max(h, w) - f.length
        shift += max(h, w) - f.length
    return out.astype(np.int32)


def load_vision(
    model_dir: str | Path, cfg: dict[str, Any], dtype: jnp.dtype, place: Any = None
) -> tuple[QwenVision, dict[str, Any]]:
    """The vision tower and its parameters (flat, by name inside `visual.`), each
    tensor through `place` (device placement; default: this process's first device)."""
    vision = QwenVision(
        qwen_vision.QwenVisionSpec.from_config(cfg.get("vision_config") or {}), jnp.dtype(dtype)
    )
    place = place or jax.device_put
    index = SafetensorsIndex(Path(model_dir))
    params: dict[str, Any] = {}
    for name in sorted(index.names()):
        for prefix in _VISION_PREFIXES:
            if name.startswith(prefix):
                key = name.removeprefix(prefix)
                params[key] = place(np.asarray(index.array(name)).astype(dtype))
                break
    if "patch_embed.proj.weight" not in params:
        raise ValueError(f"{model_dir}: no visual.* (vision tower) tensors")
    return vision, params


def vision_for(
    model_dir: str | Path, spec: ModelSpec, cfg: dict[str, Any], dtype: jnp.dtype, mesh: Mesh | None
) -> tuple[QwenVision, dict[str, Any]] | None:
    """A Qwen2.5-VL checkpoint's vision side, replicated over `mesh` when given; None
    for another architecture."""
    if spec.architecture != ARCHITECTURE:
        return None
    place = None if mesh is None else (lambda x: jax.device_put(x, replicated(mesh)))
    return load_vision(model_dir, cfg, dtype, place)
