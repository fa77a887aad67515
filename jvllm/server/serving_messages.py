"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path.

Owns the answer in Anthropic's shape: content blocks (`thinking` with
--reasoning-parser, `text`, `tool_use` with its input object), `stop_reason`
(`end_turn`, `max_tokens`, `stop_sequence` with the matched `stop_sequence`,
`tool_use`), usage, and the stream's events: message_start, per block
content_block_start, its deltas (`text_delta`, `thinking_delta`, `input_json_delta`),
content_block_stop, then message_delta and message_stop. Every error, before or
during a stream, takes Anthropic's `{"type": "error", ...}` shape. Rendering, sampling
and reading the output are the chat path's (`serving_chat.prepare_chat`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jvllm.engine.async_llm import RequestStream
from jvllm.outputs import CompletionOutput, RequestOutput

from .deltas import ChoiceCursor
from .errors import APIError, from_validation_error
from .messages_protocol import (
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
    MessageUsage,
    anthropic_error,
    anthropic_error_response,
    chat_body,
)
from .output_reader import OutputDelta
from .protocol import ChatCompletionRequest
from .serving import ServingContext, collect, parse_body, stream_error
from .serving_chat import PreparedChat, prepare_chat, render_chat
from .streaming import EventStreamResponse, merge_streams

Handler = Callable[[ServingContext, Request], Awaitable[Response]]


def anthropic_errors(handler: Handler) -> Handler:
    """The handler with its API errors in Anthropic's shape."""

    async def wrapped(ctx: ServingContext, request: Request) -> Response:
        try:
            return await handler(ctx, request)
        except APIError as e:
            return anthropic_error_response(e)

    return wrapped


@anthropic_errors
async def create_message(ctx: ServingContext, request: Request) -> Response:
    req = await parse_body(request, MessagesRequest, ctx.max_body_bytes)
    model = ctx.model_name(req.model)
    body = chat_body(req)
    body.update(max_completion_tokens=req.max_tokens, stream=req.stream)
    sampling = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k}
    body.update({k: v for k, v in sampling.items() if v is not None})
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    chat = prepare_chat(ctx, _validated(body))
    streams = await ctx.submit("msg", [chat.prompt], [chat.params], 0, ctx.lora_request(model))
    view = _MessageView(ctx, model, chat, req.stop_sequences or [])
    if req.stream:
        return EventStreamResponse(view.stream(streams[0]))
    outputs = await collect(request, streams)
    if outputs is None:
        return Response(status_code=499)  # nobody is listening
    return JSONResponse(view.full(outputs[0]))


@anthropic_errors
async def count_message_tokens(ctx: ServingContext, request: Request) -> Response:
    req = await parse_body(request, CountTokensRequest, ctx.max_body_bytes)
    ctx.model_name(req.model)
    chat = _validated(chat_body(req))
    tools = [t.model_dump(exclude_none=True) for t in chat.tools or []]
    prompt = render_chat(ctx, chat.messages, True, tools or None)
    return JSONResponse(CountTokensResponse(input_tokens=len(prompt.token_ids)).model_dump())


def _validated(body: dict[str, Any]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e, ChatCompletionRequest) from None


