"""The Starlette application: routes, middleware, error rendering and lifespan.

Owns wiring: which path calls which handler, the middleware order (CORS, API key,
then drain/in-flight accounting, then the router), turning every exception into OpenAI's
error envelope (Anthropic's on the Messages routes), and starting and stopping the
engine thread with the app. The handlers themselves live in `serving_*.py`; the process
around it in `launch.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

import jvllm
from jvllm.demo import demo_description
from jvllm.engine.validation import InvalidRequestError, check_token_ids

from .auth import OPEN_PATHS, APIKeyMiddleware, route_path
from .errors import APIError, error_envelope
from .lora import ServedLoRAs, load_lora_adapter, unload_lora_adapter
from .messages_protocol import MESSAGES_PATHS, anthropic_error
from .metrics import CONTENT_TYPE, ServerMetrics
from .openapi import openapi_document
from .protocol import DetokenizeRequest, TokenizeRequest
from .responses import (
    DetokenizeResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionResponse,
)
from .serving import ServingContext, engine_error, now, parse_body
from .serving_chat import create_chat_completion, render_chat
from .serving_completions import create_completion
from .serving_messages import count_message_tokens, create_message
from .serving_pooling import POOLING_ROUTES
from .serving_responses import create_response, retrieve_response
from .stats_logger import StatsLogger

logger = logging.getLogger("jvllm.server")


@dataclass(frozen=True)
class CORSPolicy:
    """Starlette's CORSMiddleware settings (vLLM's `--allowed-*` flags)."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def middleware(self) -> Middleware:
        return Middleware(
            CORSMiddleware,
            allow_origins=list(self.allowed_origins),
            allow_methods=list(self.allowed_methods),
            allow_headers=list(self.allowed_headers),
            allow_credentials=self.allow_credentials,
        )


@dataclass
class ServerState:
    """Shared between the app and the process around it (loop thread only)."""

    draining: bool = False  # SIGTERM received: refuse new work, finish what is running
    in_flight: int = 0  # HTTP requests being served, open paths excluded


