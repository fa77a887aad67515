"""Engine configuration: frozen dataclasses validated on construction.

Owns the knobs and their checks. Values derived from a checkpoint (the model's
shapes) live in `jvllm.models.spec.ModelSpec`, not here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from jvllm.lora.config import LoRAConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULING_POLICIES = ("continuous", "fcfs", "priority", "static")
PREEMPTION_MODES = ("recompute", "swap")
ATTENTION_BACKENDS = ("auto", "triton", "cpu", "reference")


@dataclass(frozen=True)
class ModelConfig:
    model: str
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )


# Host-only (ml_dtypes, not jax): the scheduler imports this module.
_KV_DTYPES = {
    "fp8": np.dtype(ml_dtypes.float8_e4m3fn),
    "fp8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
    "fp8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    # GiB of host memory per device for swapped-out KV blocks (vLLM's swap_space); only
    # allocated with SchedulerConfig.preemption_mode == "swap".
    swap_space: float = 4.0
    # GiB of host memory per device for full prefix-cache blocks evicted from the device
    # (vLLM V1's kv_offloading_size); 0 turns the host tier off.
    kv_offloading_size: float = 0.0
    # The KV cache's storage type (vLLM's cache_dtype): "auto" is the model dtype;
    # "fp8" / "fp8_e4m3" store float8 e4m3 and "fp8_e5m2" float8 e5m2 (one byte a value,
    # unscaled, as vLLM without calibrated scales), cast up when attention reads them.
    kv_cache_dtype: str = "auto"

    def kv_dtype(self, model_dtype: Any) -> Any:
        """The cache's jnp dtype for a model of `model_dtype`."""
        return _KV_DTYPES.get(self.kv_cache_dtype) or model_dtype

    def __post_init__(self) -> None:
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in _KV_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be auto, {', '.join(_KV_DTYPES)}; got {self.kv_cache_dtype!r}"
            )
        size = self.kv_offloading_size
        if not isinstance(size, int | float) or not 0 <= size < 1e6:
            raise ValueError(f"kv_offloading_size must be a number of GiB >= 0, got {size!r}")
        if not isinstance(self.swap_space, int | float) or not 0 <= self.swap_space < 1e6:
            raise ValueError(f"swap_space must be a number of GiB >= 0, got {self.swap_space!r}")
        if self.block_size not in (8, 16, 32):
            raise ValueError(f"block_size must be 8, 16 or 32, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(
                "num_gpu_blocks_override must be >= 2 (block 0 is reserved), "
                f"got {self.num_gpu_blocks_override}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    # "continuous" (vLLM's "fcfs", the same): first come, first served; "priority":
    # lower Request.priority first, ties by arrival, preempting the lowest first;
    # "static": whole batches, a baseline for comparison.
    scheduling_policy: str = "continuous"
    # Schedule step N + 1 while step N runs (vLLM's async scheduling); False waits for
    # each step before scheduling the next.
    async_scheduling: bool = True
    # What a preempted request loses: "recompute" drops its KV blocks, "swap" copies its
    # blocks to host memory (CacheConfig.swap_space) and back, recomputing only when
    # the host pool is full.
    preemption_mode: str = "recompute"
    # With LoRA: the most distinct adapters the running requests may use (max_loras).
    max_loras: int = 0

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}"
            )


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Micro-batches a pipelined step runs (None: one per stage).
    pipeline_micro_batches: int | None = None
    # A mixture-of-experts model's experts split whole over the `tp` devices (the expert
    # parallel size is the tensor parallel size, as in vLLM).
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        m = self.pipeline_micro_batches
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ValueError(f"pipeline_micro_batches must be an integer >= 1, got {m!r}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "medusa", "deepseek_mtp")
# Other spellings vLLM accepts for a method.
SPECULATIVE_ALIASES = {"mtp": "deepseek_mtp", "glm4_moe_mtp": "deepseek_mtp"}
# The most draft tokens one row verifies (each costs a logits row of the step).
MAX_SPECULATIVE_TOKENS = 16
_SPECULATIVE_KEYS = frozenset(
    ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config: a proposer guesses `num_speculative_tokens` tokens per
    decode row, the target model scores them all in one step and keeps the longest run
    it agrees with. `method="ngram"` looks the guesses up in the request's own prompt
    and output (prompt_lookup_min..max tokens of suffix matched); `"draft_model"` asks a
    smaller model with the same vocabulary (`model`); `"eagle"` an EAGLE-1 head trained
    for the target (`model`), which drafts from the target's hidden states (`"eagle3"`
    an EAGLE-3 head: three target layers fused, a draft vocabulary); `"medusa"`
    Medusa heads (`model`), each predicting one more token ahead from the target's hidden
    state (at most their number of drafts); `"deepseek_mtp"` (or `"mtp"`,
    `"glm4_moe_mtp"`) the target's own multi-token prediction layer (DeepSeek-V3,
    GLM-4.5; `model` defaults to the target), reused for every draft."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 0
    prompt_lookup_min: int = 0
    model: str | None = None

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> SpeculativeConfig:
        """vLLM's dict spelling; "[ngram]" and a bare `model` (a draft) are accepted."""
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        unknown = sorted(set(value) - _SPECULATIVE_KEYS)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {unknown}; known: {sorted(_SPECULATIVE_KEYS)}"
            )
        method, model = value.get("method"), value.get("model")
        if method in (None, "[ngram]") and model == "[ngram]":
            method, model = "ngram", None
        if method == "[ngram]":
            method = "ngram"
        if method is None:
            if model is None:
                raise ValueError("speculative_config needs a 'method' or a draft 'model'")
            method = "draft_model"
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs 'num_speculative_tokens'")
        lookup_max, lookup_min = value.get("prompt_lookup_max"), value.get("prompt_lookup_min")
        if method == "ngram":
            # vLLM's defaults: 5 and 5, or the one given for both.
            lookup_max = lookup_max if lookup_max is not None else lookup_min or 5
            lookup_min = lookup_min if lookup_min is not None else lookup_max
        return cls(
            method=method,
            num_speculative_tokens=value["num_speculative_tokens"],
            prompt_lookup_max=lookup_max or 0,
            prompt_lookup_min=lookup_min or 0,
            model=model,
        )

    def __post_init__(self) -> None:
        if self.method in SPECULATIVE_ALIASES:
            object.__setattr__(self, "method", SPECULATIVE_ALIASES[self.method])
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config method must be one of {SPECULATIVE_METHODS}, "
                f"got {self.method!r}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config num_speculative_tokens must be an integer in "
                f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        if self.method == "ngram":
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                n = getattr(self, name)
                if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                    raise ValueError(
                        f"speculative_config {name} must be an integer >= 1, got {n!r}"
                    )
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(
                    f"speculative_config prompt_lookup_min={self.prompt_lookup_min} exceeds "
                    f"prompt_lookup_max={self.prompt_lookup_max}"
                )
            if self.model is not None:
                raise ValueError("speculative_config method 'ngram' takes no 'model'")
        elif self.method == "deepseek_mtp" and self.model is None:
            pass  # the target's own checkpoint
        elif not isinstance(self.model, str) or not self.model:
            raise ValueError(
                f"speculative_config method {self.method!r} needs 'model', a checkpoint path"
            )


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    speculative_config: SpeculativeConfig | None = None
    lora_config: LoRAConfig | None = None  # None: enable_lora off
