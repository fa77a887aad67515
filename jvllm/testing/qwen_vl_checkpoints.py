"""Tiny random Qwen2.5-VL checkpoints with their processor, for tests and benchmarks.

Owns `make_qwen2_5_vl_checkpoint`: Transformers' own `Qwen2_5_VLForConditionalGeneration`
(the window-attention ViT with its patch merger, and a Qwen2 language model with M-RoPE),
every parameter perturbed away from its initial constant, saved with
its image processor (`Qwen2VLImageProcessorPil`) and a word tokenizer with the vision
tokens and a chat template that takes image content parts; `transformers_processor`:
Transformers' own processor of such a checkpoint (the reference side of tests and
benchmarks). Imports nothing of jvllm but `checkpoints`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jvllm.testing.checkpoints import write_word_tokenizer

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
# Content parts: {"type": "image"} (or "image_url") becomes the placeholder.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}:"
    "{% if m['content'] is string %} {{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'text' %} {{ part['text'] }}"
    "{% else %} <|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}"
    "{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
# Patches of 4 pixels merged 2 x 2, windows of 16 pixels (2 x 2 merged tokens): a
# 40 x 24 image is 10 x 6 patches, 5 x 3 tokens, windows cut with padding.
PATCH_SIZE, MERGE_SIZE, WINDOW_SIZE = 4, 2, 16


def make_qwen2_5_vl_checkpoint(
    out_dir: str | Path,
    seed: int = 0,
    vocab_size: int = 127,
    text_overrides: dict[str, Any] | None = None,
    vision_overrides: dict[str, Any] | None = None,
    max_pixels: int = 48 * 48,
) -> Path:
    """A random Qwen2.5-VL checkpoint (float32) with its processor, in `out_dir`; the
    overrides replace the tiny default sizes of the language and vision configs.
    Images are resized to at most `max_pixels` pixels (multiples of 8 a side)."""
    import torch
    from transformers import (
        AutoTokenizer,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_word_tokenizer(out, vocab_size)
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_tokens(list(VISION_TOKENS), special_tokens=True)
    ids = dict(zip(VISION_TOKENS, tok.convert_tokens_to_ids(list(VISION_TOKENS)), strict=True))
    text: dict[str, Any] = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    vision: dict[str, Any] = dict(
        depth=4,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        patch_size=PATCH_SIZE,
        spatial_merge_size=MERGE_SIZE,
        temporal_patch_size=2,
        window_size=WINDOW_SIZE,
        fullatt_block_indexes=[1, 3],
        out_hidden_size=64,
    )
    config = Qwen2_5_VLConfig(
        text_config={**text, **(text_overrides or {})},
        vision_config={**vision, **(vision_overrides or {})},
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in model.parameters():  # norms and biases start constant
            param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(out, safe_serialization=True)
    factor = PATCH_SIZE * MERGE_SIZE
    # The image processor and the tokenizer: what jvllm reads (engine/qwen_vl_processor.py;
    # Transformers' Qwen2_5_VLProcessor would also need torchvision for its video part).
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": factor * factor, "longest_edge": max_pixels},
        patch_size=PATCH_SIZE,
        temporal_patch_size=2,
        merge_size=MERGE_SIZE,
    )
    image_processor.save_pretrained(out)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    return out


def transformers_processor(path: str | Path) -> Any:
    """Transformers' own `Qwen2_5_VLProcessor` of a checkpoint, for reference runs,
    without its video processor (which needs torchvision, absent here): its class
    check of that part is skipped."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLProcessor
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: None
    try:
        return Qwen2_5_VLProcessor(
            image_processor=AutoImageProcessor.from_pretrained(path),
            tokenizer=AutoTokenizer.from_pretrained(path),
            video_processor=None,
        )
    finally:
        ProcessorMixin.check_argument_for_proper_class = check
