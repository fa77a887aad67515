"""`jvllm serve` with the engine in engine-core processes (vLLM V1's layout): the API
server front end(s) here, N data-parallel engine cores beside them.

Owns the process layout and its flags (`--api-server-count`, `--data-parallel-size`
and vLLM's other data-parallel flags), the front end's client of the cores, a watchdog
that declares the engine dead as soon as any core exits (in-flight requests fail with a
503 naming the core, /health answers 503, and the server exits with 1 after
`DEAD_ENGINE_EXIT_DELAY_S`, as the in-process server does; within about 2.5 s of the
death), and the drain on SIGTERM: front ends finish their requests, then the cores
stop, exit 0. With `--api-server-count N > 1` this process only supervises: N front-end
processes listen on one port (SO_REUSEPORT; the kernel spreads connections) and each
talks to every core; with several cores too, it runs the DP coordinator that gives the
front ends one view of the cores' loads. With ranks on other hosts, the head waits for
their headless processes to register and a `--headless` process runs only its cores
(`engine/core/hosts.py`). What a front end serves is `launch.serve_frontend`'s.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import threading
from typing import Any

from jvllm.engine.core.env import (
    MIN_CPUS_FOR_SPLIT,
    multiprocessing_choice,
    takes_images,
    usable_cpus,
)

from .process_args import ProcessConfig

logger = logging.getLogger("jvllm.server")

# Seconds between the watchdog's checks that every engine core is alive.
WATCHDOG_INTERVAL_S = 0.5


def split_refusal(engine_args: Any, processes: ProcessConfig | None) -> str | None:
    """Why this server keeps the engine in its own process (None: it splits)."""
    from jvllm.engine_args import pooling_task

    processes = processes or ProcessConfig()
    dp = processes.data_parallel
    needs_split = processes.api_server_count > 1 or dp.data_parallel_size > 1 or dp.multi_host
    choice, cpus = multiprocessing_choice(), usable_cpus()
    reason = None
    if choice is False:
        reason = "JVLLM_ENABLE_V1_MULTIPROCESSING=0"
    elif engine_args.num_processes not in (None, 1):
        reason = "multi-host serving (--num-processes) runs the engine in process 0"
    elif pooling_task(engine_args) is not None:
        reason = "pooling models are served in-process (no engine-core split for them yet)"
    elif takes_images(engine_args.model):
        reason = "vision-language models are served in-process (images do not cross the split)"
    elif choice is None and not needs_split and cpus < MIN_CPUS_FOR_SPLIT:
        return (
            f"{cpus} usable CPU cores (< {MIN_CPUS_FOR_SPLIT}): the engine stays in-process; "
            "JVLLM_ENABLE_V1_MULTIPROCESSING=1 splits it anyway"
        )
    if reason is not None and needs_split:
        raise ValueError(
            f"--api-server-count, --data-parallel-size and --headless need the split: {reason}"
        )
    return reason


def run_split_server(
    engine_args: Any, config: Any, model_path: str, is_demo: bool, processes: ProcessConfig | None
) -> int:
    """Starts the cores, serves (here, or in N front-end processes), stops the cores."""
    from jvllm.engine.core.coordinator import DPCoordinator
    from jvllm.engine.core.hosts import check_head_ports, head_port, run_headless

    processes = processes or ProcessConfig()
    dp = processes.data_parallel
    if dp.headless:
        return run_headless(engine_args, dp)
    num_cores = dp.data_parallel_size
    # Until uvicorn takes the signals over: SIGTERM while the cores start stops them too.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    # Several API servers balancing over several cores share one view of their loads.
    shared = processes.api_server_count > 1 and num_cores > 1
    remote_loads = None
    if dp.multi_host:  # the remote cores push their loads to the head's last port
        check_head_ports(dp, processes.api_server_count, True, shared)  # before any core
        port = head_port(dp, processes.api_server_count, None)
        remote_loads = f"tcp://{dp.data_parallel_address}:{port}"
    coordinator = DPCoordinator(num_cores, remote_loads) if shared else None
    if coordinator is not None:
        logger.info("DP coordinator: loads published on %s", coordinator.output_address)
    try:
        cores = _start_cores(engine_args, processes, coordinator)
    except BaseException:
        if coordinator is not None:
            coordinator.stop()
        raise
    try:
        if processes.api_server_count == 1:
            return run_frontend(
                engine_args, config, model_path, is_demo, cores.addresses_for(0), cores.pids
            )
        loads = coordinator.output_address if coordinator else None
        return _supervise(engine_args, config, model_path, is_demo, cores, processes, loads)
    finally:
        # A second SIGTERM (an impatient supervisor) must not cut the cores' stop short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        cores.stop()
        if coordinator is not None:
            coordinator.stop()
        logger.info("engine cores stopped")


def _start_cores(engine_args: Any, processes: ProcessConfig, coordinator: Any) -> Any:
    """This host's cores, and those of other hosts once they are ready (`hosts.py`)."""
    from jvllm.engine.core.hosts import AllCores, RemoteCores
    from jvllm.engine.core.launcher import EngineCoreProcs

    dp, api_servers = processes.data_parallel, processes.api_server_count
    loads = coordinator.input_address if coordinator else None
    local = EngineCoreProcs(engine_args, dp.local_size, loads, num_frontends=api_servers)
    if not dp.multi_host:
        return local
    remote = None
    try:
        loads = coordinator.remote_input_address if coordinator else None
        remote = RemoteCores(dp, api_servers, loads)
        remote.wait(local.dead)
    except BaseException:
        if remote is not None:
            remote.stop()
        local.stop()
        raise
    return AllCores(local, remote)


