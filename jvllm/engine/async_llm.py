"""AsyncLLM: the engine loop on its own thread, and one asyncio output stream per request.

Owns the only thread that may touch the `LLMEngine` (it is not thread-safe). Callers
on the event loop never call the engine: they queue commands (add, abort, stop) that
the engine thread applies between steps, and read each request's outputs from a
`RequestStream`. It also times requests (`jvllm.engine.request_timing`) for a
`LatencyObserver`, keeps a snapshot of `get_metrics()` that any
thread may read, and turns an engine crash into an error on every in-flight stream.

Streams are cumulative and coalescing: each item is the request's full output so far
(vLLM's CUMULATIVE kind), and a slow reader skips stale items rather than queueing
them, so memory stays bounded whatever the client's speed. Deltas are the reader's
job. A FINAL_ONLY request's stream gets its finished output alone (the engine still
reports it every step, for the latency observations, but nothing wakes its reader). It
does not build the engine (receive one, so this module never imports jax) and knows
nothing of HTTP.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from jvllm.engine.pause import Call, PauseMode, Scheduling, check_pause_mode
from jvllm.engine.request_stream import RequestStream
from jvllm.engine.request_timing import LatencyObserver, NoObserver, RequestTiming
from jvllm.engine.validation import InvalidRequestError
from jvllm.outputs import RequestOutput
from jvllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("jvllm.async_llm")

# Seconds a request's grammar may take to compile before the request is refused.
GRAMMAR_COMPILE_TIMEOUT_S = 30.0


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served any more."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting to be scheduled; retry later."""


class RequestAbortedError(RuntimeError):
    """The server gave up on this request (for example at a shutdown deadline)."""


class Engine(Protocol):
    """What AsyncLLM needs of `LLMEngine`."""

    tokenizer: Any
    max_model_len: int
    vocab_size: int
    # compile(StructuredOutputsParams) -> concurrent.futures.Future, and shutdown(); any
    # thread may call them.
    structured_outputs: Any

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        arrival_time: float | None,
        lora_request: Any = None,
    ) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def get_metrics(self) -> dict[str, float]: ...


class _Add(NamedTuple):
    request_id: str
    prompt: Any
    params: SamplingParams
    arrival: float
    done: concurrent.futures.Future[None]
    final_only: bool = False
    priority: int = 0
    lora_request: Any = None  # a LoRARequest: the adapter it runs with


class _Abort(NamedTuple):
    request_id: str


class _Stop(NamedTuple):
    pass


