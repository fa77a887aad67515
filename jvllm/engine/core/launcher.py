"""Starting and stopping the engine-core processes of one server (vLLM's
`launch_core_engines` and `CoreEngineProcManager`).

Owns the processes: one per local data-parallel rank, started with `spawn` (no jax state
is inherited), each given its slice of the accelerators (`CUDA_VISIBLE_DEVICES`: local
rank r of tensor x pipeline size n gets devices r*n .. r*n+n-1; a CPU ignores it), its
ipc socket in a private directory (or a TCP port, for a head on another host), and
stopped with SIGTERM then SIGKILL. Not owned: the messages (`messages.py`), the client
(`client.py`), whether to split (`env.py`), the handshake across hosts (`hosts.py`), HTTP.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import socket
import tempfile
from typing import Any

from jvllm.engine.core.client import process_exit_status
from jvllm.engine.core.core import run_engine_core

logger = logging.getLogger("jvllm.engine_core")

# Seconds a core has to exit after SIGTERM before it is killed.
STOP_TIMEOUT_S = 5.0


class EngineCoreProcs:
    """The running core processes; `addresses` and `pids` are what a client needs."""

    def __init__(
        self,
        engine_args: Any,
        data_parallel_size: int,
        loads_address: str | None = None,
        start_rank: int = 0,
        tcp_host: str | None = None,
    ) -> None:
        """`data_parallel_size` cores here, DP ranks `start_rank` on; `loads_address`: the
        DP coordinator's, where each core pushes its load; `tcp_host`: serve on TCP ports
        of this address (cores that a head on another host reaches), else on ipc."""
        self._dir = tempfile.mkdtemp(prefix="jvllm-core-")
        self.start_rank = start_rank
        self.addresses = [
            f"tcp://{tcp_host}:{_free_port(tcp_host)}" if tcp_host else f"ipc://{self._dir}/core{i}"
            for i in range(data_parallel_size)
        ]
        context = multiprocessing.get_context("spawn")
        per_rank = engine_args.tensor_parallel_size * getattr(
            engine_args, "pipeline_parallel_size", 1
        )
        self.procs = []
        for local_rank, address in enumerate(self.addresses):
            rank = start_rank + local_rank
            devices = _devices(local_rank, per_rank) if data_parallel_size > 1 else ""
            proc = context.Process(
                target=run_engine_core,
                args=(engine_args, rank, address, devices, loads_address),
                name=f"EngineCore_DP{rank}",
            )
            proc.start()
            self.procs.append(proc)
        self.pids = [proc.pid for proc in self.procs]
        logger.info("started %d engine core(s): pids %s", len(self.procs), self.pids)

    def dead(self) -> list[str]:
        """The cores that have exited, each named."""
        return [
            f"engine core {self.start_rank + i} (pid {p.pid})"
            for i, p in enumerate(self.procs)
            if process_exit_status(p.pid) is not None
        ]

    def stop(self) -> None:
        """SIGTERM every core, SIGKILL what is left after STOP_TIMEOUT_S; remove the sockets."""
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(STOP_TIMEOUT_S)
            if proc.is_alive():
                logger.warning("engine core %s did not stop: killing it", proc.name)
                proc.kill()
                proc.join()
        shutil.rmtree(self._dir, ignore_errors=True)


def _free_port(host: str) -> int:
    """A TCP port free on `host` now (the core binds it a moment later)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _devices(rank: int, per_rank: int) -> str:
    """Rank `rank`'s accelerators, as CUDA_VISIBLE_DEVICES (a slice of the one given)."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = given.split(",") if given else [str(i) for i in range(64)]
    return ",".join(visible[rank * per_rank : (rank + 1) * per_rank])
