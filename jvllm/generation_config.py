"""What a request gets when it sets nothing: the model's generation_config.json defaults
(as vLLM's `--generation-config`), and the cap on the logprobs it may ask for.

Owns reading the file and choosing its source: `auto` (the model directory), `vllm`
(ignore the file's sampling defaults, keep its EOS ids, as vLLM does) or a directory
holding a generation_config.json. The offline API applies the defaults when no
SamplingParams is given (`LLM.get_default_sampling_params()`); the server fills each
request field the client left unset. EOS ids from the same file go to the engine
through `EngineArgs`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jvllm.sampling_params import MAX_LOGPROBS, SamplingParams

logger = logging.getLogger("jvllm")

FILE_NAME = "generation_config.json"
# generation_config.json key -> SamplingParams field (vLLM reads the same six).
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# Transformers' GenerationConfig defaults: a file that repeats one sets no default
# (vLLM compares with these through `to_diff_dict()`).
_HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def generation_config_dir(generation_config: str, model: str) -> Path:
    """The directory whose generation_config.json applies; raises for a bad value."""
    if generation_config in ("auto", "vllm"):
        return Path(model)
    path = Path(generation_config)
    if not (path / FILE_NAME).is_file():
        raise FileNotFoundError(
            f"generation_config={generation_config!r}: expected 'auto', 'vllm' or a "
            f"directory holding {FILE_NAME}"
        )
    return path


def read_generation_config(directory: Path) -> dict[str, Any]:
    path = directory / FILE_NAME
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


@dataclass(frozen=True)
class RequestDefaults:
    """SamplingParams field -> default value, and the largest logprobs a request gets."""

    sampling: dict[str, Any] = field(default_factory=dict)
    max_logprobs: int = MAX_LOGPROBS

    def __post_init__(self) -> None:
        if not isinstance(self.max_logprobs, int) or not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"max_logprobs must be an integer in [0, {MAX_LOGPROBS}] (the sampler "
                f"computes at most {MAX_LOGPROBS} top logprobs), got {self.max_logprobs!r}"
            )
        SamplingParams(**self.sampling)  # a bad file value fails at startup, not per request

    @classmethod
    def load(cls, generation_config: str, model: str, max_logprobs: int) -> RequestDefaults:
        directory = generation_config_dir(generation_config, model)
        sampling: dict[str, Any] = {}
        if generation_config != "vllm":
            data = read_generation_config(directory)
            for key, name in SAMPLING_KEYS.items():
                if data.get(key) is not None and data[key] != _HF_DEFAULTS.get(key):
                    sampling[name] = data[key]
        if sampling:
            logger.info(
                "default sampling parameters from %s: %s (pass --generation-config vllm "
                "to use vLLM's defaults instead)",
                directory / FILE_NAME,
                sampling,
            )
        return cls(sampling, max_logprobs)

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.sampling)

    def check_logprobs(self, params: SamplingParams) -> None:
        """Raises ValueError naming the field that asks for more than max_logprobs."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(
                    f"{name} asks for {value}, more than this engine's max_logprobs="
                    f"{self.max_logprobs}"
                )
