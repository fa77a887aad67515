"""Multi-host start-up through `jax.distributed`.

The offline API runs multi-host as SPMD with identical deterministic schedulers:
every process runs the same program on the same requests (same seeds), so each
builds the same step inputs on its own and no step data crosses hosts except the
collectives inside the jitted step. `jvllm serve` instead schedules on process 0
alone, which publishes each step's inputs to the others through the coordinator's
key-value store (`jvllm.parallel.step_channel`). Either way every process checks at
start-up that all were started with the same model and flags.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax

ENV_COORDINATOR = "JVLLM_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JVLLM_NUM_PROCESSES"
ENV_PROCESS_ID = "JVLLM_PROCESS_ID"


@dataclass(frozen=True)
class DistributedConfig:
    coordinator_address: str
    num_processes: int
    process_id: int

    def __post_init__(self) -> None:
        if self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(
                f"process_id must be in [0, {self.num_processes}), got {self.process_id}"
            )


def distributed_config(
    coordinator_address: str | None, num_processes: int | None, process_id: int | None
) -> DistributedConfig | None:
    """From arguments, else JVLLM_* environment variables; None for a single process."""
    address = coordinator_address or os.environ.get(ENV_COORDINATOR)
    if not address:
        return None
    try:
        count = num_processes if num_processes is not None else int(os.environ[ENV_NUM_PROCESSES])
        rank = process_id if process_id is not None else int(os.environ[ENV_PROCESS_ID])
    except KeyError as e:
        raise ValueError(
            f"a coordinator address needs num_processes and process_id too (or {e.args[0]})"
        ) from None
    return DistributedConfig(address, count, rank)


_initialized: DistributedConfig | None = None


def initialize(config: DistributedConfig) -> None:
    """Joins the process group once; must run before any other jax call touches a device."""
    global _initialized
    if _initialized is not None:
        if _initialized != config:
            raise ValueError(f"jax.distributed already initialised as {_initialized}")
        return
    # CPU devices of different processes talk through gloo (GPUs use NCCL regardless).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(config.coordinator_address, config.num_processes, config.process_id)
    _initialized = config