def _stop(c: CompletionOutput, called: bool) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a finished choice."""
    if called:
        return "tool_use", None
    if c.finish_reason == "length":
        return "max_tokens", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class _MessageView:
    def __init__(
        self, ctx: ServingContext, model: str, chat: PreparedChat, stops: list[str]
    ) -> None:
        self.ctx, self.model, self.chat, self.stops = ctx, model, chat, stops
        self.id = f"msg_{uuid.uuid4().hex}"

    def message(self, content: list[dict[str, Any]], input_tokens: int) -> MessageResponse:
        usage = MessageUsage(input_tokens=input_tokens, output_tokens=0)
        return MessageResponse(id=self.id, model=self.model, content=content, usage=usage)

    def full(self, out: RequestOutput) -> dict[str, Any]:
        c = out.outputs[0]
        parsed = self.chat.reader(self.ctx).parse_all(c.text)
        blocks: list[dict[str, Any]] = []
        if parsed.reasoning:
            blocks.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
        if parsed.content:
            blocks.append({"type": "text", "text": parsed.content})
        for call in parsed.calls:
            blocks.append(
                {
                    "type": "tool_use",
                    "id": _tool_id(call.id),
                    "name": call.name,
                    "input": _input(call.arguments),
                }
            )
        message = self.message(blocks, len(out.prompt_token_ids))
        message.stop_reason, message.stop_sequence = _stop(c, bool(parsed.calls))  # type: ignore[assignment]
        message.usage.output_tokens = len(c.token_ids)
        return message.model_dump(mode="json")

    async def stream(self, stream: RequestStream) -> AsyncIterator[bytes]:
        blocks = _BlockWriter()
        reader = self.chat.reader(self.ctx)
        cursor = ChoiceCursor.for_params(self.chat.params)
        started = False
        try:
            async for _, out in merge_streams([stream]):
                if not started:
                    started = True
                    start = self.message([], len(out.prompt_token_ids))
                    yield _event("message_start", message=start.model_dump(mode="json"))
                c = out.outputs[0]
                delta = cursor.advance(c)
                if delta is None:
                    continue
                for chunk in blocks.deltas(reader.feed(delta.text)):
                    yield chunk
                if delta.finish_reason is None:
                    continue
                for chunk in blocks.deltas(reader.finish()) + blocks.close():
                    yield chunk
                stop_reason, stop_sequence = _stop(c, bool(reader.calls))
                delta_body = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
                usage = {"output_tokens": len(c.token_ids)}
                yield _event("message_delta", delta=delta_body, usage=usage)
                yield _event("message_stop")
        except Exception as e:
            error = stream_error(e)
            payload = anthropic_error(error.status, error.message)
            yield f"event: error\ndata: {json.dumps(payload)}\n\n".encode()
        finally:
            stream.close()


def _tool_id(call_id: str) -> str:
    """Anthropic's `toolu_` ids, from the parser's call id."""
    return "toolu_" + "".join(ch for ch in call_id if ch.isalnum())[-24:]


def _event(kind: str, **fields: Any) -> bytes:
    payload = json.dumps({"type": kind, **fields}, ensure_ascii=False)
    return f"event: {kind}\ndata: {payload}\n\n".encode()


class _BlockWriter:
    """Content blocks as stream events; a block opens with its first text and closes
    when a block of another kind (or another tool call) begins, or at the end."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the open block's type

    def deltas(self, delta: OutputDelta) -> list[bytes]:
        out: list[bytes] = []
        if delta.reasoning:
            out += self._write("thinking", {"type": "thinking_delta", "thinking": delta.reasoning})
        if delta.content:
            out += self._write("text", {"type": "text_delta", "text": delta.content})
        for call in delta.calls:
            out += self.close()
            self.index, self.open = self.index + 1, "tool_use"
            block = {"type": "tool_use", "id": _tool_id(call.id), "name": call.name, "input": {}}
            out.append(_event("content_block_start", index=self.index, content_block=block))
            if call.arguments:
                out += self._write("tool_use", _json_delta(call.arguments))
        if delta.arguments:
            out += self._write("tool_use", _json_delta(delta.arguments))
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", index=self.index)]

    def _write(self, kind: str, delta: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if self.open != kind:
            out += self.close()
            self.index, self.open = self.index + 1, kind
            empty = {"text": {"type": "text", "text": ""}}
            empty["thinking"] = {"type": "thinking", "thinking": "", "signature": ""}
            out.append(_event("content_block_start", index=self.index, content_block=empty[kind]))
        return out + [_event("content_block_delta", index=self.index, delta=delta)]


def _json_delta(text: str) -> dict[str, Any]:
    return {"type": "input_json_delta", "partial_json": text}
