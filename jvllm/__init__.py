"""jvllm: a JAX-native LLM inference and serving engine (PagedAttention, continuous batching).

`from jvllm import LLM, SamplingParams`. The heavy names load lazily, so that
host-only modules (`jvllm.engine`) import without jax.
"""

from __future__ import annotations

import importlib
from typing import Any

from jvllm.sampling_params import (
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

__version__ = "0.1.0"
_POOLING_OUTPUTS = (
    "PoolingRequestOutput",
    "EmbeddingRequestOutput",
    "ClassificationRequestOutput",
    "ScoringRequestOutput",
)
__all__ = [
    "LLM",
    "SamplingParams",
    "BeamSearchParams",
    "StructuredOutputsParams",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "LoRARequest",
    "PoolingParams",
    *_POOLING_OUTPUTS,
    "__version__",
]

_LAZY = {
    "LLM": "jvllm.llm",
    "RequestOutput": "jvllm.outputs",
    "CompletionOutput": "jvllm.outputs",
    "BeamSearchOutput": "jvllm.beam_search",
    "BeamSearchSequence": "jvllm.beam_search",
    "LoRARequest": "jvllm.lora.request",
    "PoolingParams": "jvllm.pooling.params",
    **dict.fromkeys(_POOLING_OUTPUTS, "jvllm.pooling.outputs"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jvllm' has no attribute {name!r}")
