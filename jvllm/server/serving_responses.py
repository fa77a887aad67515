"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API over the chat path.

Owns turning a Responses request into a chat request (instructions as the system turn,
a stored conversation before the new input with `previous_response_id`, function tools
and `text.format` as tools and response_format), and the answer: output items
(`reasoning`, `message`, `function_call`), `status` ("incomplete" when
`max_output_tokens` cut it), storing it, and a stream's lifecycle: response.created and
response.in_progress first, response.completed (or response.incomplete) last; the item
events between are `responses_events.py`'s. Rendering, sampling and reading the output
are the chat path's (`serving_chat.prepare_chat`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jvllm.engine.async_llm import RequestStream
from jvllm.outputs import RequestOutput

from .deltas import ChoiceCursor
from .errors import APIError, from_validation_error
from .protocol import ChatCompletionRequest
from .responses_events import ResponseEvents
from .responses_protocol import (
    FunctionChoice,
    FunctionTool,
    InputTokensDetails,
    OutputTokensDetails,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    call_item,
    input_messages,
    message_item,
    new_id,
    reasoning_item,
)
from .serving import ServingContext, collect, now, parse_body, stream_error
from .serving_chat import PreparedChat, prepare_chat
from .streaming import EventStreamResponse, merge_streams


async def create_response(ctx: ServingContext, request: Request) -> Response:
    req = await parse_body(request, ResponsesRequest, ctx.max_body_bytes)
    model = ctx.model_name(req.model)
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        found = ctx.response_store.get(req.previous_response_id)
        if found is None:
            raise APIError(
                400,
                f"Previous response with id {req.previous_response_id!r} not found "
                "(it was never stored, was created with store=false, or was dropped)",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        history = found[1]
    conversation = history + input_messages(req)
    chat = prepare_chat(ctx, chat_request(req, conversation))
    streams = await ctx.submit("resp", [chat.prompt], [chat.params], 0, ctx.lora_request(model))
    run = _ResponseRun(ctx, req, model, chat, conversation)
    if req.stream:
        return EventStreamResponse(run.stream(streams[0]))
    outputs = await collect(request, streams)
    if outputs is None:
        return Response(status_code=499)  # nobody is listening
    return JSONResponse(run.full(outputs[0]).model_dump(mode="json"))


async def retrieve_response(ctx: ServingContext, request: Request) -> Response:
    response_id = request.path_params["response_id"]
    found = ctx.response_store.get(response_id)
    if found is None:
        raise APIError(404, f"No response with id {response_id!r} is stored", param="response_id")
    return JSONResponse(found[0].model_dump(mode="json"))


def chat_request(
    req: ResponsesRequest, conversation: list[dict[str, Any]]
) -> ChatCompletionRequest:
    """The chat request that generates this response (400 names what does not fit)."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {
        "model": req.model,
        "messages": system + conversation,
        "stream": req.stream,
        "parallel_tool_calls": req.parallel_tool_calls,
    }
    fields = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop")
    body.update({k: getattr(req, k) for k in fields if getattr(req, k) is not None})
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": _function(t, i)} for i, t in enumerate(req.tools)
        ]
    choice = req.tool_choice
    if isinstance(choice, FunctionChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        body["tool_choice"] = choice
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
        body["response_format"] = {"type": fmt.type, "json_schema": schema}
        if fmt.type == "json_object":
            del body["response_format"]["json_schema"]
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e, ChatCompletionRequest) from None


def _function(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise APIError(
            400,
            f"tools[{i}].type {tool.get('type')!r} is not served: only function tools are",
            param=f"tools[{i}].type",
        )
    try:
        spec = FunctionTool.model_validate(tool)
    except ValidationError as e:
        raise from_validation_error(e, FunctionTool) from None
    return spec.model_dump(exclude={"type"}, exclude_none=True)


class _ResponseRun:
    """One response being generated: its id, its request's echo, and how it ends."""

    def __init__(
        self,
        ctx: ServingContext,
        req: ResponsesRequest,
        model: str,
        chat: PreparedChat,
        conversation: list[dict[str, Any]],
    ) -> None:
        self.ctx, self.req, self.model, self.chat = ctx, req, model, chat
        self.conversation = conversation
        self.id = new_id("resp")
        self.created = now()

    def response(self, status: str, output: list[dict[str, Any]]) -> ResponseObject:
        req = self.req
        return ResponseObject(
            id=self.id,
            created_at=self.created,
            model=self.model,
            status=status,  # type: ignore[arg-type]
            output=output,
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            metadata=req.metadata,
            parallel_tool_calls=req.parallel_tool_calls,
            previous_response_id=req.previous_response_id,
            temperature=req.temperature,
            top_p=req.top_p,
            tool_choice=req.tool_choice_echo(),
            tools=req.tools or [],
            text=req.text_echo(),
            store=req.store,
            user=req.user,
        )

    def finished(self, output: list[dict[str, Any]], out: RequestOutput) -> ResponseObject:
        """The final response object; stored (with the conversation) unless store=false."""
        c = out.outputs[0]
        incomplete = c.finish_reason == "length"
        response = self.response("incomplete" if incomplete else "completed", output)
        if incomplete:
            response.incomplete_details = {"reason": "max_output_tokens"}
        prompt, generated = len(out.prompt_token_ids), len(c.token_ids)
        response.usage = ResponseUsage(
            input_tokens=prompt,
            input_tokens_details=InputTokensDetails(cached_tokens=out.num_cached_tokens),
            output_tokens=generated,
            output_tokens_details=OutputTokensDetails(),
            total_tokens=prompt + generated,
        )
        if self.req.store:
            self.ctx.response_store.put(response, self.conversation + [_assistant_turn(output)])
        return response

    def full(self, out: RequestOutput) -> ResponseObject:
        parsed = self.chat.reader(self.ctx).parse_all(out.outputs[0].text)
        items = []
        if parsed.reasoning:
            items.append(reasoning_item(new_id("rs"), parsed.reasoning, "completed"))
        if parsed.content or not parsed.calls:
            items.append(message_item(new_id("msg"), parsed.content or "", "completed"))
        for call in parsed.calls:
            items.append(call_item(new_id("fc"), call.id, call.name, call.arguments, "completed"))
        return self.finished(items, out)

    async def stream(self, stream: RequestStream) -> AsyncIterator[bytes]:
        events = ResponseEvents(lambda: self.response("in_progress", []))
        reader = self.chat.reader(self.ctx)
        cursor = ChoiceCursor.for_params(self.chat.params)
        try:
            yield events.lifecycle("response.created")
            yield events.lifecycle("response.in_progress")
            last = None
            async for _, out in merge_streams([stream]):
                last = out
                delta = cursor.advance(out.outputs[0])
                if delta is None:
                    continue
                for chunk in events.deltas(reader.feed(delta.text)):
                    yield chunk
                if delta.finish_reason is not None:
                    for chunk in events.deltas(reader.finish()):
                        yield chunk
            assert last is not None
            for chunk in events.close_all():
                yield chunk
            final = self.finished(events.items, last)
            kind = "response.completed" if final.status == "completed" else "response.incomplete"
            yield events.event(kind, response=final.model_dump(mode="json"))
        except Exception as e:
            error = stream_error(e)
            yield events.event("error", code=error.code, message=error.message, param=error.param)
        finally:
            stream.close()


def _assistant_turn(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The output as the chat message a later turn's prompt renders."""
    text = "".join(
        i["content"][0]["text"] for i in output if i["type"] == "message" and i["content"]
    )
    calls = [
        {
            "id": i["call_id"],
            "type": "function",
            "function": {"name": i["name"], "arguments": i["arguments"]},
        }
        for i in output
        if i["type"] == "function_call"
    ]
    turn: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        turn["tool_calls"] = calls
    return turn
