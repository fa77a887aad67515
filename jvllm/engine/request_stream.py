"""RequestStream: one request's outputs on the event loop, newest only.

Owns delivering a request's outputs to the coroutine that reads them: coalescing (a
slow reader skips stale cumulative outputs; DELTA outputs not read yet are folded
together), failing it with an error, and aborting the request when its reader closes it
early. Filled by `AsyncLLM` on the event loop; knows nothing of the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from jvllm.outputs import RequestOutput


class RequestStream:
    """Outputs of one request, newest only. Iterate it; `close()` aborts it if unfinished.

    Lives on the event loop: only loop code touches it."""

    def __init__(
        self, request_id: str, on_close: Callable[[RequestStream], None], delta: bool = False
    ) -> None:
        self.request_id = request_id
        self.delta = delta  # DELTA outputs not read yet are folded together, not replaced
        self.queued = True  # not scheduled yet: counts against max_queued_requests
        self._on_close = on_close
        self._latest: RequestOutput | None = None
        self._error: Exception | None = None
        self._event = asyncio.Event()
        self._done = False

    @property
    def finished(self) -> bool:
        return self._done

    def _put(self, output: RequestOutput) -> None:
        if self.delta and self._latest is not None:
            self._latest.add(output)
        else:
            self._latest = output
        self._event.set()

    def _fail(self, error: Exception) -> None:
        self._error = error
        self._event.set()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        if self._latest is None and self._error is None:
            await self._event.wait()
        self._event.clear()
        output, self._latest = self._latest, None
        if output is None:
            self._done = True
            assert self._error is not None
            raise self._error
        if output.finished:
            self._done = True
        return output

    def close(self) -> None:
        """Aborts the request unless it already finished; safe to call twice."""
        if not self._done:
            self._done = True
            self._on_close(self)