def _exit_on_sigterm(sig: int, frame: Any) -> None:
    raise SystemExit(128 + sig)


def run_frontend(
    engine_args: Any,
    config: Any,
    model_path: str,
    is_demo: bool,
    addresses: list[str],
    pids: list[int],
    reuse_port: bool = False,
    loads_address: str | None = None,
) -> int:
    """One API server front end, bound at `addresses` for the cores (balancing by the DP
    coordinator's table at `loads_address`, if given); its exit status."""
    from jvllm.engine.core.client import EngineCoreClient
    from jvllm.tokenizer_loading import load_tokenizer

    from .launch import serve_frontend

    tokenizer = load_tokenizer(engine_args.tokenizer or engine_args.model)
    client = EngineCoreClient(addresses, pids, tokenizer, loads_address)
    cache_info = client.cache_config | {
        "num_gpu_blocks": client.cores[0].metrics.get("num_total_blocks", 0)
    }
    sockets = [_reuse_port_socket(config.host, config.port)] if reuse_port else None
    stop = threading.Event()

    def watch(async_llm: Any) -> None:
        # No step ahead while paused: a "keep" pause must freeze the requests where they are.
        client.may_prefetch = lambda: not async_llm._scheduling.paused
        threading.Thread(
            target=_watchdog,
            args=(client, async_llm, stop),
            name="jvllm-core-watchdog",
            daemon=True,
        ).start()

    try:
        code, _ = serve_frontend(
            client,
            engine_args,
            config,
            model_path,
            is_demo,
            cache_info,
            None,
            sockets,
            watch,
            client.get_metrics,
        )
    finally:
        stop.set()
        client.close()
    return code


def _watchdog(client: Any, async_llm: Any, stop: threading.Event) -> None:
    """Declares the engine dead once any core has exited (an idle front end would not
    notice otherwise: nothing waits on the core); refreshes an idle front end's copy of
    the engine metrics."""
    from jvllm.engine.async_llm import EngineDeadError

    while not stop.wait(WATCHDOG_INTERVAL_S):
        if not client.has_unfinished_requests() and not async_llm.is_dead:
            with contextlib.suppress(EngineDeadError):
                client.refresh_metrics()
        for core in client.cores:
            status = core.exit_status()
            if status is not None:
                async_llm.fail(f"{core.name} died ({status}); the server cannot serve requests")
                return


def _reuse_port_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def _api_server(
    engine_args: Any,
    config: Any,
    model_path: str,
    is_demo: bool,
    addresses: list[str],
    pids: list[int],
    index: int,
    loads_address: str | None,
) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s ApiServer_{index} %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides
    code = run_frontend(
        engine_args, config, model_path, is_demo, addresses, pids, True, loads_address
    )
    os._exit(code)


def _supervise(
    engine_args: Any,
    config: Any,
    model_path: str,
    is_demo: bool,
    cores: Any,
    processes: ProcessConfig,
    loads_address: str | None,
) -> int:
    """Runs N front ends; SIGTERM or SIGINT drains them all. Exits 0 if every one did,
    else 1 (and stops the others as soon as one ends)."""
    context = multiprocessing.get_context("spawn")
    servers = [
        context.Process(
            target=_api_server,
            args=(
                engine_args,
                config,
                model_path,
                is_demo,
                cores.addresses_for(i),
                cores.pids,
                i,
                loads_address,
            ),
            name=f"ApiServer_{i}",
        )
        for i in range(processes.api_server_count)
    ]
    for server in servers:
        server.start()
    logger.info("started %d API servers: pids %s", len(servers), [s.pid for s in servers])
    stopping = threading.Event()

    def on_signal(sig: int, frame: Any) -> None:
        stopping.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stopping.is_set() and all(s.exitcode is None for s in servers):
            stopping.wait(0.2)
        failed = [s.name for s in servers if s.exitcode not in (None, 0)]
        for server in servers:
            if server.exitcode is None:
                server.terminate()  # a front end's SIGTERM drains it
        for server in servers:
            server.join()
        failed += [s.name for s in servers if s.exitcode != 0 and s.name not in failed]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failed:
        logger.error("API server(s) %s exited with an error", failed)
    return 1 if failed or cores.dead() else 0
