"""The process-layout flags of `jvllm serve` (vLLM's spellings): `--api-server-count`
and the data-parallel ones, and the ProcessConfig they make. Imports nothing heavy
(`--help` works without the serve extras); `split.py` acts on them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

# vLLM's default `--data-parallel-rpc-port` (the head's handshake port).
DEFAULT_DP_RPC_PORT = 29550


@dataclass(frozen=True)
class DataParallelConfig:
    """vLLM's data-parallel flags. Ranks start_rank .. start_rank + size_local - 1 run on
    this host; with size_local < size the others run on other hosts (`--headless`
    processes that register with the head at address:rpc_port, `engine/core/hosts.py`)."""

    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int | None = None
    data_parallel_start_rank: int | None = None
    headless: bool = False

    def __post_init__(self) -> None:
        size, local = self.data_parallel_size, self.local_size
        if size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {size}")
        if not 0 <= local <= size or (self.headless and local == 0):
            lowest = 1 if self.headless else 0
            raise ValueError(
                f"data_parallel_size_local={local} must be in [{lowest}, data_parallel_size={size}]"
            )
        start = self.start_rank
        if not self.headless and start != 0:
            raise ValueError(
                f"data_parallel_start_rank={start}: the head (no --headless) runs ranks 0 .. "
                "data_parallel_size_local - 1; --data-parallel-start-rank is for --headless"
            )
        if not 0 <= start <= size - local:
            raise ValueError(
                f"data_parallel_start_rank={start} out of range: with data_parallel_size="
                f"{size} and data_parallel_size_local={local} it must be in [0, {size - local}]"
            )
        if self.multi_host and not self.data_parallel_address:
            who = "--headless" if self.headless else "data_parallel_size_local < size"
            raise ValueError(
                f"{who} needs --data-parallel-address (the head's IP, where the headless "
                "engine cores register)"
            )
        port = self.rpc_port
        if not 1 <= port <= 65535:
            raise ValueError(f"data_parallel_rpc_port must be in [1, 65535], got {port}")

    @property
    def local_size(self) -> int:
        local = self.data_parallel_size_local
        return self.data_parallel_size if local is None else local

    @property
    def start_rank(self) -> int:
        return self.data_parallel_start_rank or 0

    @property
    def rpc_port(self) -> int:
        port = self.data_parallel_rpc_port
        return DEFAULT_DP_RPC_PORT if port is None else port

    @property
    def multi_host(self) -> bool:
        """Ranks on other hosts: this is a head waiting for them, or a headless process."""
        return self.headless or self.local_size < self.data_parallel_size

    @property
    def handshake_address(self) -> str:
        return f"tcp://{self.data_parallel_address}:{self.rpc_port}"


@dataclass(frozen=True)
class ProcessConfig:
    """The process layout: API server front ends and data-parallel engine cores."""

    api_server_count: int = 1
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig)

    def __post_init__(self) -> None:
        if self.api_server_count < 1:
            raise ValueError(f"api_server_count must be >= 1, got {self.api_server_count}")
        if self.data_parallel.headless and self.api_server_count != 1:
            raise ValueError(
                f"api_server_count={self.api_server_count} with --headless: a headless "
                "process runs engine cores only (no API server)"
            )


def add_process_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("processes (vLLM's flags)")
    group.add_argument(
        "--api-server-count", type=int, default=1, help="API server processes on the one port"
    )
    group.add_argument(
        "--data-parallel-size", "-dp", type=int, default=1, help="engine cores (replicas)"
    )
    group.add_argument(
        "--data-parallel-size-local", "-dpl", type=int, default=None, help="DP ranks on this host"
    )
    group.add_argument(
        "--data-parallel-address", "-dpa", default=None, help="the DP head's address"
    )
    group.add_argument(
        "--data-parallel-rpc-port", "-dpp", type=int, default=None, help="the DP head's port"
    )
    group.add_argument(
        "--data-parallel-start-rank", "-dpr", type=int, default=None,
        help="first DP rank on this host (with --headless)",
    )  # fmt: skip
    group.add_argument(
        "--headless", action="store_true",
        help="engine cores only (no API server): they register with the head at "
        "--data-parallel-address:--data-parallel-rpc-port",
    )  # fmt: skip


def process_config(args: argparse.Namespace) -> ProcessConfig:
    """The flags' ProcessConfig; ValueError naming a bad value."""
    dp = DataParallelConfig(
        args.data_parallel_size,
        args.data_parallel_size_local,
        args.data_parallel_address,
        args.data_parallel_rpc_port,
        getattr(args, "data_parallel_start_rank", None),
        getattr(args, "headless", False),
    )
    return ProcessConfig(args.api_server_count, dp)
