"""Starting and stopping the engine-core processes of one server (vLLM's
`launch_core_engines` and `CoreEngineProcManager`).

Owns the processes: one per local data-parallel rank, started with `spawn` (no jax state
is inherited), each given its slice of the accelerators (`CUDA_VISIBLE_DEVICES`: local
rank r of tensor x pipeline size n gets devices r*n .. r*n+n-1; a CPU ignores it), the
addresses each core connects out to (as vLLM, the front ends bind and the cores connect:
one ipc socket per front end and core in a private directory, or the head's TCP ports
for the cores of a headless host), the cores' word that they serve (`wait_ready`), and
stopping them with SIGTERM then SIGKILL. Not owned: the messages (`messages.py`), the client
(`client.py`), whether to split (`env.py`), the handshake across hosts (`hosts.py`), HTTP.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from jvllm.engine.core.client import process_exit_status
from jvllm.engine.core.core import run_engine_core

logger = logging.getLogger("jvllm.engine_core")

# Seconds a core has to exit after SIGTERM before it is killed.
STOP_TIMEOUT_S = 5.0
# Seconds between checks while waiting for the cores to say they serve.
READY_POLL_S = 0.1


class EngineCoreProcs:
    """The running core processes; `addresses_for(i)` and `pids` are what front end i's
    client needs (it binds those addresses; each core connects to one per front end)."""

    def __init__(
        self,
        engine_args: Any,
        data_parallel_size: int,
        loads_address: str | None = None,
        start_rank: int = 0,
        num_frontends: int = 1,
        frontend_addresses: list[list[str]] | None = None,
    ) -> None:
        """`data_parallel_size` cores here, DP ranks `start_rank` on; `loads_address`: the
        DP coordinator's, where each core pushes its load; `frontend_addresses`: per core,
        the front ends' addresses it connects to (a headless host's cores: the head's TCP
        ports), else ipc sockets here for `num_frontends` front ends."""
        self._dir = tempfile.mkdtemp(prefix="jvllm-core-")
        self.start_rank = start_rank
        self.ranks = ranks = range(start_rank, start_rank + data_parallel_size)
        self.frontend_addresses = frontend_addresses or [
            [f"ipc://{self._dir}/frontend{i}_core{rank}" for i in range(num_frontends)]
            for rank in ranks
        ]
        context = multiprocessing.get_context("spawn")
        per_rank = engine_args.tensor_parallel_size * getattr(
            engine_args, "pipeline_parallel_size", 1
        )
        self.procs = []
        self._ready = []  # per core: the pipe on which it says it serves
        for local_rank, rank in enumerate(ranks):
            devices = _devices(local_rank, per_rank) if data_parallel_size > 1 else ""
            reader, writer = context.Pipe(duplex=False)
            proc = context.Process(
                target=run_engine_core,
                args=(
                    engine_args,
                    rank,
                    self.frontend_addresses[local_rank],
                    devices,
                    loads_address,
                    writer,
                ),
                name=f"EngineCore_DP{rank}",
            )
            proc.start()
            writer.close()  # the core's end; EOF here once it exits
            self.procs.append(proc)
            self._ready.append(reader)
        self.pids = [proc.pid for proc in self.procs]
        logger.info("started %d engine core(s): pids %s", len(self.procs), self.pids)

    def addresses_for(self, frontend: int) -> list[str]:
        """The addresses front end `frontend` binds, one per core, in DP-rank order."""
        return [addresses[frontend] for addresses in self.frontend_addresses]

    def wait_ready(self, failure: Callable[[], str | None]) -> str | None:
        """Until every core has built its engine and connected out; else why not (a core
        exited, or `failure()` gave a reason, asked every READY_POLL_S)."""
        for rank, proc, ready in zip(self.ranks, self.procs, self._ready, strict=True):
            while not ready.poll(READY_POLL_S):  # True also at EOF: the core exited
                reason = failure()
                if reason is not None:
                    return reason
            try:
                ready.recv()
            except EOFError:
                return f"engine core {rank} (pid {proc.pid}) exited while starting"
        return None

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
        for ready in self._ready:
            ready.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _devices(rank: int, per_rank: int) -> str:
    """Rank `rank`'s accelerators, as CUDA_VISIBLE_DEVICES (a slice of the one given)."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = given.split(",") if given else [str(i) for i in range(64)]
    return ",".join(visible[rank * per_rank : (rank + 1) * per_rank])
