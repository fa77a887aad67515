"""The `jvllm serve` process: build the engine, wrap it, serve it with uvicorn, exit cleanly.

Owns the process lifecycle. On SIGTERM or SIGINT it drains instead of stopping at
once: new inference requests get 503, in-flight ones run to completion for up to
`shutdown_timeout` seconds (then they are aborted), and the process exits 0. If
the engine loop dies, in-flight requests get an error, /health answers 503 for a
moment so that probes can see it, and the process exits 1. Argument parsing is
`jvllm.cli`'s; the routes are `app.py`'s.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from types import FrameType

import uvicorn

from jvllm.engine.async_llm import AsyncLLM
from jvllm.engine_args import EngineArgs

from .app import ServerState, build_app
from .metrics import ServerMetrics
from .protocol import MAX_BODY_BYTES
from .serving import ServingContext

logger = logging.getLogger("jvllm.server")

# Seconds /health keeps answering 503 after the engine died, before the process exits.
DEAD_ENGINE_EXIT_DELAY_S = 2.0
# Seconds left for responses to flush after aborting requests at the drain deadline.
ABORT_FLUSH_S = 1.0


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_names: tuple[str, ...] = ()
    max_queued_requests: int | None = 1024
    shutdown_timeout: float = 30.0
    max_request_body_bytes: int = MAX_BODY_BYTES
    uvicorn_log_level: str = "info"
    disable_access_log: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.max_request_body_bytes < 1024:
            raise ValueError(
                f"max_request_body_bytes must be >= 1024, got {self.max_request_body_bytes}"
            )


class _DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains before exiting (with status 0)."""

    def __init__(
        self, config: uvicorn.Config, state: ServerState, engine: AsyncLLM, timeout: float
    ) -> None:
        super().__init__(config)
        self.state, self.engine, self.timeout = state, engine, timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets=None) -> None:  # type: ignore[no-untyped-def]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in uvicorn's captured signals: it would re-raise them on exit,
        # and the default SIGTERM action would turn a clean drain into status -15.
        if self.state.draining or self._loop is None:
            logger.warning("second %s: exiting without waiting", signal.Signals(sig).name)
            self.should_exit = self.force_exit = True
            return
        self.state.draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        logger.info(
            "shutting down: refusing new requests, waiting up to %.0f s for %d in flight "
            "(signal again to exit at once)",
            self.timeout,
            self.state.in_flight,
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while self.state.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.state.in_flight:
            logger.warning("shutdown timeout: aborting %d requests", self.state.in_flight)
            self.engine.abort_all("the server is shutting down")
            await asyncio.sleep(ABORT_FLUSH_S)
        self.should_exit = True

    def exit_after_engine_death(self) -> None:
        assert self._loop is not None
        self._loop.call_later(DEAD_ENGINE_EXIT_DELAY_S, setattr, self, "should_exit", True)


def run_server(
    engine_args: EngineArgs, config: ServerConfig, model_path: str, is_demo: bool = False
) -> int:
    """Builds the engine and serves it until shutdown; returns the process exit status."""
    engine = engine_args.create_engine()
    metrics = ServerMetrics()
    server: _DrainingServer | None = None

    def on_dead() -> None:
        logger.error("the engine loop died: failing in-flight requests and exiting")
        if server is not None:
            server.exit_after_engine_death()

    async_llm = AsyncLLM(
        engine, max_queued_requests=config.max_queued_requests, observer=metrics, on_dead=on_dead
    )
    metrics.attach(async_llm.metrics)
    names = list(config.served_model_names) or [model_path]
    ctx = ServingContext(async_llm, names, model_path, is_demo, config.max_request_body_bytes)
    state = ServerState()
    app = build_app(ctx, metrics, state, config.api_key)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.uvicorn_log_level,
        access_log=not config.disable_access_log,
        timeout_graceful_shutdown=max(5, int(config.shutdown_timeout)),
        lifespan="on",
    )
    server = _DrainingServer(uv_config, state, async_llm, config.shutdown_timeout)
    logger.info(
        "serving %s as %s on http://%s:%d (API key %s)",
        model_path,
        ", ".join(names),
        config.host,
        config.port,
        "required" if config.api_key else "not required",
    )
    server.run()
    if async_llm.is_dead:
        return 1
    return 0 if server.started else 1
