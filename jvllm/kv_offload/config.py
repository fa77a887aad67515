"""KVOffloadConfig: vLLM's `kv_transfer_config` for the tiered offloading connector.

Owns parsing and checking the dict vLLM takes (`OffloadingConnector` with the
`TieringOffloadingSpec`: a CPU tier of `cpu_bytes_to_use` bytes and `fs` secondary
tiers) and jvllm's short spelling (`kv_offload_dir` plus `kv_offload_dir_size` GiB).
It sizes nothing and touches no file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

GIB = 1 << 30
CONNECTORS = ("OffloadingConnector", "SocketConnector")
ROLES = ("kv_both",)
TRANSFER_ROLES = ("kv_producer", "kv_consumer")
DEFAULT_KV_PORT = 14579
DEFAULT_BUFFER_BYTES = 1 << 30
SPECS = ("TieringOffloadingSpec",)
DEFAULT_DIR_GIB = 16.0


@dataclass(frozen=True)
class KVOffloadConfig:
    root_dir: str | None  # the fs tier's directory (one sub-directory per model layout)
    max_bytes: int  # LRU bound of that sub-directory's block files (or received blocks)
    cpu_bytes: int | None = None  # the host tier's bytes, when the dict sets them
    kv_role: str = "kv_both"  # or disaggregated prefill's kv_producer / kv_consumer
    kv_ip: str = "127.0.0.1"  # where the consumer listens
    kv_port: int = DEFAULT_KV_PORT


def _fail(what: str, value: Any, accepted: str) -> ValueError:
    return ValueError(f"kv_transfer_config: {what} {value!r} is not supported; {accepted}")


def parse_kv_transfer_config(value: dict[str, Any] | str) -> KVOffloadConfig:
    """The offload config of a vLLM-shaped `kv_transfer_config` (dict or JSON text)."""
    config = json.loads(value) if isinstance(value, str) else dict(value)
    connector = config.get("kv_connector")
    if connector not in CONNECTORS:
        raise _fail("kv_connector", connector, f"accepted: {', '.join(CONNECTORS)}")
    if connector == "SocketConnector":
        return _socket_config(config)
    role = config.get("kv_role", "kv_both")
    if role not in ROLES:
        raise _fail("kv_role", role, f"accepted with {connector}: {', '.join(ROLES)}")
    extra = config.get("kv_connector_extra_config") or {}
    spec = extra.get("spec_name", "TieringOffloadingSpec")
    if spec not in SPECS:
        raise _fail("spec_name", spec, f"accepted: {', '.join(SPECS)}")
    tiers = extra.get("secondary_tiers") or []
    if len(tiers) != 1 or not isinstance(tiers[0], dict) or tiers[0].get("type") != "fs":
        raise _fail("secondary_tiers", tiers, 'accepted: one tier {"type": "fs", "root_dir": PATH}')
    root = tiers[0].get("root_dir")
    if not isinstance(root, str) or not root:
        raise _fail("fs tier root_dir", root, "give a directory path")
    max_bytes = tiers[0].get("max_bytes", int(DEFAULT_DIR_GIB * GIB))
    cpu = extra.get("cpu_bytes_to_use")
    for name, size in (("max_bytes", max_bytes), ("cpu_bytes_to_use", cpu)):
        if size is not None and (not isinstance(size, int | float) or size <= 0):
            raise _fail(name, size, "give a number of bytes > 0")
    return KVOffloadConfig(root, int(max_bytes), None if cpu is None else int(cpu))


def resolve_offload(
    kv_transfer_config: dict[str, Any] | str | None,
    kv_offload_dir: str | None,
    kv_offload_dir_size: float,
) -> KVOffloadConfig | None:
    """The fs tier asked for by either spelling (None: no fs tier)."""
    if kv_transfer_config is not None and kv_offload_dir is not None:
        raise ValueError("give either kv_transfer_config or kv_offload_dir, not both")
    if kv_transfer_config is not None:
        return parse_kv_transfer_config(kv_transfer_config)
    if kv_offload_dir is None:
        return None
    if not kv_offload_dir_size > 0:
        raise ValueError(f"kv_offload_dir_size must be GiB > 0, got {kv_offload_dir_size!r}")
    return KVOffloadConfig(kv_offload_dir, int(kv_offload_dir_size * GIB))


def _socket_config(config: dict[str, Any]) -> KVOffloadConfig:
    """Disaggregated prefill over a local socket: vLLM's kv_role, kv_ip, kv_port and
    kv_buffer_size (the bytes of received blocks a consumer keeps)."""
    role = config.get("kv_role")
    if role not in TRANSFER_ROLES:
        raise _fail("kv_role", role, f"accepted with SocketConnector: {', '.join(TRANSFER_ROLES)}")
    port = config.get("kv_port", DEFAULT_KV_PORT)
    if not isinstance(port, int) or not 0 <= port < 65536:
        raise _fail("kv_port", port, "give a TCP port number")
    size = config.get("kv_buffer_size", DEFAULT_BUFFER_BYTES)
    if not isinstance(size, int | float) or size <= 0:
        raise _fail("kv_buffer_size", size, "give a number of bytes > 0")
    cpu = (config.get("kv_connector_extra_config") or {}).get("cpu_bytes_to_use")
    ip = str(config.get("kv_ip", "127.0.0.1"))
    return KVOffloadConfig(None, int(size), None if cpu is None else int(cpu), role, ip, port)
