"""Pausing the server's engine loop (vLLM's `pause_generation` / `resume_generation`),
and running a caller's function on the engine thread between steps (`Call`).

Owns `Scheduling`, the engine thread's pause state: whether new requests are admitted
(while paused they are held, in order, until `resume`) and whether steps run. The three
modes are vLLM's: "abort" ends every request in flight (their streams get the aborted
outputs) and pauses once nothing is left; "wait" lets them finish first; "keep" stops
stepping at once, and the frozen requests continue where they were on `resume`. A
"wait" or "abort" pause may clear the prefix cache once drained (`clear_cache`);
a "keep" pause cannot, since its requests still hold blocks. Not owned: the loop
itself and the streams (`AsyncLLM`), what a `Call` does (`jvllm.weight_sync`).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES = ("abort", "wait", "keep")


class Call(NamedTuple):
    """A function of the engine, run on the engine thread; its result or error goes to
    `done`."""

    fn: Callable[[Any], Any]
    done: concurrent.futures.Future[Any]

    def run(self, engine: Any) -> None:
        if not self.done.set_running_or_notify_cancel():
            return  # the caller left
        try:
            self.done.set_result(self.fn(engine))
        except Exception as e:  # noqa: BLE001 - the caller gets it, the loop carries on
            self.done.set_exception(e)


def check_pause_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")


class Scheduling:
    """Engine-thread-owned pause state of one `AsyncLLM`."""

    def __init__(self) -> None:
        self.paused = False  # new requests are held until resume()
        self.stepping = True  # False: no step runs (paused and drained, or "keep")
        self.held: list[Any] = []  # adds that arrived while paused, in arrival order
        self.released: list[Any] = []  # held adds to apply now (after resume())
        self.flush = False  # one step due to hand the streams their aborted outputs
        # "wait"/"abort" pauses not yet drained: (future, clear_cache).
        self._draining: list[tuple[concurrent.futures.Future[None], bool]] = []

    def pause(
        self, engine: Any, mode: PauseMode, clear_cache: bool
    ) -> concurrent.futures.Future[None]:
        """Pauses; the future completes once the mode's pause holds (`settle`)."""
        check_pause_mode(mode)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.paused = True
        if mode == "keep":
            self.stepping = False
            done.set_result(None)
            return done
        if mode == "abort":
            ids = getattr(engine, "unfinished_request_ids", None)  # an engine-core client's
            for request_id in ids() if ids else list(engine.output_processor.requests):
                engine.abort_request(request_id)
            self.flush = True
        self._draining.append((done, clear_cache))
        return done

    def take_flush(self) -> bool:
        flush, self.flush = self.flush, False
        return flush

    def settle(self, engine: Any) -> None:
        """After each turn of the loop: a draining pause holds once no request is left."""
        if not self._draining or engine.has_unfinished_requests():
            return
        self.stepping = False
        for done, clear_cache in self._draining:
            if clear_cache:
                engine.reset_prefix_cache()
            done.set_result(None)
        self._draining.clear()

    def resume(self) -> None:
        """Steps run again; the held requests are released, in order."""
        self.paused, self.stepping = False, True
        self.released, self.held = self.released + self.held, []
        for done, _ in self._draining:  # a pause still draining ends here too
            done.set_result(None)
        self._draining.clear()

    def take_released(self) -> list[Any]:
        released, self.released = self.released, []
        return released
