"""Engine configuration: frozen dataclasses validated on construction.

Owns the knobs and their checks. Values derived from a checkpoint (the model's
shapes) live in `jvllm.models.spec.ModelSpec`, not here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULING_POLICIES = ("continuous", "static")
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
    scheduling_policy: str = "continuous"
    # Schedule step N + 1 while step N runs (vLLM's async scheduling); False waits for
    # each step before scheduling the next.
    async_scheduling: bool = True
    # What a preempted request loses: "recompute" drops its KV blocks, "swap" copies its
    # blocks to host memory (CacheConfig.swap_space) and back, recomputing only when
    # the host pool is full.
    preemption_mode: str = "recompute"

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

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
