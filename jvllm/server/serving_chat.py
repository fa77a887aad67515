"""POST /v1/chat/completions: a conversation in, assistant messages out, whole or streamed.

Owns rendering the conversation through the tokenizer's chat template (the same path
as `LLM.chat`: render to text, then encode without adding special tokens again), the
chat logprobs format, and the chunk sequence of a stream: a role delta per choice,
content deltas, a finish per choice, optional usage, then `[DONE]`.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jvllm.engine.async_llm import RequestStream
from jvllm.engine.multimodal import split_image_parts
from jvllm.outputs import CompletionOutput, Logprob, RequestOutput
from jvllm.sampling_params import SamplingParams

from .deltas import ChoiceCursor
from .errors import APIError, sse_error
from .output_reader import OutputReader, reasoning_parser
from .protocol import ChatCompletionRequest, ChatMessage
from .responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    json_logprob,
)
from .serving import (
    Prompt,
    ServingContext,
    collect,
    now,
    parse_body,
    sampling_params,
    stream_error,
    usage,
)
from .streaming import DONE, EventStreamResponse, merge_streams, sse
from .tools import tool_choice_mode, tool_constraint


async def create_chat_completion(ctx: ServingContext, request: Request) -> Response:
    req = await parse_body(request, ChatCompletionRequest, ctx.max_body_bytes)
    model = ctx.model_name(req.model)
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    chat = prepare_chat(ctx, req)
    lora = ctx.lora_request(model)
    streams = await ctx.submit("chatcmpl", [chat.prompt], [chat.params], req.priority, lora)
    view = _ChatView(ctx, req, model, chat)
    if req.stream:
        return EventStreamResponse(view.stream(streams[0]))
    outputs = await collect(request, streams)
    if outputs is None:
        return Response(status_code=499)  # nobody is listening
    return JSONResponse(view.full(outputs[0]).model_dump(mode="json"))


@dataclass(frozen=True)
class PreparedChat:
    """A chat request made ready for the engine, and how its output is to be read."""

    prompt: Prompt
    params: SamplingParams
    mode: str  # tool_choice: "none", "auto", "required" or "named"
    function: str | None  # the named choice's function
    tools: list[dict[str, Any]]
    reasoning_active: bool  # the output starts in reasoning (a parser, and the prompt left it open)

    def reader(self, ctx: ServingContext) -> OutputReader:
        reasoning = reasoning_parser(ctx.reasoning_parser, ctx.tokenizer)
        return OutputReader(
            mode=self.mode,
            function=self.function,
            tools=self.tools,
            tool_parser=ctx.tool_call_parser,
            reasoning=reasoning,
            reasoning_active=self.reasoning_active,
        )


def prepare_chat(ctx: ServingContext, req: ChatCompletionRequest) -> PreparedChat:
    """Renders the conversation and builds SamplingParams (with the tool grammar, which
    starts where reasoning ends); 400 for what the request gets wrong."""
    mode = tool_choice_mode(req, ctx.tool_call_parser)
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    prompt = render_chat(
        ctx, req.messages, req.add_generation_prompt, tools or None, req.chat_template_kwargs
    )
    explicit = {"max_tokens", "max_completion_tokens"} & req.model_fields_set
    requested = req.max_completion_tokens or req.max_tokens
    top = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = ctx.max_tokens_for(prompt, requested, bool(explicit))
    extra: dict[str, Any] = {"logprobs": top}
    constraint = tool_constraint(req, mode)
    if constraint is not None:
        extra["structured_outputs"] = constraint
    params = sampling_params(req, max_tokens, ctx.defaults, **extra)
    parser = reasoning_parser(ctx.reasoning_parser, ctx.tokenizer)
    active = parser is not None and not parser.is_reasoning_end(prompt.text or "")
    spec = getattr(params, "structured_outputs", None)
    if active and spec is not None:
        assert parser is not None
        ends = dataclasses.replace(spec, reasoning_end_token_ids=parser.end_token_ids)
        params = dataclasses.replace(params, structured_outputs=ends)
    named = req.tool_choice.function.name if mode == "named" else None  # type: ignore[union-attr]
    return PreparedChat(prompt, params, mode, named, tools, active)


def render_chat(
    ctx: ServingContext,
    messages: list[ChatMessage],
    add_generation: bool,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> Prompt:
    if not messages:
        raise APIError(400, "messages is empty: give at least one message", param="messages")
    tokenizer = ctx.tokenizer
    if ctx.chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise APIError(
            400,
            "this model's tokenizer has no chat template; start the server with --chat-template",
            param="messages",
        )
    conversation, images = split_image_parts([_template_message(m) for m in messages])
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation,
            chat_template=ctx.chat_template,
            **(template_kwargs or {}),
        )
    except Exception as e:  # a template may raise anything (jinja2 errors, raise_exception)
        message = f"the chat template rejected the messages: {e}"
        raise APIError(400, message, param="messages") from None
    # The template already carries the special tokens it wants.
    return Prompt(text, list(tokenizer.encode(text, add_special_tokens=False)), tuple(images))


def _template_message(m: ChatMessage) -> dict[str, Any]:
    """A message as chat templates take it: tool calls with their arguments as objects
    (as Transformers' templates expect, and vLLM passes them)."""
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.has_images():  # the parts, in order: `split_image_parts` takes the images out
        out["content"] = [part.model_dump(exclude_none=True) for part in m.content or []]
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": _object(c.function.arguments)},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def _object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


class _ChatView:
    def __init__(
        self, ctx: ServingContext, req: ChatCompletionRequest, model: str, chat: PreparedChat
    ) -> None:
        self.ctx, self.req, self.model, self.chat = ctx, req, model, chat
        self.params, self.mode = chat.params, chat.mode
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = now()

    def _finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's "tool_calls" where the model chose to call (auto, required)."""
        if reason == "stop" and called and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason

    def _logprobs(self, c: CompletionOutput, start: int, end: int) -> ChatLogprobs | None:
        if not self.req.logprobs:
            return None
        top = self.req.top_logprobs or 0
        content = []
        entries = (c.logprobs or [])[start:end]
        for token, entry in zip(c.token_ids[start:end], entries, strict=False):
            chosen = entry[token]
            ranked = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None), key=_rank)
            content.append(
                TokenLogprob(
                    **self._top(token, chosen).model_dump(),
                    top_logprobs=[self._top(t, lp) for t, lp in ranked[:top]],
                )
            )
        return ChatLogprobs(content=content)

    def full(self, out: RequestOutput) -> ChatCompletionResponse:
        choices = []
        for c in out.outputs:
            parsed = self.chat.reader(self.ctx).parse_all(c.text)
            content, calls = parsed.content, parsed.calls
            message = AssistantMessage(
                role=self.ctx.response_role,
                content=content,
                reasoning=parsed.reasoning,
                reasoning_content=parsed.reasoning,
                tool_calls=[
                    ToolCall(id=t.id, function=FunctionCall(name=t.name, arguments=t.arguments))
                    for t in calls
                ],
            )
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=message,
                    logprobs=self._logprobs(c, 0, len(c.token_ids)),
                    finish_reason=self._finish_reason(c.finish_reason, bool(calls)),
                    stop_reason=c.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage([out])
        )

    def _chunk(self, choices: list[ChatChunkChoice], **kw: object) -> bytes:
        chunk = ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=choices, **kw
        )
        return sse(chunk.model_dump_json(exclude_none=False))

    async def stream(self, stream: RequestStream) -> AsyncIterator[bytes]:
        cursors = [ChoiceCursor.for_params(self.params) for _ in range(self.req.n)]
        readers = [self.chat.reader(self.ctx) for _ in range(self.req.n)]
        last = None
        try:
            for i in range(self.req.n):
                role = DeltaMessage(role=self.ctx.response_role, content="")
                yield self._chunk([ChatChunkChoice(index=i, delta=role)])
            async for _, out in merge_streams([stream]):
                last = out
                for c in out.outputs:
                    delta = cursors[c.index].advance(c)
                    if delta is None or ChoiceCursor.is_empty(delta, self.req.logprobs):
                        continue
                    message = _tool_delta(readers[c.index], delta.text, delta.finish_reason)
                    finish = self._finish_reason(delta.finish_reason, bool(readers[c.index].calls))
                    choice = ChatChunkChoice(
                        index=c.index,
                        delta=message,
                        logprobs=self._logprobs(c, delta.token_start, delta.token_end),
                        finish_reason=finish,
                        stop_reason=delta.stop_reason,
                    )
                    yield self._chunk([choice])
            if self.req.include_usage and last is not None:
                yield self._chunk([], usage=usage([last]))
        except Exception as e:
            yield sse_error(stream_error(e))
        finally:
            stream.close()
        yield DONE

    def _top(self, token_id: int, lp: Logprob) -> TopLogprob:
        text = self.ctx.token_text(token_id, lp.decoded_token or "")
        return TopLogprob(token=text, logprob=json_logprob(lp.logprob), bytes=list(text.encode()))


