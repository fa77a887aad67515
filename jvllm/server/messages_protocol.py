"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): request
bodies, Anthropic's error shape, and turning a Messages conversation into chat messages.

Owns the shapes as Anthropic's clients send and read them: `system` (a string or text
blocks), `messages` whose content is a string or blocks (`text`, `tool_use`,
`tool_result`; `thinking` blocks of earlier turns are dropped), `tools` with
`input_schema`, `tool_choice` (`auto`, `any`, `tool`, `none`), and errors as
`{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}`.
Running a request is `serving_messages.py`'s.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field
from starlette.responses import JSONResponse

from .errors import APIError, clean_message
from .protocol import MAX_MESSAGES, MAX_STOP, MAX_TOOLS, StopString, Strict

MESSAGES_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
# Anthropic's error `type` for each status we send.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": clean_message(message)}}


def anthropic_error_response(error: APIError) -> JSONResponse:
    body = anthropic_error(error.status, error.message)
    return JSONResponse(body, status_code=error.status, headers=error.headers)


class AnthropicErrorBody(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorBody


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessageResponse(BaseModel):
    """The answer: content blocks (`thinking`, `text`, `tool_use`) and why it stopped."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None = None
    stop_sequence: str | None = None
    usage: MessageUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


class TextBlock(Strict):
    type: Literal["text"]
    text: str


class AnthropicTool(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # "custom" or absent


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class AnthropicMessage(Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CountTokensRequest(Strict):
    """POST /v1/messages/count_tokens."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(max_length=MAX_MESSAGES)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[StopString] | None = Field(None, max_length=MAX_STOP)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    stream: bool = False
    metadata: dict[str, Any] | None = None


def chat_body(req: CountTokensRequest) -> dict[str, Any]:
    """The chat request's messages, tools and tool_choice for a Messages request."""
    system = req.system
    if isinstance(system, list):
        system = "".join(block.text for block in system)
    messages = [{"role": "system", "content": system}] if system else []
    for i, m in enumerate(req.messages):
        messages += _chat_messages(m, i)
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.input_schema,
                },
            }
            for t in req.tools
        ]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise APIError(400, 'tool_choice of type "tool" needs a name', param="tool_choice")
        named = {"type": "function", "function": {"name": choice.name}}
        modes = {"auto": "auto", "any": "required", "none": "none", "tool": named}
        body["tool_choice"] = modes[choice.type]
        body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if body.get("tools") and choice is None:
        body["tool_choice"] = "auto"
    return body


def _chat_messages(m: AnthropicMessage, i: int) -> list[dict[str, Any]]:
    """One Messages turn as chat messages: tool results first (each a tool message),
    then the turn's text, with an assistant's tool_use blocks as its tool calls."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    texts, calls, results = [], [], []
    for j, block in enumerate(m.content):
        kind = block.get("type")
        where = f"messages[{i}].content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and m.role == "assistant":
            calls.append(_tool_use(block, where))
        elif kind == "tool_result" and m.role == "user":
            results.append(_tool_result(block, where))
        elif kind not in ("thinking", "redacted_thinking"):
            raise APIError(
                400,
                f"{where}: a {m.role} turn takes text"
                + (", tool_use" if m.role == "assistant" else ", tool_result")
                + f" and thinking blocks, got type {kind!r}",
                param=where,
            )
    out = results
    if texts or calls:
        message: dict[str, Any] = {"role": m.role, "content": "".join(texts) or None}
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return out


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    name, call_id, arguments = block.get("name"), block.get("id"), block.get("input", {})
    if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(arguments, dict):
        raise APIError(400, f"{where}: tool_use needs id, name and an input object", param=where)
    function = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
    return {"id": call_id, "type": "function", "function": function}


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    content = block.get("content", "")
    if isinstance(content, list):
        content = "".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and part.get("type") == "text"
        )
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not isinstance(content, str):
        raise APIError(400, f"{where}: tool_result needs tool_use_id and text content", param=where)
    return {"role": "tool", "tool_call_id": call_id, "content": content}
