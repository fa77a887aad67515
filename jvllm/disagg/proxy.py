"""The disaggregated-prefill proxy: each request to the prefill server, then to decode.

Owns the two hops of vLLM's disaggregated-serving example (its toy proxy): a
completion or chat request goes first to a prefill server (a `kv_producer`) with
max_tokens=1 and no streaming, which computes the prompt's KV and sends its blocks to
the decode server (a `kv_consumer`); once that answers, the original request goes to
the decode server, whose answer (streamed or not) is the client's. Several URLs of a
kind are used in turn. It holds no model and no KV:

    python -m jvllm.disagg.proxy --port 8000 \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

ROUTES = ("/v1/completions", "/v1/chat/completions")
FORWARDED_HEADERS = ("authorization", "x-request-id")
TIMEOUT_S = 600.0


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill server gets: one token, not streamed."""
    body = {**body, "max_tokens": 1, "stream": False}
    body.pop("stream_options", None)
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    return body


def build_proxy_app(
    prefill_urls: Sequence[str], decode_urls: Sequence[str], client: httpx.AsyncClient | None = None
) -> Starlette:
    """The proxy's Starlette app; `client` (default: one of its own) makes both hops."""
    if not prefill_urls or not decode_urls:
        raise ValueError("the proxy needs at least one --prefill and one --decode URL")
    prefills, decodes = itertools.cycle(prefill_urls), itertools.cycle(decode_urls)
    state: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        state["client"] = client or httpx.AsyncClient(timeout=TIMEOUT_S)
        yield
        if client is None:
            await state["client"].aclose()

    async def forward(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": {"message": "the body is not JSON"}}, 400)
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "the body is not a JSON object"}}, 400)
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        http, path = state["client"], request.url.path
        first = await http.post(next(prefills) + path, json=prefill_body(body), headers=headers)
        if first.status_code != 200:  # the prefill server's error is the client's
            return Response(first.content, first.status_code, media_type="application/json")
        url = next(decodes) + path
        if not body.get("stream"):
            answer = await http.post(url, json=body, headers=headers)
            return Response(answer.content, answer.status_code, media_type="application/json")
        return await _stream(http, url, body, headers)

    async def health(_: Request) -> Response:
        return Response(status_code=200)

    routes = [Route(path, forward, methods=["POST"]) for path in ROUTES]
    return Starlette(routes=[*routes, Route("/health", health)], lifespan=lifespan)


async def _stream(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]
) -> Response:
    """The decode server's streamed answer, passed through chunk by chunk."""
    request = http.build_request("POST", url, json=body, headers=headers)
    upstream = await http.send(request, stream=True)
    if upstream.status_code != 200:
        content = await upstream.aread()
        await upstream.aclose()
        return Response(content, upstream.status_code, media_type="application/json")

    async def chunks() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await upstream.aclose()

    return StreamingResponse(chunks(), media_type="text/event-stream")


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefill", nargs="+", required=True, help="prefill server URL(s)")
    parser.add_argument("--decode", nargs="+", required=True, help="decode server URL(s)")
    args = parser.parse_args(argv)
    prefill, decode = [u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode]
    app = build_proxy_app(prefill, decode)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