def _tool_delta(reader: OutputReader, text: str, finish_reason: str | None) -> DeltaMessage:
    """The reasoning, content and tool-call deltas of a choice's new text."""
    new = reader.feed(text)
    reasoning, content, calls, arguments = new.reasoning, new.content, new.calls, new.arguments
    if finish_reason is not None:
        end = reader.finish()
        reasoning, content = reasoning + end.reasoning, content + end.content
        calls, arguments = calls + end.calls, arguments + end.arguments
    deltas = []
    if reader.mode == "named":
        for call in calls:  # the first delta: id and name
            function = DeltaFunctionCall(name=call.name, arguments="")
            deltas.append(DeltaToolCall(index=0, id=call.id, type="function", function=function))
        if arguments:
            deltas.append(DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=arguments)))
    else:
        first = len(reader.calls) - len(calls)
        for k, call in enumerate(calls):
            function = DeltaFunctionCall(name=call.name, arguments=call.arguments)
            deltas.append(
                DeltaToolCall(index=first + k, id=call.id, type="function", function=function)
            )
    return DeltaMessage(
        content=content or None,
        reasoning=reasoning or None,
        reasoning_content=reasoning or None,
        tool_calls=deltas or None,
    )


def _rank(item: tuple[int, Logprob]) -> int:
    return item[1].rank or 0
