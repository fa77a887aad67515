"""The process-layout flags of `jvllm serve` (vLLM's spellings): `--api-server-count`
and the data-parallel ones, and the ProcessConfig they make. Imports nothing heavy
(`--help` works without the serve extras); `split.py` acts on them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DataParallelConfig:
    """vLLM's data-parallel flags; every rank on this host (multi-host DP is refused)."""

    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int | None = None

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        local = self.data_parallel_size_local
        if local is not None and local != self.data_parallel_size:
            raise ValueError(
                f"data_parallel_size_local={local} with data_parallel_size="
                f"{self.data_parallel_size}: data parallelism across hosts is not supported; "
                "run every rank on this host (data_parallel_size_local = data_parallel_size)"
            )


@dataclass(frozen=True)
class ProcessConfig:
    """The process layout: API server front ends and data-parallel engine cores."""

    api_server_count: int = 1
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig)

    def __post_init__(self) -> None:
        if self.api_server_count < 1:
            raise ValueError(f"api_server_count must be >= 1, got {self.api_server_count}")


def add_process_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("processes (vLLM's flags)")
    group.add_argument(
        "--api-server-count", type=int, default=1, help="API server processes on the one port"
    )
    group.add_argument(
        "--data-parallel-size", "-dp", type=int, default=1, help="engine cores (replicas)"
    )
    group.add_argument(
        "--data-parallel-size-local", type=int, default=None, help="DP ranks on this host"
    )
    group.add_argument("--data-parallel-address", default=None, help="DP coordinator address")
    group.add_argument("--data-parallel-rpc-port", type=int, default=None, help="DP RPC port")


def process_config(args: argparse.Namespace) -> ProcessConfig:
    """The flags' ProcessConfig; ValueError naming a bad value."""
    dp = DataParallelConfig(
        args.data_parallel_size,
        args.data_parallel_size_local,
        args.data_parallel_address,
        args.data_parallel_rpc_port,
    )
    return ProcessConfig(args.api_server_count, dp)
