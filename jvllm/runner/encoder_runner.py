"""The vision encoder's side of the runner: each image encoded once, and a step's
image embeddings laid out over its tokens.

Owns the jitted encoder program (one per image shape: LLaVA's processor resizes every
image to one size, so one program; Qwen2.5-VL's keeps the aspect, one per patch grid),
the cache of its outputs by image content hash, and `step_inputs`: the `[T, H]`
embeddings and `[T]` mask that the step's forward merges into its input embeddings,
and for an M-RoPE model (Qwen2.5-VL) the step's `[3, T]` rotary positions. A row
covering part of an image (a chunked prefill, or a prefix-cache hit that ends inside
one) takes the matching slice of its embeddings and positions. Not owned: the
encoder's computation (`models/llava.py`, `models/qwen2_5_vl.py`) or which images a
step covers (the engine's `SchedulerOutput.mm_features`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jvllm.engine.step_io import MultiModalFeature

# Encoder outputs kept on the host (LRU), bounded in embeddings as vLLM's encoder cache
# (a 7B model's 3584-wide float32 rows: 470 MB): a request's chunks and a repeated image
# reuse them; the newest image stays even when it alone is larger.
ENCODER_CACHE_TOKENS = 32768


class EncoderRunner:
    def __init__(self, vision: Any, params: dict[str, Any]) -> None:
        self.vision = vision
        self.params = params
        # Qwen2.5-VL's tower: one program per patch grid (a static argument).
        self._encode = jax.jit(
            vision.encode, static_argnames=getattr(vision, "static_argnames", ())
        )
        self.mrope = hasattr(vision, "mrope_positions")  # 3-row rotary positions (M-RoPE)
        self.cache: OrderedDict[str, np.ndarray] = OrderedDict()  # hash -> [L, H] float32
        self.cached_tokens = 0  # embeddings held in `cache`
        self.num_encoded = 0  # images run through the encoder

    def embeddings(self, feature: MultiModalFeature) -> np.ndarray:
        """`[L, H]` float32 embeddings of one image, encoded at its first use."""
        cached = self.cache.get(feature.identifier)
        if cached is not None:
            self.cache.move_to_end(feature.identifier)
            return cached
        # A sync: the step that first covers the image waits for its embeddings.
        grid = (
            {}
            if feature.token_grid is None
            else {"grid": self.vision.encoder_grid(feature.token_grid)}
        )
        out = np.asarray(self._encode(self.params, feature.pixel_values, **grid), np.float32)[0]
        if out.shape[0] != feature.length:
            raise ValueError(
                f"image {feature.identifier[:12]} has {feature.length} placeholder tokens, "
                f"the vision encoder gives {out.shape[0]} embeddings"
            )
        self.num_encoded += 1
        self.cache[feature.identifier] = out
        self.cached_tokens += out.shape[0]
        while self.cached_tokens > ENCODER_CACHE_TOKENS and len(self.cache) > 1:
            self.cached_tokens -= self.cache.popitem(last=False)[1].shape[0]
        return out

    def step_inputs(
        self,
        rows: Sequence[Any],
        features: Mapping[str, Sequence[MultiModalFeature]],
        num_tokens: int,
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The step's image embeddings `[T, H]` float32 and mask `[T]` bool over its
        `num_tokens` (padded) tokens, rows in order; None when no row holds an image token."""
        embeds: np.ndarray | None = None
        mask = np.zeros(num_tokens, np.bool_)
        offset = 0
        for row in rows:
            start, n = row.start_position, len(row.token_ids)
            for f in features.get(getattr(row, "request_id", ""), ()):
                lo, hi = max(start, f.offset), min(start + n, f.offset + f.length)
                if lo >= hi:
                    continue
                emb = self.embeddings(f)
                if embeds is None:
                    embeds = np.zeros((num_tokens, emb.shape[1]), np.float32)
                embeds[offset + lo - start : offset + hi - start] = emb[
                    lo - f.offset : hi - f.offset
                ]
                mask[offset + lo - start : offset + hi - start] = True
            offset += n
        return None if embeds is None else (embeds, mask)

    def mrope_positions(
        self,
        rows: Sequence[Any],
        features: Mapping[str, Sequence[MultiModalFeature]],
        num_tokens: int,
    ) -> np.ndarray:
        """`[3, T]` int32 M-RoPE positions of the step's rows: a row without images
        its 1-D positions thrice, a row of a request with images sliced from the
        request's (`mrope_positions` of the model); padding 0."""
        out = np.zeros((3, num_tokens), np.int32)
        offset = 0
        for row in rows:
            start, n = row.start_position, len(row.token_ids)
            mine = features.get(getattr(row, "request_id", ""), ())
            if mine:
                out[:, offset : offset + n] = self.vision.mrope_positions(mine, start, n)
            else:
                out[:, offset : offset + n] = np.arange(start, start + n)
            offset += n
        return out


def step_inputs(
    encoder: EncoderRunner | None,
    rows: Sequence[Any],
    features: Mapping[str, Sequence[MultiModalFeature]] | None,
    num_tokens: int,
) -> dict[str, Any] | None:
    """The forward's extra inputs of a vision-language step: `mm_inputs` (image
    embeddings and mask) when a row holds image tokens, and for an M-RoPE model always
    `mrope_positions` `[3, T]`; None for a text-only model or step."""
    if encoder is None:
        return None
    extra: dict[str, Any] = {}
    if encoder.mrope:
        extra["mrope_positions"] = encoder.mrope_positions(rows, features or {}, num_tokens)
    mm = encoder.step_inputs(rows, features, num_tokens) if features else None
    if mm is not None:
        extra["mm_inputs"] = mm
    return extra or None
