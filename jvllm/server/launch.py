"""The `jvllm serve` process: build the engine, wrap it, serve it with uvicorn, exit cleanly.

Owns the process lifecycle. On SIGTERM or SIGINT it drains instead of stopping at
once: new inference requests get 503, in-flight ones run to completion for up to
`shutdown_timeout` seconds (then they are aborted), and the process exits 0. If
the engine loop dies, in-flight requests get an error, /health answers 503 for a
moment so that probes can see it, and the process exits 1. It hands ServerConfig's
TLS and root path to uvicorn, and its CORS policy and stats line to the app. Argument
parsing is `jvllm.cli`'s and `cli_args.py`'s; the routes are `app.py`'s.

Multi-host (`--coordinator-address`, `--num-processes`, `--process-id`): process 0 runs
all of the above and publishes every device program it launches; the other processes
run `run_follower`, which replays them and serves nothing (`jvllm.parallel.step_channel`).
A lost follower fails the leader's requests, turns /health to 503 and exits it with 1;
a lost leader ends the followers with 1; a clean stop of the leader stops them with 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from jvllm.engine.async_llm import GRAMMAR_COMPILE_TIMEOUT_S, AsyncLLM
from jvllm.engine.gc_heap import freeze_gc_heap
from jvllm.engine_args import EngineArgs
from jvllm.generation_config import RequestDefaults
from jvllm.parallel import step_channel

from .app import CORSPolicy, ServerState, build_app
from .chat_template import load_chat_template
from .dev_routes import dev_mode_enabled
from .lora import served_loras
from .lora_args import LoRAModulePath
from .metrics import ServerMetrics
from .protocol import MAX_BODY_BYTES
from .reasoning import get_reasoning_parser
from .serving import ServingContext
from .stats_logger import StatsLogger, stats_interval
from .tool_parsers import ToolParserManager

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
    chat_template: str | None = None  # a file or the template itself
    response_role: str = "assistant"
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    root_path: str = ""
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0  # ssl.CERT_NONE
    log_requests: bool = False
    max_log_len: int | None = None
    grammar_compile_timeout: float = GRAMMAR_COMPILE_TIMEOUT_S
    log_stats: bool = True
    return_tokens_as_token_ids: bool = False
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    tool_parser_plugin: str | None = None  # a file registering more tool parsers
    reasoning_parser: str | None = None
    enable_dev_routes: bool = False  # /sleep, /pause, /update_weights ... (dev_routes.py)
    lora_modules: tuple[LoRAModulePath, ...] = ()  # served by name (--enable-lora)
    allow_runtime_lora_updating: bool | None = None  # None: VLLM_ALLOW_RUNTIME_LORA_UPDATING

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (e.g. hermes)")
        if self.tool_parser_plugin is not None:
            ToolParserManager.import_tool_parser(self.tool_parser_plugin)
        if self.tool_call_parser is not None:
            ToolParserManager.get_tool_parser(self.tool_call_parser)
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)
        if not self.grammar_compile_timeout > 0:
            raise ValueError(
                f"grammar_compile_timeout must be > 0, got {self.grammar_compile_timeout}"
            )
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.max_request_body_bytes < 1024:
            raise ValueError(
                f"max_request_body_bytes must be >= 1024, got {self.max_request_body_bytes}"
            )
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
        for path in (self.ssl_keyfile, self.ssl_certfile, self.ssl_ca_certs):
            if path is not None and not Path(path).is_file():
                raise FileNotFoundError(f"TLS file {path!r} does not exist")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError(f"ssl_cert_reqs must be 0, 1 or 2, got {self.ssl_cert_reqs}")

    @property
    def scheme(self) -> str:
        return "http" if self.ssl_certfile is None else "https"


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
    engine_args: EngineArgs,
    config: ServerConfig,
    model_path: str,
    is_demo: bool = False,
    processes: Any = None,
) -> int:
    """Builds the engine and serves it until shutdown; returns the process exit status.
    By default the engine runs in engine-core processes of its own (`split.py`,
    `processes` its flags); `JVLLM_ENABLE_V1_MULTIPROCESSING=0` keeps it in this one."""
    from .split import run_split_server, split_refusal

    load_chat_template(config.chat_template)  # a bad file fails before any warm-up
    refusal = split_refusal(engine_args, processes)
    if refusal is None:
        return run_split_server(engine_args, config, model_path, is_demo, processes)
    logger.info("the engine runs in the server process: %s", refusal)
    engine = engine_args.create_engine()
    liveness = step_channel.current_liveness()
    publisher = None
    if liveness is not None:  # the multi-host leader
        publisher = step_channel.StepPublisher(step_channel.coordination_client())
        engine.runner.publisher = publisher
    code, async_llm = serve_frontend(
        engine, engine_args, config, model_path, is_demo, _cache_info(engine), liveness
    )
    if liveness is not None and publisher is not None:
        if not liveness.alive():
            # A peer is gone: skip jax.distributed's exit barrier, which would wait for it.
            logger.error("exiting: %s", liveness.lost)
            logging.shutdown()
            os._exit(code)
        liveness.stop()
        publisher.publish(step_channel.STOP)
        publisher.close()
        logger.info("told the %d follower process(es) to stop", len(liveness.peers))
    return code


def serve_frontend(
    engine: Any,
    engine_args: EngineArgs,
    config: ServerConfig,
    model_path: str,
    is_demo: bool,
    cache_info: dict[str, Any],
    liveness: Any = None,
    sockets: list[Any] | None = None,
    on_start: Any = None,
    engine_metrics: Any = None,
) -> tuple[int, AsyncLLM]:
    """Serves `engine` (an `LLMEngine`, or an `EngineCoreClient` of core processes)
    over HTTP until shutdown; the exit status. `on_start(async_llm)` runs before
    serving (the split's core watchdog); `sockets`: listening sockets to serve on;
    `engine_metrics`: what /metrics reads (default: AsyncLLM's snapshot)."""
    chat_template = load_chat_template(config.chat_template)
    defaults = RequestDefaults.load(
        engine_args.generation_config, engine_args.model, engine_args.max_logprobs
    )
    interval = stats_interval()
    names = list(config.served_model_names) or [model_path]
    metrics = ServerMetrics(names[0], engine.max_model_len, cache_config_info=cache_info)
    server: _DrainingServer | None = None

    def on_dead() -> None:
        logger.error("the engine loop died: failing in-flight requests and exiting")
        if server is not None:
            server.exit_after_engine_death()

    async_llm = AsyncLLM(
        engine,
        max_queued_requests=config.max_queued_requests,
        observer=metrics,
        on_dead=on_dead,
        grammar_compile_timeout=config.grammar_compile_timeout,
    )
    metrics.attach(engine_metrics or async_llm.metrics)
    if liveness is not None:
        liveness.on_lost = async_llm.fail
    loras = served_loras(engine, names[0], config.lora_modules, config.allow_runtime_lora_updating)
    ctx = ServingContext(
        async_llm,
        names,
        model_path,
        is_demo,
        config.max_request_body_bytes,
        defaults=defaults,
        chat_template=chat_template,
        response_role=config.response_role,
        log_requests=config.log_requests,
        max_log_len=config.max_log_len,
        return_tokens_as_token_ids=config.return_tokens_as_token_ids,
        tool_call_parser=config.tool_call_parser if config.enable_auto_tool_choice else None,
        reasoning_parser=config.reasoning_parser,
        loras=loras,
    )
    state = ServerState()
    stats = StatsLogger(async_llm.metrics, interval) if config.log_stats else None
    dev = dev_mode_enabled(config.enable_dev_routes)
    app = build_app(ctx, metrics, state, config.api_key, _cors(config), stats, dev_routes=dev)
    uv_config = _uvicorn_config(app, config)
    server = _DrainingServer(uv_config, state, async_llm, config.shutdown_timeout)
    if on_start is not None:
        on_start(async_llm)
    _log_start(config, model_path, names)
    freeze_gc_heap()  # what start-up built stays out of every collection from here on
    server.run(sockets)
    code = 1 if async_llm.is_dead else 0 if server.started else 1
    return code, async_llm


def run_follower(engine_args: EngineArgs) -> int:
    """A multi-host follower: builds the same runner as process 0 and runs every device
    program process 0 publishes, until it publishes stop (0) or is lost (exit 1)."""
    runner = engine_args.create_follower_runner()
    liveness = step_channel.current_liveness()
    assert liveness is not None
    subscriber = step_channel.StepSubscriber(step_channel.coordination_client(), liveness.alive)
    logger.info("process %d: following process 0's steps", liveness.process_id)
    try:
        count = runner.follow(subscriber.receive)
    except step_channel.PeerLost as e:
        logger.error("%s", e)
        step_channel.exit_on_loss(str(e))
    liveness.stop()
    logger.info("process 0 stopped; ran %d of its programs", count)
    return 0


def _log_start(config: ServerConfig, model_path: str, names: list[str]) -> None:
    logger.info(
        "serving %s as %s on %s://%s:%d%s (API key %s)",
        model_path,
        ", ".join(names),
        config.scheme,
        config.host,
        config.port,
        config.root_path,
        "required" if config.api_key else "not required",
    )


def _cors(config: ServerConfig) -> CORSPolicy:
    return CORSPolicy(
        config.allowed_origins,
        config.allowed_methods,
        config.allowed_headers,
        config.allow_credentials,
    )


def _cache_info(engine: Any) -> dict[str, Any]:
    """vllm:cache_config_info's labels: the cache configuration and the usable blocks."""
    info = dataclasses.asdict(engine.config.cache_config)
    return info | {"num_gpu_blocks": engine.get_metrics()["num_total_blocks"]}


def _uvicorn_config(app: ASGIApp, config: ServerConfig) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        root_path=config.root_path,
        log_level=config.uvicorn_log_level,
        access_log=not config.disable_access_log,
        timeout_graceful_shutdown=max(5, int(config.shutdown_timeout)),
        lifespan="on",
        ssl_keyfile=config.ssl_keyfile,
        ssl_certfile=config.ssl_certfile,
        ssl_ca_certs=config.ssl_ca_certs,
        ssl_cert_reqs=config.ssl_cert_reqs,
    )
