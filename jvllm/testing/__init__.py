"""Testing tools: tiny random-weight checkpoints and a locally trained tokenizer, and the
comparison with Transformers that jvllm's tests and its pytest plugin share.

Nothing is downloaded: the tokenizer is a byte-level BPE trained with `tokenizers`
on a built-in corpus, and checkpoints are built with Transformers + torch (CPU)
from small configs, then saved as safetensors. torch and transformers' modelling
code are test dependencies, imported only by the modules that need them (the runners
load lazily: `from jvllm.testing import HfRunner`).
"""

from __future__ import annotations

import importlib
from typing import Any

from jvllm.testing.checkpoints import ARCHITECTURES, make_checkpoint
from jvllm.testing.compare import (
    EXAMPLE_PROMPTS,
    check_logprobs_close,
    check_outputs_equal,
)
from jvllm.testing.tokenizer import make_tokenizer

__all__ = [
    "ARCHITECTURES",
    "EXAMPLE_PROMPTS",
    "HfRunner",
    "JvllmRunner",
    "VllmRunner",
    "check_logprobs_close",
    "check_outputs_equal",
    "hf_greedy",
    "make_checkpoint",
    "make_tokenizer",
]

_LAZY = {
    "HfRunner": "jvllm.testing.hf_runner",
    "hf_greedy": "jvllm.testing.hf_runner",
    "JvllmRunner": "jvllm.testing.jvllm_runner",
    "VllmRunner": "jvllm.testing.jvllm_runner",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jvllm.testing' has no attribute {name!r}")
