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
CONNECTORS = ("OffloadingConnector",)
ROLES = ("kv_both",)
SPECS = ("TieringOffloadingSpec",)
DEFAULT_DIR_GIB = 16.0


@dataclass(frozen=True)
class KVOffloadConfig:
    root_dir: str  # the fs tier's directory (one sub-directory per model layout)
    max_bytes: int  # LRU bound of that sub-directory's block files
    cpu_bytes: int | None = None  # the host tier's bytes, when the dict sets them


def _fail(what: str, value: Any, accepted: str) -> ValueError:
    return ValueError(f"kv_transfer_config: {what} {value!r} is not supported; {accepted}")


def parse_kv_transfer_config(value: dict[str, Any] | str) -> KVOffloadConfig:
    """The offload config of a vLLM-shaped `kv_transfer_config` (dict or JSON text)."""
    config = json.loads(value) if isinstance(value, str) else dict(value)
    connector = config.get("kv_connector")
    if connector not in CONNECTORS:
        raise _fail("kv_connector", connector, f"accepted: {', '.join(CONNECTORS)}")
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
