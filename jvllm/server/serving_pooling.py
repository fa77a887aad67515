"""The pooling routes: `/v1/embeddings`, `/pooling`, `/classify`, `/score`, `/rerank`
(and vLLM's `/v1/score`, `/v1/rerank`, `/v2/rerank`).

Owns turning each request into pooling requests (tokenizing its inputs; a score or
rerank pair as one cross-encoder prompt, `tokenizer(text_1, text_2)`, or, on an
embedding model, both sides embedded and compared by cosine), submitting them, and
rendering the answer (float lists or base64 of little-endian float32; labels from
`config.json`'s `id2label`; rerank results best first). A route the model's runner does
not serve is a 400 naming what it serves; the engine's own refusals (length,
dimensions) are 400s naming the field.
"""

from __future__ import annotations

import base64
import functools
import json
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jvllm.pooling.offline import cosine, pair_token_ids, score_pairs
from jvllm.pooling.params import PoolingParams

from . import protocol_pooling as pp
from .errors import APIError
from .serving import Prompt, ServingContext, collect, now, parse_body

Handler = Callable[[ServingContext, Request], Awaitable[Response]]
_API_NAMES = {"embed": "Embeddings", "classify": "Classification", "score": "Score"}


def require(ctx: ServingContext, task: str) -> None:
    """400 unless the model's runner serves `task`."""
    tasks = ctx.engine.supported_tasks
    if task not in tasks:
        raise APIError(
            400,
            f"The model does not support the {_API_NAMES.get(task, task)} API: its runner "
            f"serves {list(tasks)}",
            param="model",
            code="unsupported_task",
        )


def text_prompts(ctx: ServingContext, inputs: Any, add_special_tokens: bool = True) -> list[Prompt]:
    """Prompts from a string, strings, token ids or lists of token ids."""
    if isinstance(inputs, str):
        inputs = [inputs]
    if inputs and isinstance(inputs[0], int):
        inputs = [inputs]
    encode = functools.partial(ctx.tokenizer.encode, add_special_tokens=add_special_tokens)
    return [
        Prompt(x, list(encode(x))) if isinstance(x, str) else Prompt(None, list(x)) for x in inputs
    ]


async def pool(
    ctx: ServingContext, request: Request, prefix: str, prompts: list[Prompt], params: PoolingParams
) -> list[Any] | None:
    """Every prompt's final output in order (None: the client left)."""
    streams = await ctx.submit(prefix, prompts, [params] * len(prompts))  # type: ignore[list-item]
    return await collect(request, streams)


def usage(outputs: Sequence[Any]) -> pp.PoolingUsage:
    n = sum(len(o.prompt_token_ids) for o in outputs)
    return pp.PoolingUsage(prompt_tokens=n, total_tokens=n)


