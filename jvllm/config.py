"""Engine configuration: frozen dataclasses validated on construction.

Owns the knobs and their checks. Values derived from a checkpoint (the model's
shapes) live in `jvllm.models.spec.ModelSpec`, not here.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def __post_init__(self) -> None:
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
