"""GET /openapi.json: an OpenAPI 3.1 document built from the pydantic models.

Owns the list of documented routes and their request and response schemas. The
schemas come from the same classes that validate requests and build responses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

import jvllm

from . import messages_protocol as mp
from . import protocol as rq
from . import responses as rs
from . import responses_protocol as rp


@dataclass(frozen=True)
class RouteDoc:
    path: str
    method: str
    summary: str
    request: type[BaseModel] | None
    response: type[BaseModel] | None
    streams: bool = False
    open: bool = False  # needs no API key
    anthropic: bool = False  # errors in Anthropic's shape


ROUTES = (
    RouteDoc("/v1/completions", "post", "Text completions", rq.CompletionRequest,
             rs.CompletionResponse, streams=True),
    RouteDoc("/v1/chat/completions", "post", "Chat completions", rq.ChatCompletionRequest,
             rs.ChatCompletionResponse, streams=True),
    RouteDoc("/v1/responses", "post", "OpenAI Responses API", rp.ResponsesRequest,
             rp.ResponseObject, streams=True),
    RouteDoc("/v1/messages", "post", "Anthropic Messages API", mp.MessagesRequest,
             mp.MessageResponse, streams=True, anthropic=True),
    RouteDoc("/v1/messages/count_tokens", "post", "Anthropic: a prompt's token count",
             mp.CountTokensRequest, mp.CountTokensResponse, anthropic=True),
    RouteDoc("/v1/models", "get", "Served models", None, rs.ModelList),
    RouteDoc("/tokenize", "post", "Prompt or messages to token ids", rq.TokenizeRequest,
             rs.TokenizeResponse),
    RouteDoc("/detokenize", "post", "Token ids to text", rq.DetokenizeRequest,
             rs.DetokenizeResponse),
    RouteDoc("/health", "get", "200 while the engine lives, 503 once it is dead", None,
             rs.HealthResponse, open=True),
    RouteDoc("/version", "get", "Server version", None, rs.VersionResponse, open=True),
    RouteDoc("/metrics", "get", "Prometheus metrics (text format)", None, None, open=True),
)  # fmt: skip


def openapi_document(auth: bool) -> dict[str, Any]:
    models = {r.request for r in ROUTES if r.request} | {r.response for r in ROUTES if r.response}
    models |= {rs.ErrorResponse, rs.ChatCompletionChunk, mp.AnthropicErrorResponse}
    keyed = [(m, "validation" if m in _requests() else "serialization") for m in models]
    refs, defs = models_json_schema(
        sorted(keyed, key=lambda k: k[0].__name__), ref_template="#/components/schemas/{model}"
    )
    paths: dict[str, Any] = {}
    for route in ROUTES:
        paths.setdefault(route.path, {})[route.method] = _operation(route, refs, auth)
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "jvllm OpenAI-compatible API", "version": jvllm.__version__},
        "paths": paths,
        "components": {"schemas": defs.get("$defs", {})},
    }
    if auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc


def _requests() -> set[type[BaseModel]]:
    return {r.request for r in ROUTES if r.request}


def _operation(route: RouteDoc, refs: dict, auth: bool) -> dict[str, Any]:
    shape = mp.AnthropicErrorResponse if route.anthropic else rs.ErrorResponse
    error = {"$ref": refs[(shape, "serialization")]["$ref"]}
    ok: dict[str, Any] = {}
    if route.response is not None:
        ok["application/json"] = {"schema": refs[(route.response, "serialization")]}
    else:
        ok["text/plain"] = {"schema": {"type": "string"}}
    if route.streams:
        ok["text/event-stream"] = {"schema": {"type": "string"}}
    responses: dict[str, Any] = {"200": {"description": "OK", "content": ok}}
    codes = ["503"] if route.open else ["400", "401", "404", "413", "503"]
    if route.request is None and not route.open:
        codes = ["401"]
    for code in codes:
        content = {"application/json": {"schema": error}}
        responses[code] = {"description": "Error", "content": content}
    op: dict[str, Any] = {"summary": route.summary, "responses": responses}
    if route.request is not None:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": refs[(route.request, "validation")]}},
        }
    if auth and not route.open:
        op["security"] = [{"bearer": []}]
    return op
