"""Which `config.architectures` names jvllm serves, with which Flax module, and which
function reads their config.json into a `ModelSpec`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn

from jvllm.models.deepseek import DeepseekForCausalLM
from jvllm.models.deepseek_spec import deepseek_spec
from jvllm.models.gemma import GemmaForCausalLM, gemma_spec
from jvllm.models.glm4_moe import glm4_moe_spec
from jvllm.models.gpt_oss import GptOssForCausalLM, gpt_oss_spec
from jvllm.models.llama import CausalLM
from jvllm.models.llava import LlavaForConditionalGeneration, llava_spec
from jvllm.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration, qwen2_5_vl_spec
from jvllm.models.spec import ModelSpec, spec_from_hf_config

_REGISTRY: dict[str, type[nn.Module]] = {
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Glm4MoeForCausalLM": CausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "LlamaForCausalLM": CausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "MistralForCausalLM": CausalLM,
    "MixtralForCausalLM": CausalLM,
    "OlmoeForCausalLM": CausalLM,
    "Phi3ForCausalLM": CausalLM,
    "Qwen2ForCausalLM": CausalLM,
    "Qwen2MoeForCausalLM": CausalLM,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Qwen3ForCausalLM": CausalLM,
    "Qwen3MoeForCausalLM": CausalLM,
}
# Architectures whose config.json is read by their own module (the rest by
# `spec_from_hf_config`).
_SPEC_READERS: dict[str, Callable[[dict[str, Any]], ModelSpec]] = {
    "Gemma2ForCausalLM": gemma_spec,
    "Gemma3ForCausalLM": gemma_spec,
    "Glm4MoeForCausalLM": glm4_moe_spec,
    "GptOssForCausalLM": gpt_oss_spec,
    "LlavaForConditionalGeneration": llava_spec,
    "Qwen2_5_VLForConditionalGeneration": qwen2_5_vl_spec,
    "DeepseekV2ForCausalLM": deepseek_spec,
    "DeepseekV3ForCausalLM": deepseek_spec,
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def model_class(architecture: str) -> type[nn.Module]:
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} is not supported; "
            f"supported: {', '.join(supported_architectures())}"
        ) from None


def read_spec(cfg: dict[str, Any]) -> ModelSpec:
    """The ModelSpec of a parsed config.json, by its architecture's own reader."""
    archs = cfg.get("architectures") or []
    reader = _SPEC_READERS.get(archs[0]) if archs else None
    return reader(cfg) if reader is not None else spec_from_hf_config(cfg)