class DrainMiddleware:
    """Counts in-flight requests and answers 503 to new ones while draining."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if self.state.draining:
            body = _error_body(scope, 503, "The server is shutting down", code="shutting_down")
            headers = {"Retry-After": "1", "Connection": "close"}
            await JSONResponse(body, status_code=503, headers=headers)(scope, receive, send)
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1


def build_app(
    ctx: ServingContext,
    metrics: ServerMetrics,
    state: ServerState | None = None,
    api_key: str | None = None,
    cors: CORSPolicy | None = None,
    stats: StatsLogger | None = None,
    dev_routes: bool = False,
) -> Starlette:
    state = state or ServerState()
    openapi = openapi_document(auth=api_key is not None)

    def bind(
        handler: Callable[[ServingContext, Request], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            return await handler(ctx, request)

        return endpoint

    def bind_lora(
        handler: Callable[[ServedLoRAs, Request, int], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            assert ctx.loras is not None
            return await handler(ctx.loras, request, ctx.max_body_bytes)

        return endpoint

    async def health(request: Request) -> Response:
        dead = ctx.engine.is_dead
        body = HealthResponse(status="dead" if dead else "ok").model_dump()
        return JSONResponse(body, status_code=503 if dead else 200)

    async def openapi_json(request: Request) -> Response:
        return JSONResponse(openapi)

    async def prometheus(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    async def version(request: Request) -> Response:
        return JSONResponse(VersionResponse(version=jvllm.__version__).model_dump())

    routes = [
        Route("/v1/completions", bind(create_completion), methods=["POST"]),
        Route("/v1/chat/completions", bind(create_chat_completion), methods=["POST"]),
        Route("/v1/responses", bind(create_response), methods=["POST"]),
        Route("/v1/responses/{response_id}", bind(retrieve_response), methods=["GET"]),
        Route("/v1/messages", bind(create_message), methods=["POST"]),
        Route("/v1/messages/count_tokens", bind(count_message_tokens), methods=["POST"]),
        Route("/v1/models", bind(list_models), methods=["GET"]),
        Route("/tokenize", bind(tokenize), methods=["POST"]),
        Route("/detokenize", bind(detokenize), methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/openapi.json", openapi_json, methods=["GET"]),
        *(Route(path, bind(handler), methods=["POST"]) for path, handler in POOLING_ROUTES),
    ]
    if dev_routes:  # VLLM_SERVER_DEV_MODE=1 or --enable-dev-routes: a training job's
        from .dev_routes import dev_routes as training_routes

        routes += training_routes(ctx)
    if ctx.loras is not None and ctx.loras.runtime_updates:
        for path, handler in (
            ("/v1/load_lora_adapter", load_lora_adapter),
            ("/v1/unload_lora_adapter", unload_lora_adapter),
        ):
            routes.append(Route(path, bind_lora(handler), methods=["POST"]))
    middleware = [Middleware(DrainMiddleware, state=state)]
    if api_key is not None:
        middleware.insert(0, Middleware(APIKeyMiddleware, api_key=api_key))
    # Outermost: a browser's preflight carries no API key and must still be answered.
    middleware.insert(0, (cors or CORSPolicy()).middleware())

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        ctx.engine.start()
        stats_task = asyncio.ensure_future(stats.run()) if stats is not None else None
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            await ctx.engine.shutdown()

    return Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            Exception: _internal_error,
        },
        lifespan=lifespan,
    )


async def list_models(ctx: ServingContext, request: Request) -> Response:
    cards = [
        ModelCard(
            id=name,
            created=now(),
            owned_by="jvllm-demo" if ctx.is_demo else "jvllm",
            root=ctx.model_path,
            max_model_len=ctx.engine.max_model_len,
            description=demo_description() if ctx.is_demo else None,
        )
        for name in ctx.served_model_names
    ]
    for lora in ctx.loras.requests() if ctx.loras is not None else ():
        cards.append(
            ModelCard(
                id=lora.lora_name,
                created=now(),
                owned_by="jvllm",
                root=lora.lora_path,
                parent=lora.base_model_name,
                max_model_len=ctx.engine.max_model_len,
            )
        )
    return JSONResponse(ModelList(data=cards).model_dump())


async def tokenize(ctx: ServingContext, request: Request) -> Response:
    req = await parse_body(request, TokenizeRequest, ctx.max_body_bytes)
    ctx.model_name(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    if req.messages is not None:
        tokens = render_chat(ctx, req.messages, req.add_generation_prompt).token_ids
    else:
        tokens = list(ctx.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
    limit = ctx.engine.max_model_len
    body = TokenizeResponse(count=len(tokens), max_model_len=limit, tokens=tokens)
    return JSONResponse(body.model_dump())


async def detokenize(ctx: ServingContext, request: Request) -> Response:
    req = await parse_body(request, DetokenizeRequest, ctx.max_body_bytes)
    ctx.model_name(req.model)
    try:
        check_token_ids(req.tokens, ctx.engine.vocab_size, "tokens")
    except InvalidRequestError as e:
        raise engine_error(e) from None
    return JSONResponse(DetokenizeResponse(prompt=ctx.tokenizer.decode(req.tokens)).model_dump())


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


def _error_body(scope: Scope, status: int, message: str, code: str | None = None) -> dict:
    """OpenAI's error envelope, or Anthropic's on the Messages routes."""
    if route_path(scope) in MESSAGES_PATHS:
        return anthropic_error(status, message)
    return error_envelope(status, message, code=code)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    body = _error_body(request.scope, exc.status_code, str(exc.detail))
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.error("unhandled error on %s", request.url.path, exc_info=exc)
    body = _error_body(request.scope, 500, "Internal server error", code="internal_error")
    return JSONResponse(body, status_code=500)
