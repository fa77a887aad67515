"""AsyncLLM against a fake engine (no jax, no HTTP): command ordering, aborts within one
step, the queue bound, coalescing streams, latency observations and engine death.

A paced fake engine runs a step only when the test hands it a ticket, so every
ordering these tests rely on is arranged, never waited out."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from jvllm.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    QueueFullError,
    RequestAbortedError,
)
from jvllm.engine.request_timing import E2E, ITL, QUEUE_TIME, TTFT, FinishedRequestStats
from jvllm.engine.structured_output import GrammarCompiler
from jvllm.outputs import CompletionOutput, RequestOutput
from jvllm.sampling_params import RequestOutputKind, SamplingParams


class FakeEngine:
    """One token per running request per step; at most `max_running` run at once.

    `paced`: each step first takes a ticket that `allow()` hands out, so the test
    decides how many steps run; `unpace()` lets it run freely again."""

    max_model_len, vocab_size, tokenizer = 64, 100, object()

    def __init__(self, max_running: int = 4, paced: bool = False) -> None:
        self.max_running = max_running
        self.requests: dict[str, tuple[int, list[int]]] = {}
        self.added: list[str] = []
        self.output_kinds: dict[str, RequestOutputKind] = {}
        self.steps = 0
        self.aborted_at: dict[str, int] = {}
        self.aborted = threading.Event()
        self.fail = threading.Event()
        self.thread_ids: set[int] = set()
        self._tickets = threading.Semaphore(0)
        # Steps that have begun waiting for their ticket: once step k + 1 waits, step k
        # has returned and AsyncLLM has queued its delivery on the event loop.
        self._waiting = 0
        self._waiting_changed = threading.Condition()
        self._paced = paced
        # The real compiler (no request here is constrained): AsyncLLM shuts it down.
        self.structured_outputs = GrammarCompiler(self.tokenizer, self.vocab_size, [0])

    def allow(self, steps: int = 1) -> None:
        self._tickets.release(steps)

    def wait_for_step(self, k: int) -> None:
        """Blocks until the k-th step waits for its ticket (so the ones before it ran)."""
        with self._waiting_changed:
            assert self._waiting_changed.wait_for(lambda: self._waiting >= k, timeout=60)

    def unpace(self) -> None:
        self._paced = False
        self._tickets.release()  # a step already waiting for its ticket

    def add_request(self, request_id, prompt, params, arrival_time=None, priority=0):
        self.thread_ids.add(threading.get_ident())
        if prompt == "bad":
            raise ValueError("prompt 'bad' is refused")
        self.added.append(request_id)
        self.output_kinds[request_id] = params.output_kind
        self.requests[request_id] = (params.max_tokens, [])

    def abort_request(self, request_id):
        self.aborted_at[request_id] = self.steps
        self.requests.pop(request_id, None)
        self.aborted.set()

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        self.thread_ids.add(threading.get_ident())
        if self._paced:
            with self._waiting_changed:
                self._waiting += 1
                self._waiting_changed.notify_all()
            self._tickets.acquire()
        if self.fail.is_set():
            raise RuntimeError("device lost")
        self.steps += 1
        outputs = []
        for rid in list(self.requests)[: self.max_running]:
            max_tokens, tokens = self.requests[rid]
            tokens.append(len(tokens))
            done = len(tokens) >= max_tokens
            reason = "length" if done else None
            completion = CompletionOutput(0, "x" * len(tokens), list(tokens), None, None, reason)
            outputs.append(RequestOutput(rid, None, [1], None, [completion], done))
            if done:
                del self.requests[rid]
        return outputs

    def get_metrics(self):
        return {"num_requests_running": min(len(self.requests), self.max_running)}


class Observer:
    def __init__(self) -> None:
        self.seen: dict[str, list[float]] = {}
        self.finished_stats: list[FinishedRequestStats] = []

    def observe(self, name: str, seconds: float) -> None:
        self.seen.setdefault(name, []).append(seconds)

    def finished(self, stats: FinishedRequestStats) -> None:
        self.finished_stats.append(stats)


async def loop_turns(n: int = 3) -> None:
    """Lets the event loop run what is queued on it (a delivery, a reader it woke)."""
    loop = asyncio.get_running_loop()
    for _ in range(n):
        turn = loop.create_future()
        loop.call_soon(turn.set_result, None)
        await turn


def run(coro_fn, engine: FakeEngine, **kw):
    async def main():
        llm = AsyncLLM(engine, **kw)
        llm.start()
        try:
            return await coro_fn(llm)
        finally:
            engine.unpace()
            await llm.shutdown()

    return asyncio.run(main())


async def queue_add(llm: AsyncLLM, request_id: str, max_tokens: int) -> asyncio.Task:
    """Starts an add and returns once its command is queued for the engine thread."""
    queued = llm._num_queued
    params = SamplingParams(max_tokens=max_tokens)
    task = asyncio.ensure_future(llm.add_request(request_id, "p", params))
    await asyncio.sleep(0)  # one turn of the loop: the task runs up to its wait
    assert llm._num_queued == queued + 1, "the add did not queue its command"
    return task


def test_outputs_are_cumulative_and_observed_on_the_engine_thread():
    engine, observer = FakeEngine(), Observer()

    async def go(llm):
        stream = await llm.add_request("a", "p", SamplingParams(max_tokens=5))
        return [out async for out in stream]

    outs = run(go, engine, observer=observer)
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == [0, 1, 2, 3, 4]
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == sorted(lengths)  # cumulative; a slow reader may skip some
    assert threading.get_ident() not in engine.thread_ids and len(engine.thread_ids) == 1
    assert len(observer.seen[QUEUE_TIME]) == len(observer.seen[TTFT]) == 1
    assert len(observer.seen[ITL]) == 4 and len(observer.seen[E2E]) == 1
    (stats,) = observer.finished_stats
    assert (stats.finish_reason, stats.num_prompt_tokens, stats.num_generation_tokens) == (
        "length",
        1,
        5,
    )
    assert (stats.n, stats.max_tokens) == (1, 5)
    # The phases add up: queued, then prefill to the first token, then decode.
    assert stats.e2e_latency == pytest.approx(
        stats.queued_time + stats.prefill_time + stats.decode_time
    )
    assert stats.inference_time == pytest.approx(stats.prefill_time + stats.decode_time)
    assert stats.mean_time_per_output_token == pytest.approx(stats.decode_time / 4)
    assert stats.e2e_latency == pytest.approx(observer.seen[E2E][0])


def test_final_only_stream_gets_its_finished_output_alone_and_every_latency():
    engine, observer = FakeEngine(paced=True), Observer()
    params = SamplingParams(max_tokens=5, output_kind=RequestOutputKind.FINAL_ONLY)

    async def go(llm):
        stream = await llm.add_request("a", "p", params)
        outs = []

        async def read():
            outs.extend([out async for out in stream])

        reader = asyncio.ensure_future(read())
        for k in range(2, 6):  # one step at a time, the reader given every chance to wake
            engine.allow()
            await asyncio.to_thread(engine.wait_for_step, k)
            await loop_turns()
        engine.allow()  # the last step: nothing waits after it
        await reader
        return outs

    outs = run(go, engine, observer=observer)
    assert len(outs) == 1 and outs[0].finished
    assert outs[0].outputs[0].token_ids == [0, 1, 2, 3, 4]
    # The engine reported every step (a cumulative request to it); the caller's params
    # are unchanged.
    assert engine.output_kinds == {"a": RequestOutputKind.CUMULATIVE}
    assert params.output_kind is RequestOutputKind.FINAL_ONLY
    assert len(observer.seen[TTFT]) == 1 and len(observer.seen[ITL]) == 4
    assert len(observer.seen[E2E]) == 1


def test_bad_request_raises_value_error_and_frees_its_slot():
    async def go(llm):
        with pytest.raises(ValueError, match="refused"):
            await llm.add_request("a", "bad", SamplingParams())
        stream = await llm.add_request("b", "p", SamplingParams(max_tokens=2))
        return [o async for o in stream][-1]

    assert run(go, FakeEngine(), max_queued_requests=1).finished


def test_close_aborts_before_the_next_step():
    engine = FakeEngine(paced=True)

    async def go(llm):
        stream = await llm.add_request("a", "p", SamplingParams(max_tokens=1000))
        engine.allow(3)
        async for out in stream:
            if len(out.outputs[0].token_ids) == 3:
                break
        steps_at_close = engine.steps  # 3: the fourth step waits for its ticket
        stream.close()
        engine.allow(1)
        await asyncio.to_thread(engine.aborted.wait)
        return steps_at_close

    steps_at_close = run(go, engine)
    assert steps_at_close == 3
    assert engine.aborted_at["a"] - steps_at_close <= 1
    assert not engine.requests


def test_caller_cancelled_before_its_add_is_applied():
    engine = FakeEngine(paced=True)

    async def go(llm):
        busy = await llm.add_request("a", "p", SamplingParams(max_tokens=4))
        # The engine is now in (or entering) a step it has no ticket for, so "b" is
        # taken only after that step: cancelled by then.
        task = await queue_add(llm, "b", max_tokens=4)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task  # the cancel has reached the engine's side of the command too
        engine.unpace()
        # Commands apply in order, so once "c" is added the engine has passed over "b".
        later = await llm.add_request("c", "p", SamplingParams(max_tokens=2))
        assert engine.added == ["a", "c"] and not llm.is_dead
        return [o async for o in busy][-1].finished and [o async for o in later][-1].finished

    assert run(go, engine)


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY])
def test_queue_bound(kind):
    engine = FakeEngine(max_running=1, paced=True)

    async def go(llm):
        running = await llm.add_request("a", "p", SamplingParams(max_tokens=50, output_kind=kind))
        engine.allow(1)
        # Its first step ran: no longer queued (a FINAL_ONLY stream has no output yet).
        await asyncio.to_thread(engine.wait_for_step, 2)
        await loop_turns(1)  # the step's delivery, queued before the second step began
        assert llm._num_queued == 0
        adding = await queue_add(llm, "b", max_tokens=2)
        engine.allow(1)  # adds apply between steps: this one after the second
        waiting = await adding  # queued behind "a", which holds the only running slot
        with pytest.raises(QueueFullError):
            await llm.add_request("c", "p", SamplingParams(max_tokens=2))
        running.close()
        engine.unpace()
        return [o async for o in waiting][-1]

    assert run(go, engine, max_queued_requests=1).finished


def test_abort_all_errors_every_stream():
    engine = FakeEngine(paced=True)

    async def go(llm):
        stream = await llm.add_request("a", "p", SamplingParams(max_tokens=1000))
        engine.allow(1)
        await stream.__anext__()
        llm.abort_all("shutting down")
        with pytest.raises(RequestAbortedError, match="shutting down"):
            async for _ in stream:
                pass

    run(go, engine)


def test_engine_death_errors_streams_and_later_requests():
    engine, died = FakeEngine(paced=True), []

    async def go(llm):
        stream = await llm.add_request("a", "p", SamplingParams(max_tokens=1000))
        engine.allow(1)
        await stream.__anext__()
        engine.fail.set()
        engine.allow(1)
        with pytest.raises(EngineDeadError, match="RuntimeError"):
            async for _ in stream:
                pass
        assert llm.is_dead and died == [True]
        with pytest.raises(EngineDeadError):
            await llm.add_request("b", "p", SamplingParams())

    run(go, engine, on_dead=lambda: died.append(True))
