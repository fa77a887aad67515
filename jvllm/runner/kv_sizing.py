"""The KV cache sized on this process's GPU at start-up, by vLLM's rule.

Owns reading device 0's memory statistics (after the weights are loaded), measuring the
step reserve from the compiled programs (`aot.measure_step_reserve`), applying the rule
(`memory.gpu_budget`, with the device total and allocator cap `xla_allocator` reads from
the statistics) and the one start-up line that reports it. Not owned: the override and
the CPU budget (`EngineArgs`), the arithmetic (`memory`), the allocator's settings.
"""

from __future__ import annotations

import logging
from typing import Any

import jax

from jvllm.config import CacheConfig, SchedulerConfig
from jvllm.models.loader import LoadedModel
from jvllm.runner import memory, xla_allocator
from jvllm.runner.aot import measure_step_reserve

logger = logging.getLogger("jvllm")


def device_kv_blocks(
    loaded: LoadedModel,
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    mesh: Any,
    block_bytes: int,
    pipeline_stages: int = 1,
    draft: LoadedModel | None = None,
    lookahead: int = 0,
) -> int | None:
    """KV blocks (the null block among them) for `block_bytes` blocks on the engine's
    first device, or None where it reports no memory statistics (CPU devices). What is
    allocated there already (a training state beside the engine) counts as in use."""
    # The engine's first device of this process: the caller's (LLM(mesh=...)) may not be
    # device 0, and on several processes the mesh's first may be another process's.
    local = jax.process_index()
    mine = [] if mesh is None else [d for d in mesh.devices.flat if d.process_index == local]
    device = mine[0] if mine else jax.local_devices()[0]
    if "bytes_limit" not in (device.memory_stats() or {}):
        if device.platform != "cpu":
            logger.warning(
                "%s reports no memory statistics (XLA_PYTHON_CLIENT_ALLOCATOR=platform?): "
                "the KV cache takes cpu_kv_cache_bytes; set num_gpu_blocks_override",
                device.device_kind,
            )
        return None
    if pipeline_stages > 1 or loaded.num_offloaded_layers:  # programs not measured here
        reserve = memory.activation_reserve(
            scheduler.max_num_batched_tokens, loaded.spec.vocab_size
        )
        how = "estimated"
    else:
        reserve, _ = measure_step_reserve(
            loaded, device, cache, scheduler, mesh, num_lookahead_tokens=lookahead, draft=draft
        )
        how = "measured"
    stats = device.memory_stats()  # after the measurement, whose arrays are gone
    total, cap = xla_allocator.device_limits(stats)
    in_use = int(stats.get("bytes_in_use", 0))
    budget = memory.gpu_budget(total, in_use, cache.gpu_memory_utilization, reserve, cap)
    size = memory.kv_cache_size(
        budget.kv_bytes,
        block_bytes,
        cache.block_size,
        scheduler.max_num_seqs,
        scheduler.max_model_len,
    )
    models = [loaded] + ([draft] if draft is not None else [])
    weights = sum(m.bytes_per_device().get(device, 0) for m in models)
    logger.info("%s", memory.startup_line(budget, weights, size, how))
    return size.num_blocks