class AsyncLLM:
    """`await add_request(...)` -> RequestStream. Call `start()` on the event loop first."""

    def __init__(
        self,
        engine: Engine,
        max_queued_requests: int | None = None,
        observer: LatencyObserver | None = None,
        on_dead: Callable[[], None] | None = None,
        grammar_compile_timeout: float = GRAMMAR_COMPILE_TIMEOUT_S,
    ) -> None:
        self._engine = engine
        self.grammar_compile_timeout = grammar_compile_timeout
        # The frontend tokenizes with its own copy: Rust tokenizers are not safe to
        # share with the thread that detokenizes every step.
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.supported_tasks = getattr(engine, "supported_tasks", ("generate",))
        self.max_queued_requests = max_queued_requests
        self._observer: LatencyObserver = observer or NoObserver()
        self._on_dead = on_dead
        self._commands: queue.SimpleQueue[_Add | _Abort | _Stop | Call] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # loop-owned
        self._num_queued = 0  # loop-owned
        self._timings: dict[str, RequestTiming] = {}  # engine-thread-owned
        self._applying: list[_Add | _Abort | _Stop] = []  # engine-thread-owned
        self._scheduling = Scheduling()  # engine-thread-owned: pause_generation's state
        self._metrics: dict[str, float] = dict(engine.get_metrics())
        self._dead: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="jvllm-engine", daemon=True)

    # -- event-loop side --

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    def metrics(self) -> dict[str, float]:
        """The engine's `get_metrics()` as of its last step or command (any thread)."""
        return self._metrics

    async def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        priority: int = 0,
        lora_request: Any = None,
    ) -> RequestStream:
        """Queues a request; raises ValueError (bad input), QueueFullError or EngineDeadError.
        `priority`: lower first, with scheduling_policy="priority"."""
        self._check_alive()
        if self.max_queued_requests is not None and self._num_queued >= self.max_queued_requests:
            raise QueueFullError(f"{self._num_queued} requests are already waiting")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        spec = getattr(params, "structured_outputs", None)
        if spec is not None:
            await self._compile(spec)
        kind = getattr(params, "output_kind", None)
        delta, final_only = kind == RequestOutputKind.DELTA, kind == RequestOutputKind.FINAL_ONLY
        if final_only:
            # The engine reports its progress every step (TTFT and ITL are observed from
            # it); `_step` passes the stream its finished output only.
            params = params.clone(output_kind=RequestOutputKind.CUMULATIVE)
        stream = RequestStream(request_id, self._close_stream, delta)
        self._streams[request_id] = stream
        self._num_queued += 1
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        arrival = time.monotonic()
        add = _Add(request_id, prompt, params, arrival, done, final_only, priority, lora_request)
        self._commands.put(add)
        try:
            await asyncio.wrap_future(done)
        except BaseException:
            # Rejected, or the caller went away: either way nobody reads this stream.
            stream.close()
            raise
        return stream

    async def _compile(self, spec: Any) -> None:
        """Compiles a grammar on the compiler's threads, so the engine thread finds it
        ready; InvalidRequestError when it fails or takes over the time limit."""
        future = self._engine.structured_outputs.compile(spec)
        try:
            # Shielded: a timed-out compile still finishes, for the cache, uncancelled.
            waiting = asyncio.shield(asyncio.wrap_future(future))
            await asyncio.wait_for(waiting, self.grammar_compile_timeout)
        except TimeoutError:
            raise InvalidRequestError(
                f"structured_outputs.{spec.kind} took over {self.grammar_compile_timeout:g} s "
                "to compile",
                "structured_outputs",
            ) from None
        except ValueError as e:
            raise InvalidRequestError(str(e), "structured_outputs") from None

    def fail(self, reason: str) -> None:
        """Declares the engine dead from outside its loop (a multi-host peer was lost):
        in-flight requests fail with EngineDeadError, new ones are refused, /health
        answers 503, and `on_dead` runs (any thread)."""
        if self._dead is None:
            self._dead = reason
            self._call_on_loop(self._fail_all)

    def abort_all(self, reason: str) -> None:
        """Ends every in-flight request with RequestAbortedError(reason)."""
        for stream in list(self._streams.values()):
            stream._fail(RequestAbortedError(reason))
            self._close_stream(stream)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the engine thread after its current step."""
        if self._thread.is_alive():
            self._commands.put(_Stop())
            await asyncio.to_thread(self._thread.join, timeout)
        self._engine.structured_outputs.shutdown()

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(engine)` run on the engine thread between steps; its result."""
        self._check_alive()
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._commands.put(Call(fn, done))
        return await asyncio.wrap_future(done)

    async def pause_generation(
        self, *, mode: PauseMode = "abort", clear_cache: bool = True
    ) -> None:
        """vLLM's pause (`engine.pause`): requests in flight aborted, finished first
        ("wait") or frozen ("keep"); new ones wait for `resume_generation`."""
        check_pause_mode(mode)
        scheduling = self._scheduling
        paused = await self.call(lambda engine: scheduling.pause(engine, mode, clear_cache))
        await asyncio.wrap_future(paused)

    async def resume_generation(self) -> None:
        await self.call(lambda engine: self._scheduling.resume())

    async def is_paused(self) -> bool:
        return self._scheduling.paused

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def _close_stream(self, stream: RequestStream) -> None:
        if self._streams.pop(stream.request_id, None) is None:
            return
        self._unqueue(stream)
        if self._dead is None:
            self._commands.put(_Abort(stream.request_id))

    def _unqueue(self, stream: RequestStream) -> None:
        if stream.queued:
            stream.queued = False
            self._num_queued -= 1

    def _deliver(self, outputs: list[RequestOutput], started: list[str]) -> None:
        """Takes the requests whose first step ran (`started`) off the queued count, then
        hands each output to its stream."""
        for request_id in started:
            if (stream := self._streams.get(request_id)) is not None:
                self._unqueue(stream)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # closed by its reader; the abort is on its way
            stream._put(output)
            if output.finished:
                del self._streams[output.request_id]

    def _fail_all(self) -> None:
        error = EngineDeadError(self._dead or "the engine loop stopped")
        for stream in self._streams.values():
            stream._fail(error)
        self._streams.clear()
        self._num_queued = 0
        # Adds queued after the engine died would otherwise wait forever.
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                _settle(command.done, error)
        if self._on_dead is not None:
            self._on_dead()

    def _call_on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        # RuntimeError: the loop closed during shutdown, and nobody is left to tell.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(fn, *args)

    # -- engine thread --

    def _run(self) -> None:
        try:
            while True:
                scheduling = self._scheduling
                busy = self._engine.has_unfinished_requests() and scheduling.stepping
                if not self._apply(self._take_commands(block=not busy)):
                    return
                self._apply(scheduling.take_released())  # held while paused, now resumed
                stepping = self._engine.has_unfinished_requests() and scheduling.stepping
                if stepping or scheduling.take_flush():
                    self._step()
                scheduling.settle(self._engine)
                self._metrics = dict(self._engine.get_metrics())
        except Exception as e:
            logger.exception("the engine loop died")  # unknown engine state: fail-stop
            dead = f"the engine failed ({type(e).__name__}) and cannot serve requests"
            self._dead = str(e) if isinstance(e, EngineDeadError) else dead
            for command in self._applying:
                if isinstance(command, _Add):
                    _settle(command.done, EngineDeadError(self._dead))
            self._call_on_loop(self._fail_all)

    def _take_commands(self, block: bool) -> list[Any]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, commands: list[Any]) -> bool:
        """Applies commands in order; returns False on a stop command."""
        self._applying = commands
        for command in commands:
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Abort):
                self._engine.abort_request(command.request_id)
                timing = self._timings.pop(command.request_id, None)
                if timing is not None:
                    self._observer.finished(timing.aborted(time.monotonic()))
                continue
            if isinstance(command, Call):
                command.run(self._engine)
                continue
            if self._scheduling.paused:
                self._scheduling.held.append(command)  # admitted on resume
                continue
            if not command.done.set_running_or_notify_cancel():
                continue  # the caller left before its request was added: skip it
            try:
                c = command  # priority and adapter passed on only when set (engine fakes)
                extra: dict[str, Any] = {"priority": c.priority} if c.priority else {}
                if c.lora_request is not None:
                    extra["lora_request"] = c.lora_request
                self._engine.add_request(c.request_id, c.prompt, c.params, c.arrival, **extra)
            except ValueError as e:  # InvalidRequestError keeps the field it names
                command.done.set_exception(e)
                continue
            except TypeError as e:
                command.done.set_exception(ValueError(str(e)))
                continue
            params = command.params
            self._timings[command.request_id] = RequestTiming(
                command.arrival,
                n=getattr(params, "n", 1),
                max_tokens=getattr(params, "max_tokens", None),
                delta=getattr(params, "output_kind", None) == RequestOutputKind.DELTA,
                final_only=command.final_only,
            )
            command.done.set_result(None)
        return True

    def _step(self) -> None:
        start = time.monotonic()
        outputs = self._engine.step()
        now = time.monotonic()
        delivered: list[RequestOutput] = []
        started: list[str] = []  # scheduled for the first time: no longer queued
        for output in outputs:
            timing = self._timings.get(output.request_id)
            if timing is None:  # untimed (aborted since): the stream, if any, decides
                delivered.append(output)
                continue
            if not timing.scheduled:
                started.append(output.request_id)
            if self._time(output, timing, start, now):
                delivered.append(output)
        if delivered or started:
            self._call_on_loop(self._deliver, delivered, started)

    def _time(
        self, output: RequestOutput, timing: RequestTiming, step_start: float, now: float
    ) -> bool:
        """Observes the output's latencies; whether its stream wants it."""
        wanted = timing.on_output(output, step_start, now, self._observer)
        if output.finished:
            del self._timings[output.request_id]
        return wanted


def _settle(future: concurrent.futures.Future[None], error: Exception) -> None:
    """Fails `future` unless it is already done or was cancelled meanwhile."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        future.set_exception(error)
