"""POST /v1/completions: prompts in, text completions out, whole or streamed.

Owns the completions-specific parts: the four prompt forms, `echo`, the legacy
logprobs format, and choice numbering (prompt i, sample j -> index i * n + j, as
vLLM and OpenAI number them). Shared validation and submission live in `serving.py`.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jvllm.engine.async_llm import RequestStream
from jvllm.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from jvllm.sampling_params import SamplingParams

from .deltas import ChoiceCursor
from .errors import APIError, sse_error
from .protocol import CompletionRequest
from .responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
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


async def create_completion(ctx: ServingContext, request: Request) -> Response:
    req = await parse_body(request, CompletionRequest, ctx.max_body_bytes)
    model = ctx.model_name(req.model)
    prompts = _prompts(ctx, req.prompt)
    explicit = "max_tokens" in req.model_fields_set
    echo_logprobs = req.logprobs if req.echo else None
    params = [
        sampling_params(
            req,
            ctx.max_tokens_for(p, req.max_tokens, explicit),
            ctx.defaults,
            logprobs=req.logprobs,
            prompt_logprobs=echo_logprobs,
        )
        for p in prompts
    ]
    streams = await ctx.submit("cmpl", prompts, params, req.priority, ctx.lora_request(model))
    view = _CompletionView(ctx, req, model, prompts, params)
    if req.stream:
        return EventStreamResponse(view.stream(streams))
    outputs = await collect(request, streams)
    if outputs is None:
        return Response(status_code=499)  # nobody is listening
    return JSONResponse(view.full(outputs).model_dump(mode="json"))


def _prompts(ctx: ServingContext, prompt: str | list) -> list[Prompt]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        items: list = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise APIError(400, "prompt is empty: give at least one prompt", param="prompt")
    prompts = []
    for item in items:
        if isinstance(item, str):
            prompts.append(Prompt(item, list(ctx.tokenizer.encode(item)) if item else []))
        else:
            prompts.append(Prompt(None, list(item)))
    return prompts


class _CompletionView:
    """Renders one request's outputs as a response or as stream chunks."""

    def __init__(
        self,
        ctx: ServingContext,
        req: CompletionRequest,
        model: str,
        prompts: list[Prompt],
        params: list[SamplingParams],
    ) -> None:
        self.ctx, self.req, self.model, self.prompts, self.params = ctx, req, model, prompts, params
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = now()

    def _response(self, choices: list[CompletionChoice], **kw: object) -> CompletionResponse:
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, **kw
        )

    def full(self, outputs: list[RequestOutput]) -> CompletionResponse:
        choices = []
        for i, out in enumerate(outputs):
            for c in out.outputs:
                text, logprobs = c.text, None
                if self.req.logprobs is not None:
                    logprobs = self._logprobs(out, c, 0, len(c.token_ids), self.req.echo)
                if self.req.echo:
                    text = self.ctx.prompt_text(self.prompts[i]) + text
                choices.append(
                    CompletionChoice(
                        index=i * self.req.n + c.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
        return self._response(choices, usage=usage(outputs))

    async def stream(self, streams: list[RequestStream]) -> AsyncIterator[bytes]:
        cursors: dict[int, ChoiceCursor] = {}
        offsets: dict[int, int] = {}  # choice index -> text offset of its next token
        last: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, out in merge_streams(streams):
                last[i] = out
                for c in out.outputs:
                    index = i * self.req.n + c.index
                    first = index not in cursors
                    cursor = cursors.setdefault(index, ChoiceCursor.for_params(self.params[i]))
                    delta = cursor.advance(c)
                    if delta is None or cursor.is_empty(delta, self.req.logprobs is not None):
                        if first:
                            del cursors[index]  # the echo still goes with the first chunk
                        continue
                    echo = first and self.req.echo
                    text = (self.ctx.prompt_text(self.prompts[i]) if echo else "") + delta.text
                    logprobs = None
                    if self.req.logprobs is not None:
                        offset = offsets.get(index, 0)
                        logprobs = self._logprobs(
                            out, c, delta.token_start, delta.token_end, echo, offset
                        )
                        offsets[index] = _next_offset(logprobs, offset)
                    choice = CompletionChoice(
                        index=index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=delta.finish_reason,
                        stop_reason=delta.stop_reason,
                    )
                    yield sse(self._response([choice]).model_dump_json())
            if self.req.include_usage:
                done = [o for o in last if o is not None]
                yield sse(self._response([], usage=usage(done)).model_dump_json())
        except Exception as e:
            yield sse_error(stream_error(e))
        finally:
            for stream in streams:
                stream.close()
        yield DONE

    def _logprobs(
        self,
        out: RequestOutput,
        c: CompletionOutput,
        start: int,
        end: int,
        echo: bool,
        offset: int = 0,
    ) -> CompletionLogprobs:
        result = CompletionLogprobs()
        if echo:
            _append(result, out.prompt_logprobs or [], out.prompt_token_ids, offset, self.ctx)
            offset = _next_offset(result, offset)
        _append(result, (c.logprobs or [])[start:end], c.token_ids[start:end], offset, self.ctx)
        return result


def _append(
    result: CompletionLogprobs,
    entries: list[PositionLogprobs | None],
    token_ids: list[int],
    offset: int,
    ctx: ServingContext,
) -> None:
    for position, token in enumerate(token_ids):
        entry = entries[position] if position < len(entries) else None
        if entry is None or token not in entry:
            text = ctx.token_text(token, ctx.tokenizer.decode([token]))
            result.tokens.append(text)
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            text = ctx.token_text(token, entry[token].decoded_token or "")
            result.tokens.append(text)
            result.token_logprobs.append(json_logprob(entry[token].logprob))
            result.top_logprobs.append(
                {
                    ctx.token_text(t, lp.decoded_token or ""): json_logprob(lp.logprob)
                    for t, lp in entry.items()
                }
            )
        result.text_offset.append(offset)
        offset += len(text)


def _next_offset(logprobs: CompletionLogprobs, offset: int) -> int:
    if not logprobs.tokens:
        return offset
    return logprobs.text_offset[-1] + len(logprobs.tokens[-1])
