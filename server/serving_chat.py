"""POST /v1/chat/completions: a conversation in, assistant messages out, whole or streamed.

Owns rendering the conversation through the tokenizer's chat template (the same path
as `LLM.chat`: render to text, then encode without adding special tokens again), the
chat logprobs format, and the chunk sequence of a stream: a role delta per choice,
content deltas, a finish per choice, optional usage, then `[DONE]`.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jvllm.engine.async_llm import RequestStream
from jvllm.outputs import CompletionOutput, Logprob, RequestOutput
from jvllm.sampling_params import SamplingParams

from .deltas import ChoiceCursor
from .errors import APIError, sse_error
from .protocol import ChatCompletionRequest, ChatMessage
from .responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    DeltaMessage,
    TokenLogprob,
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


async def create_chat_completion(ctx: ServingContext, request: Request) -> Response:
    req = await parse_body(request, ChatCompletionRequest, ctx.max_body_bytes)
    model = ctx.model_name(req.model)
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    _refuse_tools(req)
    prompt = render_chat(ctx, req.messages, req.add_generation_prompt)
    explicit = {"max_tokens", "max_completion_tokens"} & req.model_fields_set
    requested = req.max_completion_tokens or req.max_tokens
    top = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = ctx.max_tokens_for(prompt, requested, bool(explicit))
    params = sampling_params(req, max_tokens, ctx.defaults, logprobs=top)
    streams = await ctx.submit("chatcmpl", [prompt], [params])
    view = _ChatView(ctx, req, model, params)
    if req.stream:
        return EventStreamResponse(view.stream(streams[0]))
    outputs = await collect(request, streams)
    if outputs is None:
        return Response(status_code=499)  # nobody is listening
    return JSONResponse(view.full(outputs[0]).model_dump(mode="json"))


def _refuse_tools(req: ChatCompletionRequest) -> None:
    """Tool calling is not served: a request that relies on it is refused, not ignored."""
    if req.tool_choice not in (None, "none") and not req.tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    if req.tools:
        raise APIError(400, "tools (tool calling) are not supported yet", param="tools")


def render_chat(ctx: ServingContext, messages: list[ChatMessage], add_generation: bool) -> Prompt:
    if not messages:
        raise APIError(400, "messages is empty: give at least one message", param="messages")
    tokenizer = ctx.tokenizer
    if ctx.chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise APIError(
            400,
            "this model's tokenizer has no chat template; start the server with --chat-template",
            param="messages",
        )
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=add_generation,
            chat_template=ctx.chat_template,
        )
    except Exception as e:  # a template may raise anything (jinja2 errors, raise_exception)
        message = f"the chat template rejected the messages: {e}"
        raise APIError(400, message, param="messages") from None
    # The template already carries the special tokens it wants.
    return Prompt(text, list(tokenizer.encode(text, add_special_tokens=False)))


class _ChatView:
    def __init__(
        self, ctx: ServingContext, req: ChatCompletionRequest, model: str, params: SamplingParams
    ) -> None:
        self.ctx, self.req, self.model, self.params = ctx, req, model, params
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = now()

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
        choices = [
            ChatChoice(
                index=c.index,
                message=AssistantMessage(role=self.ctx.response_role, content=c.text),
                logprobs=self._logprobs(c, 0, len(c.token_ids)),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in out.outputs
        ]
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
                    choice = ChatChunkChoice(
                        index=c.index,
                        delta=DeltaMessage(content=delta.text) if delta.text else DeltaMessage(),
                        logprobs=self._logprobs(c, delta.token_start, delta.token_end),
                        finish_reason=delta.finish_reason,
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


def _rank(item: tuple[int, Logprob]) -> int:
    return item[1].rank or 0
