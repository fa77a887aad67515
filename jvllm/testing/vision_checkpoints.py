"""Tiny random LLaVA checkpoints with their processor, for tests and benchmarks.

Owns `make_llava_checkpoint`: Transformers' own `LlavaForConditionalGeneration` (a CLIP
vision tower, the projector and a Llama language model), every parameter perturbed away
from its initial constant (norms, biases, the class embedding), saved with a
`LlavaProcessor` (`CLIPImageProcessor` and a word tokenizer with an `<image>` token, and
a chat template that takes image content parts). Imports nothing of jvllm but
`checkpoints`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jvllm.testing.checkpoints import write_word_tokenizer

IMAGE_TOKEN = "<image>"
# Content parts: {"type": "image"} (or "image_url") becomes the image token.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}:"
    "{% if m['content'] is string %} {{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'text' %} {{ part['text'] }}"
    "{% else %} <image>{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def make_llava_checkpoint(
    out_dir: str | Path,
    seed: int = 0,
    image_size: int = 28,
    patch_size: int = 7,
    vocab_size: int = 127,
    text_overrides: dict[str, Any] | None = None,
    vision_overrides: dict[str, Any] | None = None,
    vision_model: str = "clip",
) -> Path:
    """A random LLaVA checkpoint (float32) with its processor, in `out_dir`; the
    overrides replace the tiny default sizes of the language and vision configs.
    `vision_model` "siglip": a SigLIP tower, all its tokens used (select strategy full)."""
    import torch
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        SiglipVisionConfig,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_word_tokenizer(out, vocab_size)
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_tokens([IMAGE_TOKEN], special_tokens=True)
    image_token_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    text_kwargs: dict[str, Any] = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    text = LlamaConfig(**{**text_kwargs, **(text_overrides or {})})
    vision_kwargs: dict[str, Any] = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch_size,
    )
    siglip = vision_model == "siglip"
    vision_cls = SiglipVisionConfig if siglip else CLIPVisionConfig
    vision = vision_cls(**{**vision_kwargs, **(vision_overrides or {})})
    strategy = "full" if siglip else "default"
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_id,
        vision_feature_layer=-2,
        vision_feature_select_strategy=strategy,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in model.parameters():  # norms and biases start constant
            param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(out, safe_serialization=True)
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": image_size},
        crop_size={"height": image_size, "width": image_size},
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=patch_size,
        vision_feature_select_strategy=strategy,
        num_additional_image_tokens=0 if siglip else 1,
        chat_template=CHAT_TEMPLATE,
    )
    tok.chat_template = CHAT_TEMPLATE
    processor.save_pretrained(out)
    tok.save_pretrained(out)
    return out
