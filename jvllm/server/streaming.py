"""Server-sent events and client-disconnect handling.

Owns noticing that a client went away and cancelling the work done for it. uvicorn
silently drops writes to a closed connection and reports the close only through
`receive()`, so every response that waits on the engine (streamed or not) races its
work against an `http.disconnect` message; the loser is cancelled, and the work's
`finally` closes its request streams, which aborts them in the engine before its
next step. Also merges the streams of a multi-prompt request into one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.types import Receive, Scope, Send

from jvllm.engine.async_llm import RequestStream
from jvllm.outputs import RequestOutput

logger = logging.getLogger("jvllm.server")
T = TypeVar("T")

DONE = b"data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The client closed the connection before the response was complete."""


def sse(payload: str) -> bytes:
    return f"data: {payload}\n\n".encode()


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns once the client has gone; call only after the request body was read."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Awaits `work`; cancels it and raises ClientDisconnected if the client leaves first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


class EventStreamResponse:
    """An ASGI response that sends each chunk of `body` as it comes, and stops (closing
    `body`, which runs its cleanup) as soon as the client disconnects."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], status_code: int = 200) -> None:
        self.body = body
        self.status_code = status_code

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": self.status_code,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),
                ],
            }
        )
        try:
            await until_disconnected(receive, self._pump(send))
        except ClientDisconnected:
            logger.info("client disconnected mid-stream; request aborted")
        finally:
            with contextlib.suppress(Exception):
                await self.body.aclose()  # type: ignore[attr-defined]

    async def _pump(self, send: Send) -> None:
        async for chunk in self.body:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def merge_streams(
    streams: list[RequestStream],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yields (stream index, output) from all streams until every one has finished.

    Errors from any stream propagate. Does not close the streams: the caller does."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    merged: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                merged.put_nowait((index, output))
        except Exception as e:
            merged.put_nowait((index, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await merged.get()
            if isinstance(item, BaseException):
                raise item
            yield index, item
            remaining -= item.finished
    finally:
        for task in tasks:
            task.cancel()


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    """The last output of each stream, in order."""
    last: list[Any] = [None] * len(streams)
    async for index, output in merge_streams(streams):
        last[index] = output
    return last
