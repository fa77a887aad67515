"""Wiring the tier below the host tier into an engine built by `EngineArgs`.

Owns turning the flags (`kv_transfer_config`, or `kv_offload_dir` and its size) into
the host tier's size, the layout fingerprint, the connector (block files; or for
disaggregated prefill a socket sender on the producer, a receiver on the consumer),
its IO threads on the runner side, and the engine's `DiskPrefixTier`. Decides
nothing per step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from jvllm.engine.kv.disk_tier import DiskPrefixTier
from jvllm.kv_offload.config import GIB, KVOffloadConfig, resolve_offload
from jvllm.kv_offload.connector import KVConnectorBase
from jvllm.kv_offload.fs_store import HEADER, FsBlockStore, layout_fingerprint
from jvllm.kv_offload.fs_worker import FsKVWorker
from jvllm.kv_offload.socket_transfer import BlockReceiver, MemoryBlockStore, SocketSender

if TYPE_CHECKING:
    from jvllm.engine.llm_engine import LLMEngine
    from jvllm.engine_args import EngineArgs


def offload_config(args: EngineArgs) -> KVOffloadConfig | None:
    return resolve_offload(args.kv_transfer_config, args.kv_offload_dir, args.kv_offload_dir_size)


def host_tier_gib(args: EngineArgs) -> float:
    """The host tier's GiB per device: `kv_offloading_size`, or the config's
    `cpu_bytes_to_use` (bytes in all, as vLLM counts them) over the devices."""
    config = offload_config(args)
    if args.kv_offloading_size or config is None or config.cpu_bytes is None:
        size = args.kv_offloading_size
    else:
        size = config.cpu_bytes / GIB / (args.tensor_parallel_size * args.pipeline_parallel_size)
    if config is not None and not (size and args.enable_prefix_caching):
        raise ValueError(
            f"kv_role {config.kv_role!r}: the tier sits below the prefix cache's host tier; "
            "set kv_offloading_size (GiB per device) or cpu_bytes_to_use > 0, with prefix "
            "caching on"
        )
    return size


def attach_fs_tier(engine: LLMEngine, runner: Any, args: EngineArgs, dtype: Any) -> None:
    """Puts the tier below the engine's host tier when the flags ask for one: block
    files, or disaggregated prefill's sending (producer) or receiving (consumer) end."""
    config = offload_config(args)
    if config is None:
        return
    kv = engine.scheduler.kv_cache_manager
    if kv.host_tier is None:
        raise ValueError(
            f"kv_role {config.kv_role!r}: the tier sits below the host tier; set "
            "kv_offloading_size (GiB per device) or cpu_bytes_to_use > 0, with prefix caching on"
        )
    axis = 1 if runner.blocks.pp > 1 else 0
    fingerprint = _fingerprint(runner.host_caches, axis, args, dtype)
    present: list[str] = []
    if config.kv_role == "kv_producer":
        store: KVConnectorBase = SocketSender(config.kv_ip, config.kv_port, fingerprint)
    elif config.kv_role == "kv_consumer":
        store = MemoryBlockStore()
    else:
        assert config.root_dir is not None
        store = FsBlockStore(config.root_dir, fingerprint)
        present = store.scan()
    worker = FsKVWorker(store, runner.host_caches, axis, runner.blocks.settle)
    if config.kv_role == "kv_consumer":
        worker.receiver = BlockReceiver(
            config.kv_ip, config.kv_port, fingerprint, worker.block_bytes, store, worker.announce
        )
    max_blocks = config.max_bytes // (worker.block_bytes + HEADER.size)
    kv.disk_tier = DiskPrefixTier(
        fingerprint, max_blocks, present, kv.host_tier, kv.block_pool, config.kv_role, worker.poll
    )
    engine.kv_transfer = worker


def _fingerprint(caches: list, axis: int, args: EngineArgs, dtype: Any) -> bytes:
    """The layout digest of this engine's blocks (`layout_fingerprint`)."""
    layout = [
        [list(a.shape[:axis] + a.shape[axis + 1 :]), str(a.dtype)] for kv in caches for a in kv
    ]
    identity = {
        "model": args.model,
        "dtype": str(dtype),
        "kv_cache_dtype": args.kv_cache_dtype,
        "quantization": args.quantization,
        "block_size": args.block_size,
        "layout": layout,
    }
    return layout_fingerprint(identity)


def flush_fs_tier(engine: LLMEngine) -> None:
    """Waits until every block the engine asked to save is on disk or sent (or dropped):
    a producer's engine steps until its last request's blocks are out."""
    tier = engine.scheduler.kv_cache_manager.disk_tier
    if tier is None or engine.kv_transfer is None:
        return
    while tier.busy:
        engine.step()
        time.sleep(0.001)  # the sends run on their own thread
    tier.complete(engine.kv_transfer.drain())
    engine.kv_transfer.submit(tier.take_ops())  # deletes the bound asked for
    tier.complete(engine.kv_transfer.drain())
