"""Qwen2.5-VL's prompt processing for images: the checkpoint's image processor and
tokenizer, with each image placeholder expanded as `Qwen2_5_VLProcessor` expands it.

Transformers' `Qwen2_5_VLProcessor` also builds a video processor, which needs
torchvision; jvllm takes images only, so it reads the two parts it uses
(`AutoImageProcessor`, `AutoTokenizer`) from the checkpoint and repeats the
processor's one step on top: each `<|image_pad|>` becomes grid_t * grid_h * grid_w /
merge_size^2 of them. Owns that; not owned: the features per image and the limits
(`engine/multimodal.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"


def is_qwen_vl(model_dir: str) -> bool:
    """Whether the checkpoint in `model_dir` is a Qwen2.5-VL."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return False
    return ARCHITECTURE in (json.loads(path.read_text()).get("architectures") or [])


class QwenVLProcessor:
    """Called as a Transformers processor: `(text=..., images=..., return_tensors="np")`
    -> `input_ids [1, L]`, `pixel_values [P, C * tps * patch^2]`, `image_grid_thw [N, 3]`."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.image_processor = AutoImageProcessor.from_pretrained(model_dir)
        self.image_token = getattr(self.tokenizer, "image_token", None) or "<|image_pad|>"
        self.merge_size = int(self.image_processor.merge_size)

    def __call__(
        self, text: str, images: list[Any] | None = None, return_tensors: str = "np"
    ) -> dict[str, np.ndarray]:
        images = images or []
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(images):
            raise ValueError(
                f"the text has {len(pieces) - 1} {self.image_token!r} placeholders for "
                f"{len(images)} images"
            )
        out: dict[str, np.ndarray] = {}
        if images:
            processed = self.image_processor(images=images, return_tensors="np")
            out["pixel_values"] = np.asarray(processed["pixel_values"], np.float32)
            out["image_grid_thw"] = grids = np.asarray(processed["image_grid_thw"], np.int64)
            counts = [int(g.prod()) // self.merge_size**2 for g in grids]
            expanded = [pieces[0]]
            for count, piece in zip(counts, pieces[1:], strict=True):
                expanded += [self.image_token * count, piece]
            text = "".join(expanded)
        ids = self.tokenizer(text)["input_ids"]
        out["input_ids"] = np.asarray([ids], np.int64)
        return out