def encoded(data: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(data.astype("<f4").tobytes()).decode()
    return data.tolist()


def params_of(req: pp.PoolingBasic, **extra: Any) -> PoolingParams:
    try:
        return PoolingParams(
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            use_activation=req.use_activation,
            **extra,
        )
    except ValueError as e:
        raise APIError(400, str(e), code="invalid_value") from None


async def create_embedding(ctx: ServingContext, request: Request) -> Response:
    req = await parse_body(request, pp.EmbeddingRequest, ctx.max_body_bytes)
    model = ctx.model_name(req.model)
    require(ctx, "embed")
    params = params_of(req, task="embed", dimensions=req.dimensions)
    prompts = text_prompts(ctx, req.input, req.add_special_tokens)
    outputs = await pool(ctx, request, "embd", prompts, params)
    if outputs is None:
        return Response(status_code=499)  # nobody is listening
    data = [
        pp.EmbeddingData(index=i, embedding=encoded(o.outputs.data, req.encoding_format))
        for i, o in enumerate(outputs)
    ]
    body = pp.EmbeddingResponse(
        id=streams_id("embd", outputs), created=now(), model=model, data=data, usage=usage(outputs)
    )
    return JSONResponse(body.model_dump(mode="json"))


async def create_pooling(ctx: ServingContext, request: Request) -> Response:
    req = await parse_body(request, pp.PoolingRequest, ctx.max_body_bytes)
    model = ctx.model_name(req.model)
    params = params_of(req, task=req.task or "encode", dimensions=req.dimensions)
    require(ctx, params.task or "encode")
    outputs = await pool(ctx, request, "pool", text_prompts(ctx, req.input), params)
    if outputs is None:
        return Response(status_code=499)
    data = [
        pp.PoolingData(index=i, data=encoded(o.outputs.data, req.encoding_format))
        for i, o in enumerate(outputs)
    ]
    body = pp.PoolingResponse(
        id=streams_id("pool", outputs), created=now(), model=model, data=data, usage=usage(outputs)
    )
    return JSONResponse(body.model_dump(mode="json"))


async def create_classify(ctx: ServingContext, request: Request) -> Response:
    req = await parse_body(request, pp.ClassificationRequest, ctx.max_body_bytes)
    model = ctx.model_name(req.model)
    require(ctx, "classify")
    params = params_of(req, task="classify")
    prompts = text_prompts(ctx, req.input, req.add_special_tokens)
    outputs = await pool(ctx, request, "classify", prompts, params)
    if outputs is None:
        return Response(status_code=499)
    labels = id2label(ctx.model_path)
    data = []
    for i, o in enumerate(outputs):
        probs = o.outputs.data.tolist()
        best = labels.get(str(int(np.argmax(probs))))
        data.append(pp.ClassificationData(index=i, label=best, probs=probs, num_classes=len(probs)))
    body = pp.ClassificationResponse(
        id=streams_id("classify", outputs), created=now(), model=model, data=data,
        usage=usage(outputs),
    )  # fmt: skip
    return JSONResponse(body.model_dump(mode="json"))


async def scores(
    ctx: ServingContext, request: Request, pairs: list[tuple[str, str]], req: pp.PoolingBasic
) -> tuple[list[float], int] | None:
    """Each pair's score and the prompt tokens read: a cross-encoder's, or the cosine of
    an embedding model's two embeddings (None: the client left)."""
    tasks = ctx.engine.supported_tasks
    if "score" in tasks:
        prompts = [Prompt(f"{a}\n{b}", pair_token_ids(ctx.tokenizer, a, b)) for a, b in pairs]
        outputs = await pool(ctx, request, "score", prompts, params_of(req, task="score"))
        if outputs is None:
            return None
        if any(o.outputs.data.shape != (1,) for o in outputs):
            raise APIError(400, "The Score API needs a classifier with one label (num_labels=1)")
        return [float(o.outputs.data[0]) for o in outputs], usage(outputs).prompt_tokens
    require(ctx, "score" if "embed" not in tasks else "embed")
    texts = [t for pair in pairs for t in pair]
    outputs = await pool(ctx, request, "score", text_prompts(ctx, texts), params_of(req))
    if outputs is None:
        return None
    embedded = [o.outputs.data for o in outputs]
    values = [cosine(embedded[2 * i], embedded[2 * i + 1]) for i in range(len(pairs))]
    return values, usage(outputs).prompt_tokens


async def create_score(ctx: ServingContext, request: Request) -> Response:
    req = await parse_body(request, pp.ScoreRequest, ctx.max_body_bytes)
    model = ctx.model_name(req.model)
    try:
        pairs = score_pairs(*req.sides())
    except ValueError as e:
        raise APIError(400, str(e), param="text_2") from None
    scored = await scores(ctx, request, pairs, req)
    if scored is None:
        return Response(status_code=499)
    values, tokens = scored
    data = [pp.ScoreData(index=i, score=s) for i, s in enumerate(values)]
    body = pp.ScoreResponse(
        id=f"score-{request_suffix()}", created=now(), model=model, data=data,
        usage=pp.PoolingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )  # fmt: skip
    return JSONResponse(body.model_dump(mode="json"))


async def create_rerank(ctx: ServingContext, request: Request) -> Response:
    req = await parse_body(request, pp.RerankRequest, ctx.max_body_bytes)
    model = ctx.model_name(req.model)
    documents = req.texts()
    scored = await scores(ctx, request, [(req.query, d) for d in documents], req)
    if scored is None:
        return Response(status_code=499)
    values, tokens = scored
    order = sorted(range(len(values)), key=lambda i: -values[i])
    top = order[: req.top_n] if req.top_n else order
    results = [
        pp.RerankResult(
            index=i,
            document=pp.RerankDocument(text=documents[i]) if req.return_documents else None,
            relevance_score=values[i],
        )
        for i in top
    ]
    body = pp.RerankResponse(
        id=f"rerank-{request_suffix()}",
        model=model,
        usage=pp.RerankUsage(prompt_tokens=tokens, total_tokens=tokens),
        results=results,
    )
    return JSONResponse(body.model_dump(mode="json", exclude_none=True))


def streams_id(prefix: str, outputs: Sequence[Any]) -> str:
    """The response id: the request id the engine saw (`ServingContext.submit`)."""
    rid = outputs[0].request_id
    return rid.rsplit("-", 1)[0] if len(outputs) > 1 else rid


def request_suffix() -> str:
    return uuid.uuid4().hex


@functools.lru_cache(maxsize=4)
def id2label(model_path: str) -> dict[str, str]:
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return {}
    labels = json.loads(config.read_text()).get("id2label") or {}
    return {str(k): str(v) for k, v in labels.items()}


POOLING_ROUTES: list[tuple[str, Handler]] = [
    ("/v1/embeddings", create_embedding),
    ("/pooling", create_pooling),
    ("/classify", create_classify),
    ("/score", create_score),
    ("/v1/score", create_score),
    ("/rerank", create_rerank),
    ("/v1/rerank", create_rerank),
    ("/v2/rerank", create_rerank),
]
