"""Which `config.architectures` names jvllm serves, and with which Flax module."""

from __future__ import annotations

import flax.linen as nn

from jvllm.models.deepseek import DeepseekForCausalLM
from jvllm.models.llama import CausalLM

_REGISTRY: dict[str, type[nn.Module]] = {
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
    "LlamaForCausalLM": CausalLM,
    "MistralForCausalLM": CausalLM,
    "MixtralForCausalLM": CausalLM,
    "OlmoeForCausalLM": CausalLM,
    "Phi3ForCausalLM": CausalLM,
    "Qwen2ForCausalLM": CausalLM,
    "Qwen2MoeForCausalLM": CausalLM,
    "Qwen3ForCausalLM": CausalLM,
    "Qwen3MoeForCausalLM": CausalLM,
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
