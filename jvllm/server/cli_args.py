"""The server's flags of `jvllm serve` (vLLM's "Frontend" group) and the ServerConfig
they make.

Owns the spellings (vLLM's, so a launch script carries over) and their parsing;
what each one does is `launch.py`'s and `app.py`'s. Imports nothing heavy, so that
`jvllm serve --help` works without the serve extras.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import TYPE_CHECKING

from jvllm.engine.async_llm import GRAMMAR_COMPILE_TIMEOUT_S

from .lora_args import add_lora_flags
from .process_args import add_process_flags

if TYPE_CHECKING:
    from .launch import ServerConfig

_BOOL = argparse.BooleanOptionalAction
UVICORN_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


def _names(value: str) -> list[str]:
    """One CORS value: a JSON list (vLLM's older spelling) or one plain entry."""
    if value.startswith("["):
        items = json.loads(value)
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value}")
        return items
    return [value]


def add_frontend_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Frontend", "the OpenAI-compatible HTTP server")
    add = group.add_argument
    add("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    add("--port", type=int, default=8000, help="port (default: %(default)s)")
    add(
        "--api-key",
        default=os.environ.get("JVLLM_API_KEY"),
        help="require `Authorization: Bearer KEY` on inference routes (env: JVLLM_API_KEY)",
    )
    add(
        "--chat-template",
        help="a Jinja chat template, or a file holding one (default: the tokenizer's)",
    )
    add(
        "--response-role", default="assistant", help="role of chat responses (default: %(default)s)"
    )
    for flag, what in (("origins", "origins"), ("methods", "methods"), ("headers", "headers")):
        add(
            f"--allowed-{flag}",
            type=_names,
            nargs="+",
            default=None,
            help=f"CORS: allowed {what}, as values or one JSON list (default: all)",
        )
    add("--allow-credentials", action=_BOOL, default=False, help="CORS: allow credentials")
    add("--root-path", default=None, help="path prefix a reverse proxy serves the API under")
    add("--ssl-keyfile", help="TLS private key (PEM); with --ssl-certfile, serve HTTPS")
    add("--ssl-certfile", help="TLS certificate chain (PEM)")
    add("--ssl-ca-certs", help="CA certificates for verifying client certificates")
    add(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        help="client certificates: 0 none, 1 optional, 2 required (Python's ssl.CERT_*)",
    )
    add(
        "--enable-log-requests",
        action=_BOOL,
        default=False,
        help="log each request's prompt and sampling parameters",
    )
    add(
        "--disable-log-requests",
        action=_BOOL,
        default=None,
        help="do not log requests (the default; vLLM's older spelling)",
    )
    add(
        "--max-log-len",
        type=int,
        default=None,
        help="characters and token ids of a prompt that a request log line shows (default: all)",
    )
    add(
        "--grammar-compile-timeout",
        type=float,
        default=GRAMMAR_COMPILE_TIMEOUT_S,
        help="seconds a request's structured_outputs or response_format may take to compile "
        "before it is refused with a 400 (default: %(default)s)",
    )
    add(
        "--enable-auto-tool-choice",
        action=_BOOL,
        default=False,
        help='serve tool_choice "auto", parsing calls from the output (needs --tool-call-parser)',
    )
    add(
        "--tool-call-parser",
        default=None,
        help="how calls are read from free output: hermes, llama3_json, mistral, pythonic, "
        "qwen3_coder, or a name --tool-parser-plugin registers",
    )
    add("--tool-parser-plugin", default=None, help="a Python file that registers tool parsers")
    add(
        "--reasoning-parser",
        default=None,
        help="move a reasoning model's thinking into reasoning_content: deepseek_r1, qwen3",
    )
    add("--disable-log-stats", action=_BOOL, default=False, help="no periodic stats line")
    add(
        "--return-tokens-as-token-ids",
        action=_BOOL,
        default=False,
        help="logprob tokens as 'token_id:N' (for tokens that are not valid UTF-8 alone)",
    )
    add(
        "--uvicorn-log-level",
        default="info",
        choices=UVICORN_LOG_LEVELS,
        help="uvicorn's log level (default: %(default)s)",
    )
    add(
        "--disable-uvicorn-access-log",
        "--disable-access-log",
        dest="disable_access_log",
        action=_BOOL,
        default=False,
        help="do not log each HTTP request",
    )
    add(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="requests that may wait for a slot before new ones get 503 (default: %(default)s)",
    )
    add(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM (default: %(default)s)",
    )
    add(
        "--enable-dev-routes",
        action=_BOOL,
        default=False,
        help="serve /sleep, /wake_up, /pause, /resume, /update_weights and the other routes "
        "of a training job (as VLLM_SERVER_DEV_MODE=1 does)",
    )
    add(
        "--max-request-body-bytes",
        type=int,
        default=None,
        help="largest accepted request body; larger ones get 413 (default: 4 MiB)",
    )
    add_lora_flags(parser)
    add_process_flags(parser)


def _flat(values: list[list[str]] | None) -> tuple[str, ...]:
    return ("*",) if values is None else tuple(v for group in values for v in group)


def server_config(args: argparse.Namespace, names: tuple[str, ...]) -> ServerConfig:
    from .launch import ServerConfig

    optional = {}
    if args.max_request_body_bytes is not None:
        optional["max_request_body_bytes"] = args.max_request_body_bytes
    return ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        served_model_names=names,
        max_queued_requests=args.max_queued_requests,
        shutdown_timeout=args.shutdown_timeout,
        uvicorn_log_level=args.uvicorn_log_level,
        disable_access_log=args.disable_access_log,
        chat_template=args.chat_template,
        response_role=args.response_role,
        allowed_origins=_flat(args.allowed_origins),
        allowed_methods=_flat(args.allowed_methods),
        allowed_headers=_flat(args.allowed_headers),
        allow_credentials=args.allow_credentials,
        root_path=args.root_path or "",
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        log_requests=args.enable_log_requests and not args.disable_log_requests,
        max_log_len=args.max_log_len,
        grammar_compile_timeout=args.grammar_compile_timeout,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        tool_parser_plugin=args.tool_parser_plugin,
        reasoning_parser=args.reasoning_parser,
        log_stats=not args.disable_log_stats,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        enable_dev_routes=args.enable_dev_routes,
        lora_modules=tuple(args.lora_modules or ()),
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        **optional,
    )
